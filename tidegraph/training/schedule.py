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

`Schedule(...).units` lists the whole run as units of work in order; `Cursor.unit` is the index
of the next one. A unit is an ingest, a training step (one global batch), an evaluation batch,
or a pass boundary (reset or restore node state, draw an epoch's replay, close a pass, close
phase 1 or an increment). Every state change of a run happens at a unit boundary, and a
checkpoint is the pieces' states at one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = [
    "Cursor",
    "Schedule",
    "Unit",
    "batch_bounds",
    "batch_start",
    "increment_bounds",
    "phase1_bounds",
    "slice_bounds",
    "train_slices",
]


@dataclass
class Cursor:
    """Where a run stands: events ingested, phase 1 done, next increment, global steps taken."""

    ingested: int = 0
    phase1_done: bool = False
    increment: int = 0
    step: int = 0
    unit: int = 0  # index of the next unit of `Schedule.units`

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass(frozen=True)
class Unit:
    """One unit of work. `kind`: ingest, reset, snapshot, restore, replay, train, eval,
    train_end, eval_end, retrain_begin, phase_end, increment_end."""

    kind: str
    increment: int = -1  # -1: phase 1
    epoch: int = -1
    lo: int = 0  # events [lo, hi): the batch, or what is ingested
    hi: int = 0
    step: int = -1  # global training step (train units)
    part: int = -1  # batch index within its pass
    parts: int = 0  # batches in its pass


class Schedule:
    """The run as a list of units, a pure function of the stream's times and the config."""

    def __init__(
        self, t: torch.Tensor, continual, batch_size: int, epochs: int, live: bool = False
    ) -> None:
        """`live`: the stream so far is all of phase 1 (its last `val_fraction` validates),
        and increments are added as they arrive (`add_increment`)."""
        if live:
            end = t.shape[0]
            self.val_start, self.phase1_end = end - int(end * continual.val_fraction), end
            self.increments = []
        else:
            self.val_start, self.phase1_end = phase1_bounds(t.shape[0], continual)
            self.increments = increment_bounds(t, self.phase1_end, continual)
        self.retrain_epochs = continual.retrain_epochs
        self.batch_size = batch_size
        self.train_batch = batch_size  # of training passes (`rebatch` changes it)
        self.units: list[Unit] = []
        self._step = 0
        self._phase1(epochs)
        for k, (lo, hi) in enumerate(self.increments):
            self._increment(k, lo, hi, continual.retrain_epochs)

    def add_increment(self, lo: int, hi: int) -> None:
        """Events [lo, hi) arrived: one more increment at the end of the run."""
        k = len(self.increments)
        self.increments.append((lo, hi))
        self._increment(k, lo, hi, self.retrain_epochs)

    def rebatch(self, at: int, train_batch: int) -> None:
        """Training passes of the increments after unit `at` (the unit after an increment's
        end, or phase 1's) use global batches of `train_batch` events: their units are made
        again (evaluation keeps its batches)."""
        done = self.units[at - 1].increment if at > 0 else -1
        if at == 0 or self.units[at - 1].kind not in ("increment_end", "phase_end"):
            raise ValueError(f"Schedule.rebatch: unit {at} does not follow an increment's end")
        del self.units[at:]
        self._step = sum(u.kind == "train" for u in self.units)
        self.train_batch = train_batch
        for k in range(done + 1, len(self.increments)):
            self._increment(k, *self.increments[k], self.retrain_epochs)

    def _pass(self, kind: str, lo: int, hi: int, increment: int, epoch: int) -> None:
        batches = batch_bounds(lo, hi, self.train_batch if kind == "train" else self.batch_size)
        for j, (a, b) in enumerate(batches):
            step = -1
            if kind == "train":
                step, self._step = self._step, self._step + 1
            self.units.append(Unit(kind, increment, epoch, a, b, step, j, len(batches)))
        self.units.append(Unit(f"{kind}_end", increment, epoch, lo, hi))

    def _phase1(self, epochs: int) -> None:
        self.units.append(Unit("ingest", -1, -1, 0, self.phase1_end))
        for e in range(epochs):
            self.units.append(Unit("reset", -1, e))
            self._pass("train", 0, self.val_start, -1, e)
            self._pass("eval", self.val_start, self.phase1_end, -1, e)
        self.units.append(Unit("phase_end", -1, -1, 0, self.phase1_end))

    def _increment(self, k: int, lo: int, hi: int, retrain_epochs: int) -> None:
        self.units.append(Unit("ingest", k, -1, lo, hi))
        self.units.append(Unit("snapshot", k, -1, lo, hi))
        self._pass("eval", lo, hi, k, -1)
        self.units.append(Unit("retrain_begin", k, -1, lo, hi))
        for e in range(retrain_epochs):
            self.units.append(Unit("restore", k, e, lo, hi))
            self.units.append(Unit("replay", k, e, lo, hi))
            self._pass("train", lo, hi, k, e)
        self.units.append(Unit("increment_end", k, -1, lo, hi))


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


def train_slices(
    ev, weight, neg_BQ, num_observe: int, trainers: int, bounds: list | None = None
) -> list[tuple]:
    """Per trainer, the arguments of its share of one training step: (events, weights,
    negatives, how many of its events are new, the global batch size, the batch's start).
    The first `num_observe` events of the batch are new, so a slice records those it holds;
    the batch's start is the earliest time of those (None: none new), the same for every
    slice whatever the cut (`sampler.history: batch`). `bounds`: the slices' [lo, hi)
    (default: even)."""
    start = batch_start(ev.t[:num_observe])
    out = []
    for lo, hi in bounds or slice_bounds(len(ev), trainers):
        w = None if weight is None else weight[lo:hi]
        n_obs = max(0, min(hi, num_observe) - lo)
        out.append((ev.select(slice(lo, hi)), w, neg_BQ[lo:hi], n_obs, len(ev), start))
    return out


def batch_start(t_new: torch.Tensor) -> float | None:
    """The earliest of a batch's new events' times `t_new` (None: none new)."""
    return float(t_new.min()) if t_new.numel() else None


def slice_bounds(n: int, trainers: int) -> list[tuple[int, int]]:
    """W contiguous slices of a batch of n events; the first n mod W get one more."""
    base, extra = divmod(n, trainers)
    ends, at = [], 0
    for w in range(trainers):
        at += base + (1 if w < extra else 0)
        ends.append(at)
    return list(zip([0] + ends[:-1], ends, strict=True))
