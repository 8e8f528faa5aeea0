"""Multi-hop temporal sampling over any set of hop samplers, local or remote.

A hop sampler answers `sample_hop(roots, t_hi, k, t_lo) -> Block` for roots whose edges it
holds: a `TemporalSampler` over one graph, a `ShardCore` over its partition, or a proxy of a
remote shard. `sample_hops` runs the hop loop once for the whole root set (next-hop roots,
deduplication of (node, time) roots, snapshot windows), whichever shard owns a root: per hop it
groups the roots by owner, makes one batched request per shard, and scatters the answers back
into one block in root order. A root's edges all live on its owner (each event is stored at
the owners of both endpoints), so the merged block equals what one graph holding every edge
returns (for `uniform` too: its draws are keyed by the root, `tidegraph.sampling.keyed`).

Two options change what the hop loop asks, never what a shard answers:
- `t_cap` (the `sampler.history: batch` protocol, PyG's TGN): every root sees only edges
  strictly before min(its time, t_cap), with t_cap the start of its batch, so no event sees an
  earlier event of its own batch; shards are asked with the capped times and the blocks keep
  each root's own time (and `dt` from it). Next-hop roots are older than t_cap already.
- `dedup_roots` (a ratio): when at most that share of the first hop's (node, time) roots are
  distinct, each distinct root is sampled (and embedded) once; the first block's
  `root_index` maps the given roots onto its rows (`Block.root_index`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tidegraph.sampling.block import Block
from tidegraph.sampling.keyed import hop_key

__all__ = ["MultiHopSampler", "ask_owners", "sample_hops"]

HopFn = Callable[[torch.Tensor, torch.Tensor, int, "torch.Tensor | None"], Block]


def sample_hops(
    hop: HopFn,
    roots: torch.Tensor,
    ts: torch.Tensor,
    fanouts: Sequence[int],
    num_snapshots: int = 1,
    snapshot_window: float = 0.0,
    dedup: bool = False,
    t_cap: float | None = None,
    dedup_roots: float | None = None,
    key: int | None = None,
) -> list[Block] | list[list[Block]]:
    """Blocks for hops 1..L; with snapshots, one list of blocks per window, newest first.
    `t_cap` and `dedup_roots`: see the module docstring; `key`: of `uniform` draws, passed
    to the hop samplers as one key per (window, hop) (None: they draw their own)."""
    ts = ts.to(torch.float64)
    index = None
    if dedup_roots is not None and fanouts and _may_repeat(roots, ts, dedup_roots):
        u_roots, u_ts, _, inverse = distinct_roots(roots, ts, None)
        if u_roots.shape[0] <= dedup_roots * roots.shape[0]:
            roots, ts, index = u_roots, u_ts, inverse
    if num_snapshots == 1 and snapshot_window == 0.0:
        windows = [_hops(hop, roots, ts, None, fanouts, dedup, t_cap, key)]
    else:
        w = snapshot_window
        windows = [
            _hops(hop, roots, ts - i * w, ts - (i + 1) * w, fanouts, dedup, t_cap, key, i)
            for i in range(num_snapshots)
        ]
    if index is not None:
        for blocks in windows:
            blocks[0].root_index = index
    return windows[0] if num_snapshots == 1 and snapshot_window == 0.0 else windows


def _hops(hop, roots, t_hi, t_lo, fanouts, dedup, t_cap=None, key=None, window=0) -> list[Block]:
    blocks = []
    for i, k in enumerate(fanouts):
        keyed = {} if key is None else {"key": hop_key(key, window, i)}
        if t_cap is None:
            block = hop(roots, t_hi, k, t_lo, **keyed)
        else:
            block = _own_times(hop(roots, t_hi.clamp(max=t_cap), k, t_lo, **keyed), t_hi)
        blocks.append(block)
        if i + 1 < len(fanouts):
            roots, t_hi = block.next_roots()
            if t_lo is not None:
                t_lo = torch.cat([t_lo, t_lo.index_select(0, block.valid_rows)])
            if dedup:
                roots, t_hi, t_lo, block.next_index = distinct_roots(roots, t_hi, t_lo)
    return blocks


def _may_repeat(roots: torch.Tensor, ts: torch.Tensor, ratio: float) -> bool:
    """Whether at most `ratio` of the (root, time) pairs may be distinct: one sort of a hash
    of each pair (a quarter of `distinct_roots`' cost), which counts no more distinct pairs
    than there are (equal pairs hash alike), so a False is never wrong."""
    if not roots.numel():
        return False
    key = (roots * -7046029254386353131) ^ (ts + 0.0).view(torch.int64)  # -0.0 -> 0.0
    return torch.unique(key).shape[0] <= ratio * roots.shape[0]


def _own_times(block: Block, t_hi: torch.Tensor) -> Block:
    """`block`, sampled at capped times, with the roots' own times `t_hi` (and `dt` from
    them): the cap limits which edges are seen, not the time a root is embedded at."""
    t_hi = t_hi.to(block.dst_ts.device)
    mask = block.mask
    block.dst_ts = t_hi
    block.nbr_ts = torch.where(mask, block.nbr_ts, t_hi.unsqueeze(1))
    block.dt = torch.where(mask, t_hi.unsqueeze(1) - block.nbr_ts, 0).float()
    return block


def distinct_roots(
    roots: torch.Tensor, t_hi: torch.Tensor, t_lo: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Distinct (root, t_hi, t_lo) rows, ordered by root, and each input row's index among
    them: stable sorts by the least significant key first, then a new group at each change."""
    keys = [roots, t_hi] + ([t_lo] if t_lo is not None else [])
    order = torch.arange(roots.shape[0], device=roots.device)
    for key in reversed(keys):
        order = order.index_select(0, torch.argsort(key.index_select(0, order), stable=True))
    sorted_keys = [key.index_select(0, order) for key in keys]
    new = torch.zeros_like(roots, dtype=torch.bool)
    new[:1] = True
    for key in sorted_keys:
        new[1:] |= key[1:] != key[:-1]
    group = torch.cumsum(new, 0) - 1
    inverse = torch.empty_like(group).index_put_((order,), group)
    first = new.nonzero().squeeze(1)
    out = [key.index_select(0, first) for key in sorted_keys]
    return out[0], out[1], out[2] if t_lo is not None else None, inverse


