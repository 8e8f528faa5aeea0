"""One graph shard: a partition's adjacency and a share of the edge features, in one process.

`ShardCore` is plain Python (the Ray actor wraps it unchanged). It holds:
- the adjacency of the nodes it owns: every event (u, v, t, eid) as the half-edge u -> v when it
  owns u and v -> u when it owns v, in a `DynamicGraph` of directed half-edges, inserted in the
  order one graph storing both directions would insert them, so its answers to `sample_hop` for
  its roots are exactly that graph's;
- edge features of the eids it is responsible for, eid mod P == p, at local row eid // P. An
  edge's row is stored once, not at both endpoint owners, and any reader routes a fetch by the
  eid alone (which is what the trainers' feature caches key by). Rows arrive encoded in the
  store's precision (`encode_features`, by whoever routes events, from one generator), so
  stochastic rounding (int8, bf16) gives the same rows whatever P;
- its own sampler generator (`uniform` draws) and the count of distinct events it holds;
- with sharded node state (`state_model` given), its nodes' state rows (`ShardNodeState`).

`route_events` cuts a batch of events into the pieces each shard ingests; the group (local or
Ray) calls it once per batch and sends each shard only its piece.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from tidegraph.comm.quantize import quantize_rows
from tidegraph.sampling.block import Block
from tidegraph.sampling.sampler import TemporalSampler
from tidegraph.storage.checkpoint import (
    CheckpointStore,
    DeltaTables,
    TensorRef,
    chunks_of,
    gathered,
    put_state,
)
from tidegraph.storage.events import EventBatch
from tidegraph.storage.features import EncodedRows, HostFeatureStore, decode, encode
from tidegraph.storage.graph import DynamicGraph
from tidegraph.timeline import Tracer
from tidegraph.training.state import ShardNodeState, encode_state_rows

__all__ = ["ShardBatch", "ShardCore", "encode_features", "route_batch", "route_events"]


@dataclass
class ShardBatch:
    """What one shard ingests from a batch: half-edges it owns, feature rows it keeps."""

    node: torch.Tensor
    nbr: torch.Tensor
    t: torch.Tensor
    eid: torch.Tensor
    num_events: int  # distinct events among the half-edges
    feat_eid: torch.Tensor
    feat: EncodedRows | None


def encode_features(
    events: EventBatch, precision: str, generator: torch.Generator | None
) -> EncodedRows | None:
    """The batch's edge features in the stores' precision; a value that the precision would
    turn into an infinity is an error naming its event (eid)."""
    if events.edge_feat is None:
        return None
    try:
        return encode(events.edge_feat, precision, True, generator)
    except ValueError as exc:
        row = getattr(exc, "row", None)
        if row is None:
            raise
        raise ValueError(f"event {int(events.eid[row])}: {exc.message}") from None


def route_events(
    events: EventBatch,
    owner_src: torch.Tensor,
    owner_dst: torch.Tensor,
    num_parts: int,
    encoded: EncodedRows | None = None,
) -> list[ShardBatch]:
    """Per shard, its half-edges (interleaved u -> v, v -> u per event, as one graph stores
    both directions) and the feature rows of eids mod P == p (`encoded`: the batch's rows
    encoded; None: its float32 features as they are)."""
    if encoded is None and events.edge_feat is not None:
        encoded = EncodedRows(events.edge_feat.to(torch.float32))
    node = torch.stack([events.src, events.dst], 1).flatten()
    nbr = torch.stack([events.dst, events.src], 1).flatten()
    t = events.t.repeat_interleave(2)
    eid = events.eid.repeat_interleave(2)
    own = torch.stack([owner_src, owner_dst], 1).flatten()
    feat_owner = torch.remainder(events.eid, num_parts)
    out = []
    for p in range(num_parts):
        if num_parts == 1:
            keep, fkeep = slice(None), slice(None)
            n_events = len(events)
        else:
            keep = (own == p).nonzero().squeeze(1)
            fkeep = (feat_owner == p).nonzero().squeeze(1)
            n_events = int(((owner_src == p) | (owner_dst == p)).sum())
        feat = None
        if encoded is not None:
            scale = None if encoded.scale is None else encoded.scale[fkeep]
            feat = EncodedRows(encoded.data[fkeep], scale)
        out.append(
            ShardBatch(node[keep], nbr[keep], t[keep], eid[keep], n_events, events.eid[fkeep], feat)
        )
    return out


def route_batch(
    partitioner, events: EventBatch, precision: str, generator: torch.Generator | None
) -> list[ShardBatch]:
    """Place the batch's new nodes, encode its features, and cut it into each shard's piece
    (what every group does with a batch before its shards ingest it)."""
    partitioner.assign(events.src, events.dst)
    own_src, own_dst = partitioner.owner(events.src), partitioner.owner(events.dst)
    encoded = encode_features(events, precision, generator)
    return route_events(events, own_src, own_dst, partitioner.num_parts, encoded)


def _served(method):
    """A shard request recorded as a timeline span (category "shard"; an ingest "ingest")
    when tracing."""

    # ingests are few and kept; requests only where they meet a recorded step
    cat = "ingest" if method.__name__ == "ingest" else "shard"

    @functools.wraps(method)
    def served(self, *args, **kwargs):
        if not self.tracer.enabled:
            return method(self, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.tracer.record(method.__name__, t0, time.perf_counter(), cat, part=self.part)

    return served


class ShardCore:
    """Partition `part` of `num_parts`: adjacency, its share of edge features, a sampler."""

    def __init__(
        self,
        part: int,
        num_parts: int,
        *,
        edge_dim: int = 0,
        feature_precision: str = "fp32",
        strategy: str = "recent",
        seed: int | None = None,
        feature_seed: int = 0,
        graph_device: str = "cpu",
        pin_memory: bool = False,
        state_model=None,
        timeline: int = 0,
    ) -> None:
        """`timeline`: record the requests served (`tidegraph.timeline`; 0: off)."""
        if not 0 <= part < num_parts:
            raise ValueError(f"ShardCore: part must be in [0, {num_parts}), got {part}")
        self.part = part
        self.num_parts = num_parts
        self.graph = DynamicGraph(device=graph_device, add_reverse=False)
        # (store, refs of the graph's pieces written there, the eid they end at)
        self._pieces: tuple[str, list, int] | None = None
        self._deltas = DeltaTables()  # node-state tables written as changed rows
        # fanouts are per request; this sampler answers one hop at a time
        self.sampler = TemporalSampler(self.graph, (1,), strategy, seed=seed)
        self.features = None
        if edge_dim:
            self.features = HostFeatureStore(
                dim=edge_dim, precision=feature_precision, pin_memory=pin_memory,
                seed=feature_seed,
            )  # fmt: skip
        self.num_events = 0  # distinct events whose half-edges are here
        self.node_state = None if state_model is None else ShardNodeState(state_model)
        self.tracer = Tracer(f"shard {part}", timeline, tid=part, process="shards")

    def take_trace(self) -> list[dict]:
        """Requests served since the last call, as timeline spans."""
        return self.tracer.take()

    # ---- ingest -----------------------------------------------------------------------------

    @_served
    def ingest(self, batch: ShardBatch) -> None:
        """Store the half-edges and feature rows of one routed batch. The graph validates the
        batch first (ids, times) and changes nothing when it is bad; feature rows and state
        rows are written after it, by id, so writing them again is harmless."""
        g = self.graph.device
        if batch.node.numel():
            self.graph.add_edges(batch.node.to(g), batch.nbr.to(g), batch.t.to(g), batch.eid.to(g))
        if self.features is not None and batch.feat is not None and batch.feat_eid.numel():
            self.features.put_encoded(batch.feat_eid // self.num_parts, batch.feat)
        if self.node_state is not None:
            self.node_state.add_nodes(batch.node)
        self.num_events += batch.num_events

    # ---- queries ----------------------------------------------------------------------------

    @_served
    def sample_hop(
        self,
        roots: torch.Tensor,
        t_hi: torch.Tensor,
        k: int,
        t_lo: torch.Tensor | None = None,
        key: int | None = None,
    ) -> Block:
        """Up to k visible edges (t_lo <= t < t_hi) of each root (roots this shard owns), as
        tensors on the graph's device; `key`: of `uniform` draws (`TemporalSampler`)."""
        g = self.graph.device
        t_lo = None if t_lo is None else t_lo.to(g)
        return self.sampler.sample_hop(roots.to(g), t_hi.to(g), k, t_lo, key)

    @_served
    def fetch(self, eids: torch.Tensor, int8: bool = False) -> EncodedRows:
        """Stored feature rows of `eids` (each with eid mod P == this part); with `int8`, as
        int8 with one scale per row (`comm.rows_int8`: a quarter of fp32's bytes on the wire;
        rows stored int8 already go as they are). Rounding is to nearest, a function of the
        rows alone, so an in-process shard and a shard actor send the same codes."""
        if self.features is None:
            raise ValueError("ShardCore.fetch: this stream has no edge features")
        rows = self.features.fetch(eids // self.num_parts)
        if not int8 or rows.scale is not None:
            return rows
        q = quantize_rows(decode(rows))
        return EncodedRows(q.values, q.scales)

    def sampler_state(self) -> dict:
        return self.sampler.state_dict()

    def load_sampler_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    @_served
    def read_state(
        self, ids: torch.Tensor, names: tuple[str, ...] | None = None, int8: bool = False
    ) -> dict:
        """Node-state rows of `ids` (nodes this shard owns), table by table; with `int8`
        (`comm.rows_int8`) every float32/16 table of rows (memory, mails) as int8 codes with
        a scale per row (`encode_state_rows`; times are float64 and go as they are)."""
        rows = self.node_state.read(ids, names)
        return encode_state_rows(rows) if int8 else rows

    @_served
    def apply_state(self, updates: list) -> None:
        """The part of one step's merged node-state updates that concerns this shard's nodes."""
        self.node_state.apply(updates)

    def reset_state(self) -> None:
        self.node_state.reset()

    def node_state_dict(self) -> dict:
        return self.node_state.state_dict()

    def load_node_state_dict(self, state: dict) -> None:
        self.node_state.load_state_dict(state)

    @property
    def num_feature_rows(self) -> int:
        return 0 if self.features is None else self.features.num_rows

    def report(self) -> dict:
        return {
            "part": self.part,
            "events": self.num_events,
            "stored_edges": self.graph.num_stored_edges,
            "bytes": self.graph.memory_bytes()
            + (0 if self.features is None else self.features.nbytes),
        }

    # ---- state ------------------------------------------------------------------------------

    def state_chunks(self, store: str) -> dict:
        """`state_dict()` with its large tensors written to the checkpoint store at `store`
        and refs in their place: a checkpoint's bulk written where it is held. The graph is
        its pieces (`DynamicGraph.piece_state`): those written to this store before, by
        reference, and one of the edges added since, so no edge is written twice however
        the segments merge."""
        state = self.state_dict()
        have = CheckpointStore.at(store).chunk_keys()  # one listing for every put here
        if self.graph.ordered:
            held_store, pieces, end = self._pieces or (store, [], 0)
            # another store, or pieces deleted by retention while checkpoints went through
            # the driver (a second node was up): none of them is there to reference
            if held_store != store or not chunks_of(pieces) <= have:
                pieces, end = [], 0
            if self.graph.eid_end > end:
                new = self.graph.rows_since(end)
                pieces = [*pieces, put_state(store, new, inline=0, have=have)]
            self._pieces = (store, pieces, self.graph.eid_end)
            state["graph"] = self.graph.piece_state(pieces)
        if self.node_state is not None:  # the rows changed since the last checkpoint
            tables = state["node_state"]["tables"]
            tables.update(self._deltas.put_tables(store, tables, self.node_state.model, have))
        return put_state(store, state, have=have)

    def state_gathered(self, store: str, have: set[str]) -> tuple[dict, dict]:
        """`state_chunks(store)` for a store this process does not reach, and the chunks to
        write there (`checkpoint.gathered`: the caller writes them)."""
        return gathered(lambda: self.state_chunks(store), have)

    def load_chunks(self, state: dict, store: str) -> None:
        """`load_state_dict` of a state whose large tensors are refs to the checkpoint store
        at `store` (read here, where they are held: not through the driver); the graph's
        pieces are kept by reference for the next checkpoints to that store."""
        self.load_state_dict(CheckpointStore.at(store).resolve(state))
        pieces = state["graph"].get("pieces")
        rows = [p["rows"] if isinstance(p, dict) else p for p in pieces or ()]
        if pieces is not None and all(isinstance(r, TensorRef) for r in rows):
            self._pieces = (store, list(pieces), self.graph.eid_end)

    def state_dict(self) -> dict:
        return {
            "part": self.part,
            "num_parts": self.num_parts,
            "graph": self.graph.state_dict(),
            "sampler": self.sampler.state_dict(),
            "features": None if self.features is None else self.features.state_dict(),
            "num_events": self.num_events,
            "node_state": None if self.node_state is None else self.node_state.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._pieces = None  # the graph is replaced: nothing written is known to be it
        self._deltas.forget()
        if (state["part"], state["num_parts"]) != (self.part, self.num_parts):
            raise ValueError(
                f"ShardCore.load_state_dict: state of shard {state['part']}/{state['num_parts']}"
                f", this is shard {self.part}/{self.num_parts}"
            )
        self.graph.load_state_dict(state["graph"])
        self.sampler.load_state_dict(state["sampler"])
        if self.features is not None:
            self.features.load_state_dict(state["features"])
        self.num_events = state["num_events"]
        if self.node_state is not None:
            self.node_state.load_state_dict(state["node_state"])
