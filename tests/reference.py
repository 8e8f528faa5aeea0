"""Brute-force references: plain Python over an edge list, defining the store's semantics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReferenceGraph:
    """Stored edges as (node, nbr, t, eid, seq) rows in insertion order."""

    add_reverse: bool = True
    rows: list[tuple[int, int, float, int, int]] = field(default_factory=list)
    next_eid: int = 0

    def add_edges(self, src, dst, t, eid=None) -> None:
        src, dst, t = list(map(int, src)), list(map(int, dst)), list(map(float, t))
        if eid is None:
            eid = list(range(self.next_eid, self.next_eid + len(src)))
        eid = list(map(int, eid))
        for s, d, tt, e in zip(src, dst, t, eid, strict=True):
            self.rows.append((s, d, tt, e, len(self.rows)))
            if self.add_reverse:
                self.rows.append((d, s, tt, e, len(self.rows)))
        if eid:
            self.next_eid = max(self.next_eid, max(eid) + 1)

    def neighbors(self, node: int, t_hi: float = float("inf"), t_lo: float = float("-inf")):
        """Edges of `node` with t_lo <= t < t_hi as (nbr, t, eid), newest first, ties
        later-inserted first."""
        rows = [r for r in self.rows if r[0] == node and t_lo <= r[2] < t_hi]
        rows.sort(key=lambda r: (r[2], r[4]), reverse=True)
        return [(r[1], r[2], r[3]) for r in rows]

    def degree(self, node: int) -> int:
        return sum(1 for r in self.rows if r[0] == node)

    def offload_before(self, t: float) -> None:
        self.rows = [r for r in self.rows if r[2] >= t]

    @property
    def num_nodes(self) -> int:
        return max((max(r[0], r[1]) for r in self.rows), default=-1) + 1


def recent_rows(ref: ReferenceGraph, roots, ts, k: int, t_lo=None):
    """The `recent` sampler's expected rows: up to k (nbr, t, eid) per root."""
    out = []
    for i, (v, t) in enumerate(zip(roots, ts, strict=True)):
        lo = float("-inf") if t_lo is None else float(t_lo[i])
        out.append(ref.neighbors(int(v), float(t), lo)[:k])
    return out


def recent_hops(ref: ReferenceGraph, roots, ts, fanouts, t_lo=None):
    """Expected multi-hop `recent` result: per hop, (roots, ts, rows)."""
    hops = []
    roots, ts = list(map(int, roots)), list(map(float, ts))
    lo = None if t_lo is None else list(map(float, t_lo))
    for k in fanouts:
        rows = recent_rows(ref, roots, ts, k, lo)
        hops.append((roots, ts, rows))
        roots = roots + [n for row in rows for n, _, _ in row]
        ts = ts + [t for row in rows for _, t, _ in row]
        if lo is not None:
            lo = lo + [lo[i] for i, row in enumerate(rows) for _ in row]
    return hops


def twin_graphs(placement: str, num_nodes: int, num_edges: int, t_max: int, seed: int):
    """The same random graph on the CPU and with `placement`, inserted in three batches of
    different sizes (so both go through compaction); returns (cpu, other, generator)."""
    import torch

    from tidegraph.storage import DynamicGraph

    gen = torch.Generator().manual_seed(seed)
    src, dst = torch.randint(0, num_nodes, (2, num_edges), generator=gen)
    t = torch.randint(0, t_max, (num_edges,), generator=gen).double()
    cpu, other = DynamicGraph(), DynamicGraph(device=placement)
    cuts = [0, num_edges // 5, 4 * num_edges // 5, num_edges]
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        cpu.add_edges(src[lo:hi], dst[lo:hi], t[lo:hi])
        other.add_edges(src[lo:hi], dst[lo:hi], t[lo:hi])
    return cpu, other, gen
