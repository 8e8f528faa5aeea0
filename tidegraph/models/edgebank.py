"""EdgeBank (Poursafaei et al., 2022): the memorising baseline of every TGB table. It scores a
(source, destination) pair 1 when the pair was seen before and 0 otherwise; no parameters, no
training.

- `unlimited`: seen at any time before.
- `window` (TGB's `fixed_time_window`): seen within a window of the latest times, [end -
  length, end], `end` the latest time remembered (each update with later events moves it).

`EdgeBank` is TGB's: its window's length is `window_ratio` of the time span of the events it
is built from (TGB: the train split's, 0.15). `EdgeBankModel` is EdgeBank as a job's model
(`model.name: edgebank`, `model.edgebank_window`: 0 for unlimited memory, else the window's
length in the stream's time units): its memory is every event a step or an evaluation
recorded (`take_updates` / `apply_updates`, so W trainers each hold every slice's pairs, as
replicated node state), scored before the step's events are recorded. It embeds no node
(`embeds=False`) and samples no neighbours. Its one parameter is the confidence of its answer
(logit +s for a remembered pair, -s otherwise, s = softplus(parameter)), which the training
steps fit: the ranking, and so AP, MRR and Hits@10, is EdgeBank's whatever s is.

The memory is every distinct pair with its latest time, as sorted int64 keys (src * 2**32 +
dst) and float64 times: a batch merges in with one sort of the batch and a linear merge
(`merge_pairs`), lookups are binary searches; all vectorized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidegraph.models.base import TemporalModel

__all__ = ["EDGEBANK_MODES", "EdgeBank", "EdgeBankModel", "merge_pairs", "pair_keys"]

EDGEBANK_MODES = ("unlimited", "window")
_SHIFT = 1 << 32  # node ids are below 2**31 (int32 on the wire)


def pair_keys(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    return src.to(torch.int64) * _SHIFT + dst.to(torch.int64)


def merge_pairs(
    keys: torch.Tensor, times: torch.Tensor, new_keys: torch.Tensor, new_times: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct `keys` with their latest `times`, and a batch of (key, time) pairs in
    any order, as one sorted distinct memory with each key's latest time."""
    if new_keys.numel() == 0:
        return keys, times
    uniq, inverse = torch.unique(new_keys, return_inverse=True)
    latest = torch.full((uniq.numel(),), -torch.inf, dtype=times.dtype, device=times.device)
    latest = latest.scatter_reduce(0, inverse, new_times.to(times.dtype), "amax")
    at = torch.searchsorted(keys, uniq)
    found = at < keys.numel()
    found[found.clone()] = keys[at[found]] == uniq[found]
    times = times.clone()
    times[at[found]] = torch.maximum(times[at[found]], latest[found])
    fresh, fresh_t, fresh_at = uniq[~found], latest[~found], at[~found]
    # linear merge: an old key moves up by the fresh keys below it, a fresh one lands at its
    # insertion point plus the fresh keys before it
    shift = torch.bincount(fresh_at, minlength=keys.numel() + 1).cumsum(0)[: keys.numel()]
    old_to = torch.arange(keys.numel(), device=keys.device) + shift
    new_to = fresh_at + torch.arange(fresh.numel(), device=keys.device)
    n = keys.numel() + fresh.numel()
    out_k = keys.new_empty(n).index_copy_(0, old_to, keys).index_copy_(0, new_to, fresh)
    out_t = times.new_empty(n).index_copy_(0, old_to, times).index_copy_(0, new_to, fresh_t)
    return out_k, out_t


def _lookup(keys, times, q: torch.Tensor, start: float | None) -> torch.Tensor:
    """Whether each query key is remembered (at or after `start`, when given)."""
    if keys.numel() == 0:
        return torch.zeros(q.shape, dtype=torch.bool, device=q.device)
    at = torch.searchsorted(keys, q).clamp(max=keys.numel() - 1)
    hit = keys[at] == q
    if start is not None:
        hit &= times[at] >= start
    return hit


