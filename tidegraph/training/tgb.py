"""The Temporal Graph Benchmark's link-prediction protocol (TGB, Huang et al. 2023), so that
tidegraph's MRR reads like the leaderboard's:

- **split** (`tgb_bounds`): by time, at the 0.70 and 0.85 quantiles of the timestamps (numpy's
  linear rule, as TGB computes them): train t <= q70, validation q70 < t <= q85, test t > q85.
- **negatives** (`HistRndNegatives`, TGB's `hist_rnd`): for each positive (s, d, t) of an
  evaluated split, `k` negative destinations: up to `int(k * hist_ratio)` drawn without
  replacement from the destinations s met in the history (train), the rest drawn without
  replacement from the destination id range [first, last] less those and less every
  destination of a positive with the same source and time; never a positive of the same
  source and time. Where a part has fewer candidates than it wants it takes them all, so a row
  can hold fewer than `k` (TGB's lists are as long). TGB draws with numpy's global generator,
  one positive at a time; here the draws are vectorized over positives with a seeded torch
  generator: the same rule and the same counts (how many historical, how many random) for
  every positive, and the same negatives wherever the rule leaves no choice (on tgbl-wiki, 999
  of its 1,000 destinations, nearly every row), but other draws than TGB's files elsewhere.
- **metrics** (`tgb_metrics`): one positive against its negatives, the rank the mean of the
  optimistic and the pessimistic rank (1 + #negatives above + half #tied), MRR the mean of
  1 / rank over positives, Hits@k the share ranked within k.

Rows of fewer than `k` negatives are padded with the positive's own destination and marked
invalid: scored like the rest (a batch keeps one shape), left out of the rank.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "TGB_QUANTILES",
    "HistRndNegatives",
    "SeenPairs",
    "edgebank_block",
    "edgebank_tgb",
    "rank_metrics",
    "tgb_bounds",
    "tgb_metrics",
    "tgb_ranks",
]

TGB_QUANTILES = (0.70, 0.85)  # TGB's val_ratio = test_ratio = 0.15
# a chunk of positives draws at most this many keys at once (rows x destination range)
_CHUNK_ELEMENTS = 1 << 22


def tgb_bounds(t: torch.Tensor) -> tuple[int, int]:
    """(train_end, val_end): positions in the time-sorted `t` where validation and test start,
    at TGB's time quantiles."""
    if t.numel() == 0:
        raise ValueError("tgb split: no events")
    ts = t.detach().cpu().double().numpy()
    if np.any(ts[1:] < ts[:-1]):
        raise ValueError("tgb split: the events must be in time order")
    val_time, test_time = np.quantile(ts, TGB_QUANTILES)
    return int(np.searchsorted(ts, val_time, "right")), int(np.searchsorted(ts, test_time, "right"))


def tgb_ranks(
    pos: torch.Tensor, neg_PK: torch.Tensor, valid_PK: torch.Tensor | None = None
) -> torch.Tensor:
    """TGB's rank [P] (float64) of each positive `pos` [P] among its negatives' scores
    `neg_PK` [P, K] (`valid_PK`: which of them count; None: all): 1 + #above + half #tied."""
    pos = pos.detach().double().cpu().unsqueeze(1)
    neg = neg_PK.detach().double().cpu()
    valid = torch.ones_like(neg, dtype=torch.bool) if valid_PK is None else valid_PK.cpu()
    return 1 + ((neg > pos) & valid).sum(1) + 0.5 * ((neg == pos) & valid).sum(1)


def rank_metrics(rank: torch.Tensor, k: int = 10) -> dict[str, float]:
    """MRR and Hits@k of positives of TGB ranks `rank` [P]."""
    if rank.numel() == 0:
        return {"mrr": float("nan"), f"hits@{k}": float("nan")}
    return {"mrr": float((1.0 / rank).mean()), f"hits@{k}": float((rank <= k).double().mean())}


def tgb_metrics(
    pos: torch.Tensor, neg_PK: torch.Tensor, valid_PK: torch.Tensor | None = None, k: int = 10
) -> dict[str, float]:
    """MRR and Hits@k of positives `pos` [P] against their negatives' scores `neg_PK` [P, K]
    (`valid_PK`: which of them count; None: all)."""
    return rank_metrics(tgb_ranks(pos, neg_PK, valid_PK), k)


