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

`Schedule(...).unit(i)` is the run's i-th unit of work; `Cursor.unit` is the index of the next
one. Units are derived from the bounds of phase 1 and each increment, never listed, so a
schedule's state grows with the increments, not with the steps. A unit is an ingest, a
training step (one global batch), an evaluation batch, or a pass boundary (reset or restore
node state, draw an epoch's replay, close a pass, close phase 1 or an increment). Every state
change of a run happens at a unit boundary, and a checkpoint is the pieces' states at one.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass

import torch

from tidegraph.storage.spool import window_ends

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
    unit: int = 0  # index of the next unit (`Schedule.unit`)

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
    """The run as units, a pure function of the stream's times and the config, derived on
    demand: `unit(i)` computes the i-th unit from the bounds of phase 1 or the increment it
    falls in and that block's training batch, so the state is O(increments) however long the
    run (`units` lists them all, for tests and tools)."""

    def __init__(self, t, continual, batch_size: int, epochs: int, live: bool = False) -> None:
        """`t`: the stream's times (a tensor, or the `EventSpool` that holds them). `live`: the
        stream so far is all of phase 1 (its last `val_fraction` validates), and increments
        are added as they arrive (`add_increment`)."""
        if live:
            end = len(t)
            self.val_start, self.phase1_end = end - int(end * continual.val_fraction), end
            increments = []
        else:
            self.val_start, self.phase1_end = phase1_bounds(len(t), continual)
            increments = increment_bounds(t, self.phase1_end, continual)
        self.retrain_epochs = continual.retrain_epochs
        self.epochs = epochs
        self.batch_size = batch_size
        self.train_batch = batch_size  # of the next increment's training passes (`rebatch`)
        self.increments: list[tuple[int, int]] = []
        # per block (phase 1, then each increment): its first unit, first training step and
        # training batch
        self._first: list[int] = []
        self._steps: list[int] = []
        self._batch: list[int] = []
        self._append_block(batch_size)
        for lo, hi in increments:
            self.add_increment(lo, hi)

    def __len__(self) -> int:
        return self._first[-1] + self._size(len(self._first) - 1)

    @property
    def units(self) -> list[Unit]:
        """Every unit of the run so far, in order (O(run): for tests and tools)."""
        return [self.unit(i) for i in range(len(self))]

    @property
    def num_steps(self) -> int:
        """Global training steps of the run so far."""
        last = len(self._first) - 1
        return self._steps[last] + self._block_steps(last)

    def add_increment(self, lo: int, hi: int) -> None:
        """Events [lo, hi) arrived: one more increment at the end of the run."""
        self.increments.append((lo, hi))
        self._append_block(self.train_batch)

    def rebatch(self, at: int, train_batch: int) -> None:
        """Training passes of the increments from unit `at` on (the unit after an increment's
        end, or phase 1's) use global batches of `train_batch` events (evaluation keeps its
        batches)."""
        if at == 0 or at > len(self) or self.unit(at - 1).kind not in ("increment_end",
                                                                         "phase_end"):  # fmt: skip
            raise ValueError(f"Schedule.rebatch: unit {at} does not follow an increment's end")
        self.train_batch = train_batch
        first = bisect.bisect_left(self._first, at)  # the block starting at `at`, if any
        for b in range(first, len(self._first)):
            self._batch[b] = train_batch
            self._first[b] = self._first[b - 1] + self._size(b - 1)
            self._steps[b] = self._steps[b - 1] + self._block_steps(b - 1)

    def unit(self, i: int) -> Unit:
        """The i-th unit of the run."""
        if not 0 <= i < len(self):
            raise IndexError(f"Schedule.unit: {i} is outside the run's {len(self)} units")
        b = bisect.bisect_right(self._first, i) - 1
        r, step = i - self._first[b], self._steps[b]
        if b == 0:
            return self._phase1_unit(r, step)
        return self._increment_unit(b - 1, r, step)

    # ---- blocks -------------------------------------------------------------------------------

    def _append_block(self, train_batch: int) -> None:
        b = len(self._first)
        self._batch.append(train_batch)
        self._first.append(0 if b == 0 else self._first[b - 1] + self._size(b - 1))
        self._steps.append(0 if b == 0 else self._steps[b - 1] + self._block_steps(b - 1))

    def _bounds(self, b: int) -> tuple[int, int, int, int]:
        """(training lo, hi, evaluation lo, hi) of block b."""
        if b == 0:
            return 0, self.val_start, self.val_start, self.phase1_end
        lo, hi = self.increments[b - 1]
        return lo, hi, lo, hi

    def _parts(self, b: int) -> tuple[int, int]:
        """(training batches, evaluation batches) of one pass of block b."""
        tlo, thi, elo, ehi = self._bounds(b)
        return -(-(thi - tlo) // self._batch[b]), -(-(ehi - elo) // self.batch_size)

    def _size(self, b: int) -> int:
        nt, ne = self._parts(b)
        if b == 0:  # ingest, per epoch (reset, train pass, eval pass), phase_end
            return 2 + self.epochs * (3 + nt + ne)
        # ingest, snapshot, eval pass, retrain_begin, per epoch (restore, replay, train
        # pass), increment_end
        return 5 + ne + self.retrain_epochs * (3 + nt)

    def _block_steps(self, b: int) -> int:
        return (self.epochs if b == 0 else self.retrain_epochs) * self._parts(b)[0]

    def _batch_unit(self, kind, k, e, lo, hi, size, j, n, step=-1) -> Unit:
        return Unit(kind, k, e, lo + j * size, min(lo + (j + 1) * size, hi), step, j, n)

    def _phase1_unit(self, r: int, step: int) -> Unit:
        tlo, thi, elo, ehi = self._bounds(0)
        nt, ne = self._parts(0)
        if r == 0:
            return Unit("ingest", -1, -1, 0, self.phase1_end)
        if r == self._size(0) - 1:
            return Unit("phase_end", -1, -1, 0, self.phase1_end)
        e, q = divmod(r - 1, 3 + nt + ne)
        if q == 0:
            return Unit("reset", -1, e)
        if q <= nt:
            j = q - 1
            return self._batch_unit("train", -1, e, tlo, thi, self._batch[0], j, nt,
                                    step + e * nt + j)  # fmt: skip
        if q == nt + 1:
            return Unit("train_end", -1, e, tlo, thi)
        if q <= nt + 1 + ne:
            return self._batch_unit("eval", -1, e, elo, ehi, self.batch_size, q - nt - 2, ne)
        return Unit("eval_end", -1, e, elo, ehi)

    def _increment_unit(self, k: int, r: int, step: int) -> Unit:
        lo, hi = self.increments[k]
        nt, ne = self._parts(k + 1)
        if r < 2:
            return Unit(("ingest", "snapshot")[r], k, -1, lo, hi)
        if r < 2 + ne:
            return self._batch_unit("eval", k, -1, lo, hi, self.batch_size, r - 2, ne)
        if r < 4 + ne:
            return Unit(("eval_end", "retrain_begin")[r - 2 - ne], k, -1, lo, hi)
        if r == self._size(k + 1) - 1:
            return Unit("increment_end", k, -1, lo, hi)
        e, q = divmod(r - 4 - ne, 3 + nt)
        if q < 2:
            return Unit(("restore", "replay")[q], k, e, lo, hi)
        if q < 2 + nt:
            j = q - 2
            return self._batch_unit("train", k, e, lo, hi, self._batch[k + 1], j, nt,
                                    step + e * nt + j)  # fmt: skip
        return Unit("train_end", k, e, lo, hi)


def phase1_bounds(num_events: int, c) -> tuple[int, int]:
    """(val_start, phase1_end) of the first `c.train_fraction` of a stream."""
    end = int(num_events * c.train_fraction)
    return end - int(end * c.val_fraction), end


def increment_bounds(t: torch.Tensor, start: int, c) -> list[tuple[int, int]]:
    """[(start, end)] of each increment over events[start:], by count or by time window; `t`:
    the stream's times, or a spool of them (`EventSpool`: its length and `window_ends`)."""
    n = len(t)
    if start >= n:
        return []
    if c.increment_window is not None:
        if isinstance(t, torch.Tensor):
            ends = window_ends([t[start:]], start, c.increment_window)
        else:  # a spooled stream's times, read a row group at a time (`EventSpool`)
            ends = t.window_ends(start, c.increment_window)
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