def ask_owners(
    own: torch.Tensor, num_shards: int, ask, gather
) -> list[tuple[torch.Tensor, object]]:
    """One request per shard that owns any row: `ask(p, idx)` for the rows `idx` whose owner
    (`own`) is p; the answers are waited for at once (`gather`) and paired with their rows."""
    index, asked = [], []
    for p in range(num_shards):
        idx = (own == p).nonzero().squeeze(1)
        if idx.numel():
            index.append(idx)
            asked.append(ask(p, idx))
    return list(zip(index, gather(asked), strict=True))


class MultiHopSampler:
    """Samples over shards: `shards[p].sample_hop` answers the roots that `owner` maps to p.

    `owner(ids) -> shard index` is the partition map. With one shard every root goes to it
    unchanged, so the result is exactly that hop sampler's.
    """

    def __init__(
        self,
        shards: Sequence,
        owner: Callable[[torch.Tensor], torch.Tensor],
        fanouts: Sequence[int],
        num_snapshots: int = 1,
        snapshot_window: float = 0.0,
        dedup: bool = False,
        gather=None,
    ) -> None:
        self.shards = list(shards)
        # remote shards answer with futures: `gather` waits for a list of them at once, so the
        # requests of one hop run on all shards concurrently
        self.gather = gather or (lambda xs: xs)
        self.owner = owner
        self.fanouts = [int(k) for k in fanouts]
        self.num_snapshots = num_snapshots
        self.snapshot_window = float(snapshot_window) if num_snapshots > 1 else 0.0
        self.dedup = dedup
        self.requests = 0  # batched hop requests sent to shards (one per shard per hop)

    def sample(self, roots: torch.Tensor, ts: torch.Tensor, **options) -> list:
        """Blocks per hop (per window); `options`: `t_cap`, `dedup_roots` (module docstring)."""
        if roots.dtype != torch.int64 or roots.dim() != 1 or ts.shape != roots.shape:
            raise ValueError("MultiHopSampler.sample: roots must be int64 [R] and ts [R]")
        return sample_hops(self._hop, roots, ts, self.fanouts, self.num_snapshots,
                           self.snapshot_window, self.dedup, **options)  # fmt: skip

    def _hop(self, roots, t_hi, k, t_lo, key=None) -> Block:
        if len(self.shards) == 1:
            self.requests += 1
            return self.gather([self.shards[0].sample_hop(roots, t_hi, k, t_lo, key)])[0]

        def ask(p, idx):
            lo = None if t_lo is None else t_lo.index_select(0, idx)
            return self.shards[p].sample_hop(roots.index_select(0, idx), t_hi[idx], k, lo, key)

        parts = ask_owners(self.owner(roots), len(self.shards), ask, self.gather)
        self.requests += len(parts)
        return merge_blocks(roots, t_hi, k, parts)


def merge_blocks(
    roots: torch.Tensor, t_hi: torch.Tensor, k: int, parts: list[tuple[torch.Tensor, Block]]
) -> Block:
    """One block over all `roots` from blocks over subsets (`idx` rows each); rows no part
    answers stay empty (mask False, the sampler's fill values)."""
    if parts:  # shards answer on their graph's device
        dev = parts[0][1].nbr_ids.device
        roots, t_hi = roots.to(dev), t_hi.to(dev)
        parts = [(idx.to(dev), b) for idx, b in parts]
    r = roots.shape[0]
    nbr = roots.new_full((r, k), -1)
    eid = roots.new_full((r, k), -1)
    nbr_ts = t_hi.unsqueeze(1).expand(r, k).clone()
    dt = torch.zeros(r, k, dtype=torch.float32, device=roots.device)
    mask = torch.zeros(r, k, dtype=torch.bool, device=roots.device)
    for idx, b in parts:
        nbr.index_copy_(0, idx, b.nbr_ids)
        eid.index_copy_(0, idx, b.nbr_eids)
        nbr_ts.index_copy_(0, idx, b.nbr_ts)
        dt.index_copy_(0, idx, b.dt)
        mask.index_copy_(0, idx, b.mask)
    return Block(
        dst_ids=roots, dst_ts=t_hi, nbr_ids=nbr, nbr_ts=nbr_ts, nbr_eids=eid, dt=dt, mask=mask
    )