def _pair_keys(a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    return a.to(torch.int64) * width + b.to(torch.int64)


class HistRndNegatives:
    """TGB's `hist_rnd` negatives for the positives of a split (see the module docstring).

    `hist_src`, `hist_dst`: the history's events (TGB: the train split's); `first_dst`,
    `last_dst`: the destination id range (TGB: the smallest and largest destination of the
    whole dataset); `k`: negatives a positive; `seed`: the draws' seed."""

    def __init__(
        self,
        hist_src: torch.Tensor,
        hist_dst: torch.Tensor,
        first_dst: int,
        last_dst: int,
        k: int,
        hist_ratio: float = 0.5,
        seed: int = 0,
    ) -> None:
        if last_dst < first_dst:
            raise ValueError(f"tgb negatives: empty destination range [{first_dst}, {last_dst}]")
        if k < 1 or not 0.0 <= hist_ratio <= 1.0:
            raise ValueError(f"tgb negatives: k >= 1 and 0 <= hist_ratio <= 1, got {k}, "
                             f"{hist_ratio}")  # fmt: skip
        self.first, self.range = int(first_dst), int(last_dst) - int(first_dst) + 1
        self.k, self.hist_max = int(k), int(k * hist_ratio)
        self.seed = seed
        # distinct (source, destination) pairs of the history, sorted by source: each source's
        # destinations are one run of `seen_dst`, found by searchsorted on `seen_src`
        src, dst = hist_src.cpu().to(torch.int64), hist_dst.cpu().to(torch.int64)
        outside = (dst < first_dst) | (dst > last_dst)
        if bool(outside.any()):
            raise ValueError(f"tgb negatives: a history destination lies outside "
                             f"[{first_dst}, {last_dst}]")  # fmt: skip
        width = self.range
        pairs = torch.unique(_pair_keys(src, dst - self.first, width))
        self.seen_src, self.seen_dst = pairs // width, pairs % width  # dst relative to first

    def sample(
        self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(negatives [P, k], valid [P, k]) for the positives (src, dst, t) of a split (the
        split whole: a positive's excluded destinations are its split's positives of the same
        source and time). Draws chunk by chunk of positives, in order, from one generator.
        `rows`: only the first `rows` positives' (the same rows as a whole draw's)."""
        src, dst = src.cpu().to(torch.int64), dst.cpu().to(torch.int64)
        t = t.cpu().double()
        if bool(((dst < self.first) | (dst >= self.first + self.range)).any()):
            raise ValueError(f"tgb negatives: a positive's destination lies outside "
                             f"[{self.first}, {self.first + self.range - 1}]")  # fmt: skip
        n = src.numel()
        # the positives of the same (source, time): a group id each, its members' destinations
        _, group = torch.unique(torch.stack([src.double(), t]), dim=1, return_inverse=True)
        order = torch.argsort(group, stable=True)
        n_groups = int(group.max()) + 1 if n else 0
        g_count = torch.bincount(group, minlength=n_groups)
        g_start = torch.cumsum(g_count, 0) - g_count
        g_dst = dst[order] - self.first
        generator = torch.Generator().manual_seed(self.seed)
        wanted = n if rows is None else min(n, max(0, int(rows)))
        chunk = max(1, _CHUNK_ELEMENTS // self.range)
        drawn = min(n, -(-wanted // chunk) * chunk)  # whole chunks: their draws stay the same
        neg = torch.empty(drawn, self.k, dtype=torch.int64)
        valid = torch.zeros(drawn, self.k, dtype=torch.bool)
        for lo in range(0, drawn, chunk):
            hi = min(n, lo + chunk)
            neg[lo:hi], valid[lo:hi] = self._chunk(
                src[lo:hi], dst[lo:hi], group[lo:hi], g_start, g_count, g_dst, generator
            )
        return neg[:wanted], valid[:wanted]

    def _chunk(self, src, dst, group, g_start, g_count, g_dst, generator):
        m, R, k = src.numel(), self.range, self.k
        row = torch.arange(m)
        # excluded: the destinations of the row's (source, time) group, as a [m, R] mask
        sizes = g_count[group]
        pos_row = torch.repeat_interleave(row, sizes)
        first_member = torch.repeat_interleave(g_start[group], sizes)
        within = torch.arange(pos_row.numel()) - torch.repeat_interleave(
            torch.cumsum(sizes, 0) - sizes, sizes
        )
        excluded = torch.zeros(m, R, dtype=torch.bool)
        excluded[pos_row, g_dst[first_member + within]] = True
        # the row's source's history: its distinct destinations
        lo = torch.searchsorted(self.seen_src, src)
        hi = torch.searchsorted(self.seen_src, src, right=True)
        n_seen = hi - lo
        seen_row = torch.repeat_interleave(row, n_seen)
        seen_at = torch.arange(seen_row.numel()) - torch.repeat_interleave(
            torch.cumsum(n_seen, 0) - n_seen, n_seen
        )
        seen_d = self.seen_dst[torch.repeat_interleave(lo, n_seen) + seen_at]
        seen = torch.zeros(m, R, dtype=torch.bool)
        seen[seen_row, seen_d] = True
        # historical part: min(hist_max, |seen - excluded|) of seen - excluded, uniformly
        open_hist = ~excluded[seen_row, seen_d]
        n_hist = torch.minimum(
            torch.bincount(seen_row[open_hist], minlength=m), torch.tensor(self.hist_max)
        )
        key = torch.rand(seen_row.numel(), generator=generator, dtype=torch.float64)
        key = seen_row.double() * 4 + torch.where(open_hist, key, torch.full_like(key, 2.0))
        by_key = torch.argsort(key, stable=True)  # rows stay in order, each row's by its key
        rank = torch.arange(by_key.numel()) - torch.repeat_interleave(
            torch.cumsum(n_seen, 0) - n_seen, n_seen
        )
        taken = by_key[rank < n_hist[seen_row[by_key]]]
        # random part: the rest of k from the range less excluded and seen, uniformly
        blocked = excluded | seen
        n_rand = torch.minimum(k - n_hist, R - blocked.sum(1))
        keys = torch.rand(m, R, generator=generator, dtype=torch.float64)
        keys = torch.where(blocked, torch.full_like(keys, 2.0), keys)
        width = int(n_rand.max()) if m else 0
        rand_d = torch.topk(keys, width, dim=1, largest=False, sorted=True).indices
        # a row: its historical negatives, then its random ones, then padding
        neg = dst.unsqueeze(1).repeat(1, k)  # padding: the positive's own destination
        valid = torch.zeros(m, k, dtype=torch.bool)
        h_row = seen_row[taken]
        h_col = torch.arange(taken.numel()) - torch.repeat_interleave(
            torch.cumsum(n_hist, 0) - n_hist, n_hist
        )
        neg[h_row, h_col] = seen_d[taken] + self.first
        valid[h_row, h_col] = True
        col = torch.arange(width).unsqueeze(0)
        use = col < n_rand.unsqueeze(1)
        r_row = row.unsqueeze(1).expand(m, width)[use]
        r_col = (n_hist.unsqueeze(1) + col).expand(m, width)[use]
        neg[r_row, r_col] = rand_d[use] + self.first
        valid[r_row, r_col] = True
        return neg, valid


class SeenPairs:
    """The distinct (source, destination) pairs of a growing history and its destination id
    range, for `HistRndNegatives` in continual runs (the history of an increment: every
    event before it). Its memory is the graph's distinct pairs, not its events."""

    def __init__(self) -> None:
        self.keys = torch.empty(0, dtype=torch.int64)  # source << 32 | destination, sorted
        self.first_dst, self.last_dst = None, None

    def add(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        src, dst = src.cpu().to(torch.int64), dst.cpu().to(torch.int64)
        if bool(((src < 0) | (src >= 1 << 31) | (dst < 0) | (dst >= 1 << 31)).any()):
            raise ValueError("tgb history: node ids must be dense, in [0, 2**31)")
        self.keys = torch.unique(torch.cat([self.keys, (src << 32) | dst]))
        lo, hi = int(dst.min()), int(dst.max())
        self.first_dst = lo if self.first_dst is None else min(self.first_dst, lo)
        self.last_dst = hi if self.last_dst is None else max(self.last_dst, hi)

    def negatives(self, block_dst: torch.Tensor, k: int, hist_ratio: float,
                  seed: int) -> HistRndNegatives:  # fmt: skip
        """The hist_rnd sampler of a block of positives whose destinations are `block_dst`:
        history these pairs, destination range theirs and the block's."""
        lo, hi = int(block_dst.min()), int(block_dst.max())
        if self.first_dst is not None:
            lo, hi = min(lo, self.first_dst), max(hi, self.last_dst)
        return HistRndNegatives(self.keys >> 32, self.keys & 0xFFFFFFFF, lo, hi, k, hist_ratio,
                                seed)  # fmt: skip

    def state_dict(self) -> dict:
        return {"keys": self.keys.clone(), "first_dst": self.first_dst,
                "last_dst": self.last_dst}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.keys = state["keys"].to("cpu", torch.int64).clone()
        self.first_dst, self.last_dst = state["first_dst"], state["last_dst"]


def edgebank_tgb(
    events,
    num_nodes: int,
    mode: str,
    k: int = 999,
    hist_ratio: float = 0.5,
    seed: int = 0,
    prefix: int = 0,
    batch_size: int = 200,
    hits_k: int = 10,
    window_ratio: float = 0.15,
) -> dict:
    """EdgeBank (`tidegraph.models.edgebank`, `mode` unlimited or window) on TGB's protocol,
    as TGB's EdgeBank example runs it: memory from the train split, validation then test
    scored batch by batch (`batch_size` positives), each batch recorded after it is scored;
    `prefix` positives of each split scored (0: all). {"val": metrics, "test": metrics};
    `seed`: the negatives' (an offline run with `eval.protocol: tgb` uses
    `seed_for(run seed, "tgb negatives")`)."""
    from tidegraph.models.edgebank import EdgeBank

    train_end, val_end = tgb_bounds(events.t)
    src, dst, t = events.src, events.dst, events.t
    bank = EdgeBank(num_nodes, src[:train_end], dst[:train_end], t[:train_end], mode,
                    window_ratio)  # fmt: skip
    sampler = HistRndNegatives(src[:train_end], dst[:train_end], int(dst.min()), int(dst.max()),
                               k, hist_ratio, seed)  # fmt: skip
    out = {}
    for split, (start, end) in (("val", (train_end, val_end)), ("test", (val_end, len(t)))):
        neg, valid = sampler.sample(src[start:end], dst[start:end], t[start:end])
        scored = end - start if prefix == 0 else min(end - start, prefix)
        out[split] = edgebank_block(bank, events.select(slice(start, end)), neg[:scored],
                                    valid[:scored], batch_size, hits_k,
                                    record_rest=split == "val")  # fmt: skip
    return out


def edgebank_block(
    bank, events, neg: torch.Tensor, valid: torch.Tensor, batch_size: int = 200,
    hits_k: int = 10, record_rest: bool = True,
) -> dict:  # fmt: skip
    """EdgeBank's TGB metrics on a block of `events`, as TGB's example runs it: batch by
    batch, each batch scored (its positives among the first `len(neg)`, against their rows of
    `neg` / `valid`) then recorded in `bank`; `record_rest`: the rest of the block recorded
    too (False: the bank stops at the last scored batch)."""
    src, dst, t = events.src, events.dst, events.t
    scored = neg.shape[0]
    pos_s, neg_s = [], []
    for lo in range(0, len(events), batch_size):
        hi = min(len(events), lo + batch_size)
        if lo < scored:
            top = min(hi, scored)
            s = src[lo:top].unsqueeze(1)
            pos_s.append(bank.score(s, dst[lo:top].unsqueeze(1)).squeeze(1))
            neg_s.append(bank.score(s, neg[lo:top]))
        elif not record_rest:
            break
        bank.update(src[lo:hi], dst[lo:hi], t[lo:hi])
    out = tgb_metrics(torch.cat(pos_s), torch.cat(neg_s), valid, hits_k)
    out["positives"] = scored
    return out
