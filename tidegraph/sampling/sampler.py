"""Temporal neighbour sampling over a `DynamicGraph`, vectorized over roots.

Semantics (DESIGN.md, "Data model and semantics"):
- an edge is visible to a root at time ts when its time is strictly less than ts (and, for
  snapshot window i of width w, at least ts - (i + 1) w and less than ts - i w);
- `recent` returns the k newest visible edges, newest first, ties newest-inserted first;
- `uniform` returns every visible edge when there are at most k (newest first), otherwise k
  distinct edges drawn uniformly without replacement (Floyd's algorithm, one vectorized step per
  fanout slot), ordered newest first; the draws are counter-based (`tidegraph.sampling.keyed`):
  a function of a key and the root (node, time, window), so they do not depend on who samples a
  root or beside which others, and identical roots under one key share a draw. `sample(...,
  key=K)` draws with K (a trainer passes its step's key); without a key, a fresh one comes from
  the sampler's seeded host generator, so a seed makes the draws reproducible;
- hop l+1's roots are hop l's roots followed by its valid neighbours in row-major order, each
  at the time of the edge that reached it; a snapshot's window stays that of the original root;
- `fanouts=[]` samples no hop (models without neighbours, JODIE): `sample` returns no blocks.

With `dedup=True` (TGL's deduplication) each hop after the first samples every distinct
(node, time) root once (with snapshots: distinct (node, time, window)) and the previous block's
`next_index` maps the full root list onto them; on wikipedia half of TGAT's second-hop roots
are repeats. This changes no result, only the layout (identical `uniform` roots share a draw
either way).

Per hop the work is: per segment a `searchsorted` for the node and a fixed-step binary search for
the time bounds; then one gather of at most k candidates per segment and, with more than one
segment, a stable sort of the S*k candidates by time. No Python loop runs per root or edge.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidegraph.ops import gather_rows
from tidegraph.rng import load_generator_state
from tidegraph.sampling.block import Block
from tidegraph.sampling.keyed import keyed_uniform
from tidegraph.sampling.multihop import sample_hops
from tidegraph.storage.graph import DynamicGraph
from tidegraph.storage.segment import Segment

__all__ = ["TemporalSampler"]

_STRATEGIES = ("recent", "uniform")


class TemporalSampler:
    """Samples multi-hop temporal neighbourhoods as dense `Block`s."""

    # None: sync-free fixed-step searches on CUDA (no host round trip inside a hop), pruned
    # searches with a few host syncs on the CPU; tests set it to cover both on either device.
    sync_free: bool | None = None

    def __init__(
        self,
        graph: DynamicGraph,
        fanouts: Sequence[int] = (10,),
        strategy: str = "recent",
        num_snapshots: int = 1,
        snapshot_window: float = 0.0,
        seed: int | None = None,
        dedup: bool = False,
    ) -> None:
        if strategy not in _STRATEGIES:
            raise ValueError(
                f"TemporalSampler: strategy must be one of {_STRATEGIES}, got {strategy!r}"
            )
        if any(int(k) != k or k < 1 for k in fanouts):
            raise ValueError(
                f"TemporalSampler: fanouts must be positive integers, got {list(fanouts)}"
            )
        if num_snapshots < 1:
            raise ValueError(f"TemporalSampler: num_snapshots must be >= 1, got {num_snapshots}")
        if snapshot_window < 0 or (num_snapshots > 1 and snapshot_window <= 0):
            raise ValueError(
                "TemporalSampler: snapshot_window must be > 0 with several snapshots "
                f"(and >= 0 always), got {snapshot_window}"
            )
        self.graph = graph
        self.fanouts = [int(k) for k in fanouts]
        self.strategy = strategy
        self.num_snapshots = num_snapshots
        self.snapshot_window = float(snapshot_window)
        self.dedup = dedup
        # on the host whatever the graph's device: keys drawn from it match on CPU and CUDA
        self.generator = torch.Generator()
        if seed is None:  # a fresh random seed, leaving torch's global generator alone
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    # ---- public ---------------------------------------------------------------------------

    def sample(
        self,
        roots: torch.Tensor,
        ts: torch.Tensor,
        t_cap: float | None = None,
        dedup_roots: float | None = None,
        key: int | None = None,
    ) -> list[Block] | list[list[Block]]:
        """Blocks for hops 1..L; with snapshots, one list of blocks per window, newest first.
        `t_cap`: roots see only edges before min(own time, t_cap) (a batch's start, PyG's
        protocol); `dedup_roots`: sample each distinct (node, time) root once when at most
        that share of roots are distinct (`tidegraph.sampling.multihop`); `key`: the key of
        `uniform` draws (None: a fresh one from this sampler's generator)."""
        self._check_roots(roots, ts)
        if key is None and self.strategy == "uniform":
            key = self._fresh_key()
        return sample_hops(
            self.sample_hop, roots, ts, self.fanouts, self.num_snapshots, self.snapshot_window,
            self.dedup, t_cap, dedup_roots, key,
        )  # fmt: skip

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        load_generator_state(self.generator, state["generator"], "sampler")

    # ---- hops -----------------------------------------------------------------------------

    def sample_hop(
        self,
        roots: torch.Tensor,
        t_hi: torch.Tensor,
        k: int,
        t_lo: torch.Tensor | None = None,
        key: int | None = None,
    ) -> Block:
        """One hop: up to k visible edges (t_lo <= t < t_hi) of each root; `key`: of the
        `uniform` draws (None: a fresh one from this sampler's generator)."""
        segments = [s for s in reversed(self.graph.segments) if s.num_edges]  # newest first
        if not segments:
            empty = roots.new_zeros((roots.shape[0], 0))
            return _to_block(roots, t_hi, empty, empty.double(), empty, empty.bool(), k, True)
        sync_free = self.graph.device.type == "cuda" if self.sync_free is None else self.sync_free
        ranges = _visible_ranges(segments, roots, t_hi, t_lo, sync_free)
        if self.strategy == "recent":
            pos_RC, seg_RC, valid_RC = _newest_candidates(ranges, k)
        else:
            key = self._fresh_key() if key is None else key
            u_RK = keyed_uniform(key, roots, t_hi, t_lo, k)
            pos_RC, seg_RC, valid_RC = _uniform_candidates(ranges, k, u_RK)
        nbr, t, eid = _gather(segments, pos_RC, seg_RC, valid_RC)
        ordered = self.strategy == "recent" and len(segments) == 1
        return _to_block(roots, t_hi, nbr, t, eid, valid_RC, k, ordered)

    def _fresh_key(self) -> int:
        return int(torch.randint(-(2**62), 2**62, (), generator=self.generator))

    # ---- checks ---------------------------------------------------------------------------

    def _check_roots(self, roots: torch.Tensor, ts: torch.Tensor) -> None:
        expected = self.graph.device
        for name, x in (("roots", roots), ("ts", ts)):
            if not isinstance(x, torch.Tensor) or x.dim() != 1:
                raise ValueError(f"TemporalSampler.sample: {name} must be a 1-D tensor")
            if x.device.type != expected.type:
                raise ValueError(
                    f"TemporalSampler.sample: {name} is on {x.device}, the graph samples on "
                    f"{expected}; move it there first"
                )
        if roots.dtype != torch.int64:
            raise ValueError(f"TemporalSampler.sample: roots must be int64, got {roots.dtype}")
        if ts.shape != roots.shape:
            raise ValueError(
                f"TemporalSampler.sample: ts has shape {tuple(ts.shape)}, "
                f"roots {tuple(roots.shape)}"
            )
        bad = (roots < 0) | torch.isnan(ts)  # one host sync for both checks
        if roots.numel() and bool(bad.any()):
            row = int(bad.nonzero()[0])
            if roots[row] < 0:
                raise ValueError(
                    f"TemporalSampler.sample: root {row} has negative id {int(roots[row])}"
                )
            raise ValueError(f"TemporalSampler.sample: root {row} has time NaN")


def _uniform_candidates(
    ranges: list[tuple[torch.Tensor, torch.Tensor]], k: int, u_RK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k distinct visible edges per root, uniformly (`u_RK`: a uniform [0, 1) value per root
    and slot); all of them when there are <= k."""
    counts_SR = torch.stack([end - start for start, end in ranges])
    n = counts_SR.sum(0)
    r = n.shape[0]
    slot = torch.arange(k, device=n.device)
    pick_RK = slot.expand(r, k).clone()  # rows with n <= k: ranks 0..n-1 (newest first)
    many = n > k
    for j in range(k):  # Floyd: a uniform k-subset of [0, n) in k steps
        top = n - k + j
        draw = (u_RK[:, j] * (top + 1).double()).long().clamp(max=top)
        taken = (pick_RK[:, :j] == draw.unsqueeze(1)).any(1)
        pick_RK[:, j] = torch.where(many, torch.where(taken, top, draw), pick_RK[:, j])
    valid = pick_RK < n.unsqueeze(1)
    return _rank_to_position(ranges, counts_SR, pick_RK, valid)


def _visible_ranges(
    segments: list[Segment],
    roots: torch.Tensor,
    t_hi: torch.Tensor,
    t_lo: torch.Tensor | None,
    sync_free: bool,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per segment (newest first), [start, end) of each root's visible edges."""
    if roots.numel() == 0:
        return [(roots.new_zeros(roots.shape), roots.new_zeros(roots.shape)) for _ in segments]
    # one host sync per hop lets segments entirely inside the bounds skip their binary search
    bounds = [-torch.inf, torch.inf]  # sync-free: never skip a search
    if not sync_free:
        bounds = torch.stack([t_hi.min(), t_lo.max() if t_lo is not None else t_hi.min()])
        bounds = bounds.tolist()
    out = []
    for seg in segments:
        lo, hi = seg.node_ranges(roots)
        end = hi if seg.t_max < bounds[0] else seg.lower_bound(lo, hi, t_hi, sync_free)
        start = lo
        if t_lo is not None and seg.t_min < bounds[1]:
            start = seg.lower_bound(lo, end, t_lo, sync_free)
        out.append((start, end))
    return out


def _newest_candidates(
    ranges: list[tuple[torch.Tensor, torch.Tensor]], k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Up to k newest positions per segment: [R, S*k] positions, segment index and validity,
    ordered newest segment first and newest position first (the tie-break order)."""
    back = torch.arange(k, device=ranges[0][0].device)
    pos, seg, valid = [], [], []
    for s, (start, end) in enumerate(ranges):
        p = end.unsqueeze(1) - 1 - back
        pos.append(p)
        valid.append(p >= start.unsqueeze(1))
        seg.append(torch.full_like(p, s))
    return _cat_candidates(pos, seg, valid)


def _rank_to_position(
    ranges: list[tuple[torch.Tensor, torch.Tensor]],
    counts_SR: torch.Tensor,
    rank_RK: torch.Tensor,
    valid_RK: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map a rank among a root's visible edges (newest segment first, newest position first
    within a segment) to (position, segment)."""
    pos = torch.zeros_like(rank_RK)
    seg = torch.zeros_like(rank_RK)
    before = torch.zeros_like(counts_SR[0]).unsqueeze(1)
    for s, (_, end) in enumerate(ranges):
        upto = before + counts_SR[s].unsqueeze(1)
        here = (rank_RK >= before) & (rank_RK < upto)
        pos = torch.where(here, end.unsqueeze(1) - 1 - (rank_RK - before), pos)
        seg = torch.where(here, s, seg)
        before = upto
    return pos, seg, valid_RK


def _cat_candidates(pos, seg, valid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.cat(pos, 1), torch.cat(seg, 1), torch.cat(valid, 1)


def _gather(
    segments: list[Segment], pos_RC: torch.Tensor, seg_RC: torch.Tensor, valid_RC: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nbr, t, eid) of each candidate; invalid candidates get (-1, -inf, -1)."""
    nbr = torch.full_like(pos_RC, -1)
    t = torch.full(pos_RC.shape, -torch.inf, dtype=torch.float64, device=pos_RC.device)
    eid = torch.full_like(pos_RC, -1)
    for s, seg in enumerate(segments):
        here = valid_RC & (seg_RC == s)
        p = torch.where(here, pos_RC, 0).clamp_(0, seg.num_edges - 1)
        nbr = torch.where(here, gather_rows(seg.nbr, p).long(), nbr)
        t = torch.where(here, gather_rows(seg.t, p), t)
        eid = torch.where(here, gather_rows(seg.eid, p), eid)
    return nbr, t, eid


def _to_block(
    roots: torch.Tensor,
    ts: torch.Tensor,
    nbr: torch.Tensor,
    t: torch.Tensor,
    eid: torch.Tensor,
    valid: torch.Tensor,
    k: int,
    ordered: bool,
) -> Block:
    """Order candidates newest first (stable: ties keep the tie-break order) and keep k;
    `ordered` candidates are newest first already."""
    if not ordered:
        order = torch.sort(t, dim=1, descending=True, stable=True).indices[:, :k]
        nbr, t, eid, valid = (x.gather(1, order) for x in (nbr, t, eid, valid))
    r = roots.shape[0]
    if nbr.shape[1] < k:  # no segments, or fewer candidates than slots
        pad = k - nbr.shape[1]
        nbr = torch.cat([nbr, nbr.new_full((r, pad), -1)], 1)
        eid = torch.cat([eid, eid.new_full((r, pad), -1)], 1)
        t = torch.cat([t, t.new_full((r, pad), -torch.inf)], 1)
        valid = torch.cat([valid, valid.new_zeros((r, pad))], 1)
    t = torch.where(valid, t, ts.unsqueeze(1))
    return Block(
        dst_ids=roots,
        dst_ts=ts,
        nbr_ids=nbr,
        nbr_ts=t,
        nbr_eids=eid,
        # invalid slots: 0, also for roots at +inf (static sampling), where inf - inf is NaN
        dt=torch.where(valid, ts.unsqueeze(1) - t, 0).float(),
        mask=valid,
    )
