"""`sampler.history: batch` (PyG's TGN protocol): no event sees an earlier event of its batch.

The reference is brute force (`tests/reference.py`): with a cap c, a root (v, t) sees the
edges of v strictly before min(t, c), newest first, and keeps its own time t (`dt` from it);
next-hop roots are the neighbours at their edges' times (older than c already). Over shards
the blocks equal one graph's, and a run on Ray equals the in-process group's, bitwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from reference import ReferenceGraph

from tidegraph.orchestrator import make_group
from tidegraph.runtime import set_determinism
from tidegraph.sampling import TemporalSampler
from tidegraph.sampling.multihop import MultiHopSampler
from tidegraph.storage import DynamicGraph
from tidegraph.storage.partition import HashPartitioner
from tidegraph.training import ContinualLearner, RunConfig, load_stream
from tidegraph.training.config import SamplerConfig
from tidegraph.training.offline import train_pass
from tidegraph.training.shard import ShardCore, route_events

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402

NAMES = ("dst_ids", "dst_ts", "nbr_ids", "nbr_ts", "nbr_eids", "dt", "mask")


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", 1500)


def _graphs(seed: int = 3, n: int = 400):
    gen = torch.Generator().manual_seed(seed)
    src, dst = torch.randint(0, 30, (2, n), generator=gen)
    t = torch.randint(0, 60, (n,), generator=gen).double()  # many equal times
    graph, ref = DynamicGraph(), ReferenceGraph()
    for lo in range(0, n, 150):  # several segments
        graph.add_edges(src[lo : lo + 150], dst[lo : lo + 150], t[lo : lo + 150])
        ref.add_edges(src[lo : lo + 150], dst[lo : lo + 150], t[lo : lo + 150])
    return graph, ref, gen


@pytest.mark.parametrize("cap", [0.0, 25.0, 40.5, 1e9])
def test_capped_hops_match_the_brute_force_reference(cap):
    graph, ref, gen = _graphs()
    roots = torch.randint(0, 30, (50,), generator=gen)
    ts = torch.randint(20, 60, (50,), generator=gen).double()
    blocks = TemporalSampler(graph, [4, 3]).sample(roots, ts, t_cap=cap)
    want_roots, want_ts = roots.tolist(), ts.tolist()
    for block, k in zip(blocks, [4, 3], strict=True):
        assert block.dst_ids.tolist() == want_roots and block.dst_ts.tolist() == want_ts
        rows = []
        for r, (v, t) in enumerate(zip(want_roots, want_ts, strict=True)):
            want = ref.neighbors(v, min(t, cap))[:k]
            m = block.mask[r]
            got = list(zip(block.nbr_ids[r][m].tolist(), block.nbr_ts[r][m].tolist(),
                           block.nbr_eids[r][m].tolist(), strict=True))  # fmt: skip
            assert got == want, (r, v, t)
            rows.append(want)
        valid_dt = block.dt[block.mask]
        assert torch.equal(valid_dt, (block.dst_ts.unsqueeze(1) - block.nbr_ts)[block.mask].float())
        assert (block.dt[~block.mask] == 0).all()
        assert (block.nbr_ts[~block.mask] == block.dst_ts.unsqueeze(1).expand_as(block.mask)[
            ~block.mask]).all()  # fmt: skip
        want_roots = want_roots + [n for row in rows for n, _, _ in row]
        want_ts = want_ts + [t for row in rows for _, t, _ in row]


def test_no_cap_and_an_infinite_cap_give_the_same_blocks():
    graph, _, gen = _graphs(seed=5)
    roots = torch.randint(0, 30, (64,), generator=gen)
    ts = torch.randint(0, 60, (64,), generator=gen).double()
    sampler = TemporalSampler(graph, [5, 2], dedup=True)
    for a, b in zip(sampler.sample(roots, ts), sampler.sample(roots, ts, t_cap=1e18), strict=True):
        for name in NAMES:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.next_index is None) == (b.next_index is None)


def test_capped_sampling_over_shards_equals_one_graph(wiki):
    ev = wiki.events.select(slice(0, 1500))
    graph = DynamicGraph()
    for lo in range(0, 1500, 500):
        b = ev.select(slice(lo, lo + 500))
        graph.add_edges(b.src, b.dst, b.t, b.eid)
    roots = torch.cat([ev.src[1200:1400], ev.dst[1200:1400]])
    ts = torch.cat([ev.t[1200:1400], ev.t[1200:1400]])
    cap = float(ev.t[1200])
    one = TemporalSampler(graph, [5, 3], dedup=True).sample(roots, ts, t_cap=cap)
    part = HashPartitioner(2)
    shards = [ShardCore(p, 2) for p in range(2)]
    for lo in range(0, 1500, 500):
        b = ev.select(slice(lo, lo + 500))
        for shard, piece in zip(shards, route_events(b, part.owner(b.src), part.owner(b.dst), 2),
                                strict=True):  # fmt: skip
            shard.ingest(piece)
    many = MultiHopSampler(shards, part.owner, [5, 3], dedup=True).sample(roots, ts, t_cap=cap)
    for a, b in zip(one, many, strict=True):
        for name in NAMES:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert bool((a.nbr_eids[a.mask] < 1200).all())  # nothing of the batch itself


def test_history_is_checked_by_name():
    assert SamplerConfig(history="batch").history == "batch"
    with pytest.raises(ValueError, match="sampler.history"):
        SamplerConfig(history="step")


class _Recording:
    """Wraps a trainer's sampler: the first hop of every request."""

    def __init__(self, sampler) -> None:
        self.sampler, self.seen = sampler, []

    def sample(self, roots, ts, **options):
        blocks = self.sampler.sample(roots, ts, **options)
        self.seen.append(blocks[0])
        return blocks


