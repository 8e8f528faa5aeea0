"""Node partitioning for graph shards: which shard owns a node, and how good the cut is.

Each event is stored at the shard that owns its source and, reversed, at the one that owns its
destination (DESIGN.md, "Distributed semantics"), so a node's whole history is on its owner and
one request per shard per hop samples any set of roots. The node -> shard map is state.

- `HashPartitioner` (default): owner = mix(id) mod P, a multiplicative hash, so ids that come in
  runs (JODIE's items follow its users) still spread evenly; nothing to store.
- `LDGPartitioner`: streaming linear deterministic greedy (Stanton & Kliot, KDD'12). A node new
  in a batch goes to the shard holding most of its already-placed neighbours, weighted by the
  room left there, |N(v) on p| * (1 - load_p / C) with C = slack * nodes / P; a node with no
  placed neighbour goes to the least-loaded shard. The nodes new in one batch are placed
  together against the loads at the batch's start (batched LDG, vectorized; the ones with no
  placed neighbour are dealt round robin over the shards from least loaded up), so a batch
  never skews the balance by more than its own new nodes. The map grows with the id space.

`partition_report` gives the edge cut (fraction of events whose endpoints live on different
shards, each stored twice across shards) and the balance (largest shard over the mean, by
nodes and by stored edges).
"""

from __future__ import annotations

import logging

import torch

__all__ = [
    "HashPartitioner",
    "LDGPartitioner",
    "PartitionTally",
    "Partitioner",
    "build_partitioner",
    "partition_report",
]

log = logging.getLogger(__name__)

PARTITIONERS = ("hash", "ldg")
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (Fibonacci hashing)