class EdgeBank:
    def __init__(
        self,
        num_nodes: int,
        src: torch.Tensor,
        dst: torch.Tensor,
        t: torch.Tensor,
        mode: str = "unlimited",
        window_ratio: float = 0.15,
    ) -> None:
        if mode not in EDGEBANK_MODES:
            raise ValueError(f"edgebank mode must be one of {EDGEBANK_MODES}, got {mode!r}")
        if not 0.0 < window_ratio <= 1.0:
            raise ValueError(f"edgebank window_ratio must be in (0, 1], got {window_ratio}")
        self.num_nodes, self.mode = int(num_nodes), mode
        self.keys = torch.empty(0, dtype=torch.int64)
        self.times = torch.empty(0, dtype=torch.float64)
        t = t.cpu().double()
        # the window (mode "window"): [end - length, end]
        span_lo, span_hi = (float(t.min()), float(t.max())) if t.numel() else (0.0, 0.0)
        self.end = span_hi
        self.start = span_lo + (span_hi - span_lo) * (1 - window_ratio)
        self.length = self.end - self.start
        self._merge(src, dst, t)

    def _merge(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor) -> None:
        self.keys, self.times = merge_pairs(self.keys, self.times, pair_keys(src.cpu(), dst.cpu()),
                                            t.cpu().double())  # fmt: skip

    def update(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor) -> None:
        """Record events (and, in window mode, move the window's end to their last time)."""
        if src.numel() == 0:
            return
        t = t.cpu().double()
        if self.mode == "window" and float(t.max()) > self.end:
            self.end = float(t.max())
            self.start = self.end - self.length
        self._merge(src, dst, t)

    def score(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """1.0 where (src, dst) is remembered (in window mode: last seen at or after the
        window's start), else 0.0; `src` broadcasts against `dst` (e.g. [P, 1] and [P, K])."""
        src, dst = torch.broadcast_tensors(src.cpu(), dst.cpu())
        start = self.start if self.mode == "window" else None
        return _lookup(self.keys, self.times, pair_keys(src, dst), start).double()


class EdgeBankModel(TemporalModel):
    """EdgeBank as a job's model (see the module docstring). `window` 0: unlimited memory."""

    num_layers = 0

    def __init__(self, window: float = 0.0) -> None:
        nn.Module.__init__(self)  # no link predictor: a pair's score is the memory's answer
        self.dim = 1
        self.window = float(window)
        self.confidence = nn.Parameter(torch.zeros(()))
        self.register_buffer("keys", torch.empty(0, dtype=torch.int64))
        self.register_buffer("times", torch.empty(0, dtype=torch.float64))
        self.register_buffer("end", torch.tensor(-torch.inf, dtype=torch.float64))

    def embed(self, ids, ts, blocks):
        raise ValueError("edgebank scores a pair from its memory: a node has no embedding")

    def score(self, src, dst, neg_BQ, t, blocks):
        start = float(self.end) - self.window if self.window > 0 else None
        pos = _lookup(self.keys, self.times, pair_keys(src, dst), start)
        neg = _lookup(self.keys, self.times, pair_keys(src.unsqueeze(1), neg_BQ), start)
        s = F.softplus(self.confidence)
        return s * (2 * pos.to(s.dtype) - 1), s * (2 * neg.to(s.dtype) - 1)

    def take_updates(self, events) -> dict | None:
        if events is None or not len(events):
            return None
        return {"events": (events.src, events.dst, events.t)}

    def apply_updates(self, updates: list[dict | None], owned=None) -> None:
        events = [u["events"] for u in updates if u is not None and "events" in u]
        if not events:
            return
        d = self.keys.device
        src, dst, t = (torch.cat([e[i] for e in events]).to(d) for i in range(3))
        if owned is not None:
            keep = owned(src).to(d)
            src, dst, t = src[keep], dst[keep], t[keep]
        if src.numel() == 0:
            return
        self.keys, self.times = merge_pairs(self.keys, self.times, pair_keys(src, dst), t)
        self.end = torch.maximum(self.end, t.max().to(self.end.dtype))

    def reset_state(self) -> None:
        self.keys, self.times = self.keys[:0], self.times[:0]
        self.end = torch.full_like(self.end, -torch.inf)

    def node_state(self) -> dict:
        return {"keys": self.keys.clone(), "times": self.times.clone(), "end": self.end.clone()}

    def load_node_state(self, state: dict) -> None:
        d = self.keys.device
        self.keys, self.times = state["keys"].to(d), state["times"].to(d)
        self.end = state["end"].to(d)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("keys", "times"):  # the memory's size is the state's
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name],
                                                     device=self.keys.device))  # fmt: skip
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