def _learner(
    history: str, stream, trainers: int = 1, backend: str = "local", shards: int = 1, **cluster
):
    raw = reference_run.reference_config("tgn")
    raw["sampler"] = {"history": history}
    raw["model"]["slot_precision"] = "fp32"
    raw["cluster"] = {"backend": backend, "shards": shards, "trainers": trainers, **cluster}
    raw["run_name"] = "tidegraph-test-fair"
    return ContinualLearner(RunConfig.from_dict(raw), stream, make_group)


@pytest.mark.parametrize("history", ["event", "batch"])
def test_batch_history_sees_nothing_of_its_own_batch(wiki, history):
    learner = _learner(history, wiki)
    trainer = learner.group.trainers[0]
    trainer.sampler = rec = _Recording(trainer.sampler)
    n = 600
    learner.ingest(0, n)
    train_pass(learner, 0, n, "train")
    in_batch = 0
    for block, lo in zip(rec.seen, range(0, n, 100), strict=True):  # batches of 100 events
        eids = block.nbr_eids[block.mask]
        assert bool((eids < lo + 100).all())  # never an event of a later batch
        assert bool((block.nbr_ts < block.dst_ts.unsqueeze(1))[block.mask].all())
        in_batch += int((eids >= lo).sum())
    assert (in_batch == 0) == (history == "batch")


def test_batch_history_learns_and_differs_from_event_history(wiki):
    set_determinism(7, threads=1)
    runs = {}
    for history in ("event", "batch"):
        learner = _learner(history, wiki)
        learner.run_phase1()
        runs[history] = learner.history[-1]
    assert runs["batch"]["val_ap"] > 0.52, runs  # a tiny model after one epoch
    assert runs["batch"]["val_ap"] != runs["event"]["val_ap"]


# the default suite: a task per step with the node state on the shards (evaluation slices
# capped by the driver); a whole pass per task (in the default suite: test_backends' combined
# tgn run, batch history bitwise on both backends), one trainer, and a task per step with
# replicated node state: slow
@pytest.mark.parametrize(("trainers", "cluster"), [
    pytest.param(2, {}, marks=pytest.mark.slow), (2, {"memory": "sharded"}),
    pytest.param(1, {}, marks=pytest.mark.slow),
    pytest.param(2, {"whole_passes": False}, marks=pytest.mark.slow),
])  # fmt: skip
def test_batch_history_on_ray_equals_the_local_group(ray_session, wiki, trainers, cluster):
    """Shards answer capped requests; the trainer's hop loop restores own times: on Ray
    (two shard actors, one or two trainer actors) the run is the in-process group's,
    bitwise. With two, every slice is capped at its global batch's start: training slices
    carry it, evaluation slices of a whole pass agree on it (a collective), and evaluation
    tasks per slice (a task per step, node state on the shards) get it from the driver."""
    out = []
    for backend in ("local", "ray"):
        set_determinism(7, threads=1)
        learner = _learner("batch", wiki, trainers, backend=backend, shards=2, **cluster)
        try:
            learner.run_phase1()
            out.append((learner.group.model_state(), learner.history))
        finally:
            learner.group.shutdown()
    (local, h_local), (remote, h_remote) = out
    assert local.keys() == remote.keys()
    assert all(torch.equal(local[k], remote[k]) for k in local)
    assert [h.get("val_ap") for h in h_local] == [h.get("val_ap") for h in h_remote]
