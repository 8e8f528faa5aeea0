"""Same-node sampling over a shard's immutable segments, shared through Ray's object store.

A graph shard's segments never change once built, so a shard actor publishes each as numpy
arrays in the object store (`SegmentPublisher`) and keeps the store's copy in place of its
own, and a trainer on the same node maps them without a copy (`SegmentView`) and samples its
roots there: no request, no serialization per hop. Compaction
replaces segments by merged ones, which are published in their turn; a view drops the ones its
shard no longer lists. Trainers on other nodes keep asking the shard (`RemoteShard`), so no
node holds a copy of another node's partition. For `recent` sampling both paths return the same
blocks; `uniform` draws then come from each trainer's copy of the shard's sampler stream.
"""

from __future__ import annotations

import warnings

import numpy as np
import ray
import torch

from tidegraph.runtime import release_free_memory
from tidegraph.sampling.sampler import TemporalSampler
from tidegraph.storage.segment import Segment

__all__ = ["SegmentPublisher", "SegmentView"]

_ARRAYS = ("nodes", "offsets", "nbr", "t", "eid")


class SegmentPublisher:
    """The shard side: one object-store entry per live segment, reused while it lives. A
    host segment, once published, is replaced in the graph by its object-store copy (mapped
    without a copy, read-only: segments never change), so the shard's node holds it once,
    for the shard and its same-node trainers alike."""

    def __init__(self) -> None:
        self._live: dict[int, tuple[Segment, ray.ObjectRef]] = {}

    def refs(self, graph) -> list[ray.ObjectRef]:
        """Refs of `graph`'s segments (oldest first), publishing the new ones."""
        live, segments, replaced = {}, list(graph.segments), False
        for i, seg in enumerate(segments):
            entry = self._live.get(id(seg))
            if entry is None or entry[0] is not seg:
                arrays = {k: getattr(seg, k).cpu().numpy() for k in _ARRAYS}
                meta = (seg.max_degree, seg.t_min, seg.t_max)
                ref = ray.put((arrays, meta))
                if seg.host is None and seg.nbr.device.type == "cpu":
                    segments[i] = seg = _segment(*ray.get(ref))
                    replaced = True
                entry = (seg, ref)
            live[id(seg)] = entry
        graph.segments = segments
        self._live = live  # segments merged away are released here
        if replaced:  # the heap the replaced copies held goes back to the OS
            release_free_memory()
        return [entry[1] for entry in live.values()]


class _GraphView:
    """What `TemporalSampler.sample_hop` reads of a graph: its segments and device."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.device = torch.device("cpu")


class SegmentView:
    """A trainer's zero-copy view of a same-node shard, answering `sample_hop` locally."""

    def __init__(self, strategy: str, seed: int | None) -> None:
        self.graph = _GraphView()
        self.sampler = TemporalSampler(self.graph, (1,), strategy, seed=seed)
        self._cache: dict[bytes, Segment] = {}

    def update(self, refs: list[ray.ObjectRef]) -> None:
        keys = [r.binary() for r in refs]
        new = [r for r, k in zip(refs, keys, strict=True) if k not in self._cache]
        for ref, (arrays, meta) in zip(new, ray.get(new), strict=True):
            self._cache[ref.binary()] = _segment(arrays, meta)
        self._cache = {k: self._cache[k] for k in keys}
        self.graph.segments = [self._cache[k] for k in keys]

    def sample_hop(self, roots, t_hi, k, t_lo=None, key=None):
        return self.sampler.sample_hop(roots, t_hi, k, t_lo, key)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()


def _segment(arrays: dict[str, np.ndarray], meta: tuple) -> Segment:
    with warnings.catch_warnings():  # object-store arrays are read-only; segments never write
        warnings.simplefilter("ignore", UserWarning)
        tensors = {k: torch.from_numpy(arrays[k]) for k in _ARRAYS}
    max_degree, t_min, t_max = meta
    return Segment(**tensors, max_degree=max_degree, t_min=t_min, t_max=t_max)
