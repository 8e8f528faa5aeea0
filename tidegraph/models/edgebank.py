"""EdgeBank (Poursafaei et al., 2022): the memorising baseline of every TGB table. It scores a
(source, destination) pair 1 when the pair was seen before and 0 otherwise; no parameters, no
training.

- `unlimited`: seen at any time before.
- `window` (TGB's `fixed_time_window`): seen within a window of the latest times. The window's
  length is `window_ratio` of the time span of the events it is built from (TGB: the train
  split's, 0.15), ending at their last time; each `update` with later events moves its end to
  their last time (TGB moves it after each evaluated batch of positives).

The memory is every distinct pair with its latest time, as sorted int64 keys (src * n + dst)
and float64 times: `update` merges a batch in one sort, `score` looks pairs up by binary
search, both vectorized.
"""

from __future__ import annotations

import torch

__all__ = ["EDGEBANK_MODES", "EdgeBank"]

EDGEBANK_MODES = ("unlimited", "window")


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
        keys = torch.cat([self.keys, src.cpu().to(torch.int64) * self.num_nodes +
                          dst.cpu().to(torch.int64)])  # fmt: skip
        times = torch.cat([self.times, t.cpu().double()])
        uniq, inverse = torch.unique(keys, return_inverse=True)
        latest = torch.full((uniq.numel(),), -torch.inf, dtype=torch.float64)
        self.keys = uniq
        self.times = latest.scatter_reduce(0, inverse, times, "amax")

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
        src, dst = torch.broadcast_tensors(src.cpu().to(torch.int64), dst.cpu().to(torch.int64))
        keys = src * self.num_nodes + dst
        at = torch.searchsorted(self.keys, keys).clamp(max=max(self.keys.numel() - 1, 0))
        if self.keys.numel() == 0:
            return torch.zeros(keys.shape, dtype=torch.float64)
        hit = self.keys[at] == keys
        if self.mode == "window":
            hit &= self.times[at] >= self.start
        return hit.double()