class Partitioner:
    """Base: `num_parts` shards; `assign` places the new nodes of a batch; `owner` maps ids."""

    kind = "base"

    def __init__(self, num_parts: int) -> None:
        if int(num_parts) != num_parts or num_parts < 1:
            raise ValueError(f"partition: number of shards must be >= 1, got {num_parts}")
        self.num_parts = int(num_parts)

    def assign(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Place nodes of these events that have no owner yet (no-op for a pure hash)."""

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"kind": self.kind, "num_parts": self.num_parts}

    def load_state_dict(self, state: dict) -> None:
        if state["kind"] != self.kind or state["num_parts"] != self.num_parts:
            raise ValueError(
                f"partition: saved state is {state['kind']} over {state['num_parts']} shards, "
                f"this partitioner is {self.kind} over {self.num_parts}"
            )


class HashPartitioner(Partitioner):
    kind = "hash"

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        if self.num_parts == 1:
            return torch.zeros_like(ids)
        mixed = (ids * _MIX) >> 17  # int64 products wrap; the high bits are the mixed ones
        return torch.remainder(mixed, self.num_parts)


class LDGPartitioner(Partitioner):
    kind = "ldg"

    def __init__(self, num_parts: int, slack: float = 1.1) -> None:
        super().__init__(num_parts)
        if not slack >= 1:
            raise ValueError(f"partition: LDG slack must be >= 1, got {slack}")
        self.slack = slack
        self.map = torch.empty(0, dtype=torch.int64)  # node -> shard, -1: not placed yet
        self.load = torch.zeros(self.num_parts, dtype=torch.int64)

    def assign(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        src, dst = src.cpu(), dst.cpu()
        if src.numel() == 0:
            return
        top = int(torch.maximum(src.max(), dst.max())) + 1
        if top > self.map.shape[0]:
            self.map = torch.cat([self.map, self.map.new_full((top - self.map.shape[0],), -1)])
        node = torch.cat([src, dst])
        other = torch.cat([dst, src])
        new = torch.unique(node[self.map[node] < 0])
        if new.numel() == 0:
            return
        p = self.num_parts
        # neighbours already placed, counted per (new node, shard)
        placed = self.map[other]
        keep = (self.map[node] < 0) & (placed >= 0)
        row = torch.searchsorted(new, node[keep])
        counts = torch.zeros(new.shape[0] * p, dtype=torch.float64)
        counts.index_add_(0, row * p + placed[keep], torch.ones(row.shape[0], dtype=torch.float64))
        counts = counts.view(-1, p)
        capacity = self.slack * float(self.load.sum() + new.shape[0]) / p
        room = (1 - self.load.double() / capacity).clamp(min=0)
        score = counts * room
        best = torch.argmax(score, 1)
        lonely = score.max(1).values <= 0
        # no placed neighbour (or no room where they are): deal round robin, least loaded first
        by_load = torch.argsort(self.load, stable=True)
        rank = torch.cumsum(lonely.long(), 0) - 1
        best = torch.where(lonely, by_load[torch.remainder(rank, p)], best)
        self.map[new] = best
        self.load += torch.bincount(best, minlength=p)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        ids_cpu = ids.cpu()
        inside = ids_cpu < self.map.shape[0]
        own = torch.where(inside, self.map[ids_cpu.clamp(max=max(self.map.shape[0] - 1, 0))], -1)
        if self.map.shape[0] == 0:
            own = torch.full_like(ids_cpu, -1)
        if bool((own < 0).any()):
            bad = int(ids_cpu[own < 0][0])
            raise ValueError(f"LDGPartitioner.owner: node {bad} was never placed (not ingested)")
        return own.to(ids.device)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "map": self.map.clone(), "load": self.load.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.map = state["map"].clone()
        self.load = state["load"].clone()


def build_partitioner(kind: str, num_parts: int) -> Partitioner:
    if kind == "hash":
        return HashPartitioner(num_parts)
    if kind == "ldg":
        return LDGPartitioner(num_parts)
    raise ValueError(f"cluster.partitioner must be one of {PARTITIONERS}, got {kind!r}")


class PartitionTally:
    """`partition_report` of every event ingested so far, counted batch by batch: events, cut
    events, stored endpoints per part and which nodes were seen (O(nodes + parts), never the
    events). A node's part does not change once placed, so `report` is what `partition_report`
    over all the events gives."""

    def __init__(self) -> None:
        self.events = self.cut = 0
        self.stored = torch.zeros(0, dtype=torch.int64)
        self.seen = torch.zeros(0, dtype=torch.bool)

    def add(self, src: torch.Tensor, dst: torch.Tensor, owner: Partitioner) -> None:
        """Events (src, dst) that were just routed by `owner` (their nodes are placed)."""
        if not src.numel():
            return
        o_src, o_dst = owner.owner(src), owner.owner(dst)
        self.events += int(src.numel())
        self.cut += int((o_src != o_dst).sum())
        stored = torch.bincount(torch.cat([o_src, o_dst]), minlength=owner.num_parts)
        self.stored = stored + _padded(self.stored, stored.numel())
        top = int(torch.maximum(src.max(), dst.max())) + 1
        self.seen = _padded(self.seen, max(top, self.seen.numel()))
        self.seen[src] = True
        self.seen[dst] = True

    def report(self, owner: Partitioner) -> dict:
        nodes = self.seen.nonzero().squeeze(1)
        p = owner.num_parts
        node_load = torch.bincount(owner.owner(nodes), minlength=p).double()
        stored = _padded(self.stored, p).double()
        return {
            "shards": p,
            "edge_cut": self.cut / self.events if self.events else 0.0,
            "node_balance": (node_load.max() / node_load.mean()).item() if nodes.numel() else 1.0,
            "edge_balance": (stored.max() / stored.mean()).item() if self.events else 1.0,
        }

    def state_dict(self) -> dict:
        return {"events": self.events, "cut": self.cut, "stored": self.stored.clone(),
                "seen": self.seen.clone()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.events, self.cut = state["events"], state["cut"]
        self.stored, self.seen = state["stored"].clone(), state["seen"].clone()


def _padded(x: torch.Tensor, n: int) -> torch.Tensor:
    """`x` with zeros (False) appended up to n entries."""
    if x.numel() >= n:
        return x
    return torch.cat([x, torch.zeros(n - x.numel(), dtype=x.dtype)])


def partition_report(src: torch.Tensor, dst: torch.Tensor, owner) -> dict:
    """Edge cut and balance of events (src, dst) under `owner`: a `Partitioner`, or a node ->
    shard table covering every id in the events (a `PartitionTally` of them)."""
    if not isinstance(owner, Partitioner):
        owner = _Table(owner)
    tally = PartitionTally()
    tally.add(src, dst, owner)
    return tally.report(owner)


class _Table:
    """A node -> shard table with a partitioner's `owner` and `num_parts`."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.num_parts = int(table.max()) + 1 if table.numel() else 1

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]
