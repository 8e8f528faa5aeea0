"""The schedule: which events each global step covers and which trainer takes which slice.

Pure functions of the run's configuration and the stream's times, no state of their own, so the
single-process learner, the in-process group and the Ray orchestrator cut the stream the same
way, and a checkpoint needs only the cursor (`Cursor`) to resume at a step boundary:
- phase 1 covers events [0, phase1_end): `train.epochs` epochs, each a training pass over
  [0, val_start) then an evaluation pass over [val_start, phase1_end);
- increment k covers `increment_bounds(...)[k]`: evaluate it, then `retrain_epochs` passes over
  it with replayed old events split evenly over its batches;
- a global step is one batch of `train.batch_size` consecutive events (plus its share of replayed
  ones), cut into W contiguous slices by `slice_bounds` (sizes differ by at most one event).
Randomness (negatives, replay choice) is drawn per step by the orchestrator from named seed
streams, never per slice, so it does not depend on W.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = ["Cursor", "batch_bounds", "increment_bounds", "phase1_bounds", "slice_bounds"]


@dataclass
class Cursor:
    """Where a run stands: events ingested, phase 1 done, next increment, global steps taken."""

    ingested: int = 0
    phase1_done: bool = False
    increment: int = 0
    step: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def phase1_bounds(num_events: int, c) -> tuple[int, int]:
    """(val_start, phase1_end) of the first `c.train_fraction` of a stream."""
    end = int(num_events * c.train_fraction)
    return end - int(end * c.val_fraction), end


def increment_bounds(t: torch.Tensor, start: int, c) -> list[tuple[int, int]]:
    """[(start, end)] of each increment over events[start:], by count or by time window."""
    n = t.shape[0]
    if start >= n:
        return []
    if c.increment_window is not None:
        window = torch.floor((t[start:] - t[start]) / c.increment_window).long()
        _, counts = torch.unique_consecutive(window, return_counts=True)
        ends = (start + torch.cumsum(counts, 0)).tolist()
    else:
        size = c.increment_events or -(-(n - start) // c.num_increments)
        ends = list(range(start + size, n, size)) + [n]
    starts = [start] + ends[:-1]
    return list(zip(starts, ends, strict=True))


def batch_bounds(start: int, end: int, batch_size: int) -> list[tuple[int, int]]:
    """Global steps over events [start, end): consecutive batches of `batch_size`."""
    return [(lo, min(lo + batch_size, end)) for lo in range(start, end, batch_size)]


def slice_bounds(n: int, trainers: int) -> list[tuple[int, int]]:
    """W contiguous slices of a batch of n events; the first n mod W get one more."""
    base, extra = divmod(n, trainers)
    ends, at = [], 0
    for w in range(trainers):
        at += base + (1 if w < extra else 0)
        ends.append(at)
    return list(zip([0] + ends[:-1], ends, strict=True))
