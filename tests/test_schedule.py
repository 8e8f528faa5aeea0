"""The schedule derives each unit from the increments' bounds: it gives, unit for unit, what a
listing of the whole run gives (the reference below, the schedule as it was first written),
through resizes that change the training batch and increments added live, and its state grows
with the increments, not the steps."""

from __future__ import annotations

import pytest
import torch

from tidegraph.training.config import ContinualConfig
from tidegraph.training.schedule import Schedule, Unit, batch_bounds


class Listed:
    """The reference: the whole run as a list of units."""

    def __init__(self, schedule: Schedule, epochs: int) -> None:
        self.s, self.units, self.step = schedule, [], 0
        self.train_batch = schedule.batch_size
        self.units.append(Unit("ingest", -1, -1, 0, schedule.phase1_end))
        for e in range(epochs):
            self.units.append(Unit("reset", -1, e))
            self._pass("train", 0, schedule.val_start, -1, e)
            self._pass("eval", schedule.val_start, schedule.phase1_end, -1, e)
        self.units.append(Unit("phase_end", -1, -1, 0, schedule.phase1_end))

    def increment(self, k: int, lo: int, hi: int) -> None:
        self.units += [Unit("ingest", k, -1, lo, hi), Unit("snapshot", k, -1, lo, hi)]
        self._pass("eval", lo, hi, k, -1)
        self.units.append(Unit("retrain_begin", k, -1, lo, hi))
        for e in range(self.s.retrain_epochs):
            self.units += [Unit("restore", k, e, lo, hi), Unit("replay", k, e, lo, hi)]
            self._pass("train", lo, hi, k, e)
        self.units.append(Unit("increment_end", k, -1, lo, hi))

    def _pass(self, kind: str, lo: int, hi: int, k: int, e: int) -> None:
        batches = batch_bounds(lo, hi, self.train_batch if kind == "train" else self.s.batch_size)
        for j, (a, b) in enumerate(batches):
            step = -1
            if kind == "train":
                step, self.step = self.step, self.step + 1
            self.units.append(Unit(kind, k, e, a, b, step, j, len(batches)))
        self.units.append(Unit(f"{kind}_end", k, e, lo, hi))


def _same(schedule: Schedule, listed: Listed) -> None:
    assert len(schedule) == len(listed.units)
    assert [schedule.unit(i) for i in range(len(schedule))] == listed.units
    assert schedule.num_steps == listed.step
    with pytest.raises(IndexError):
        schedule.unit(len(schedule))
    # O(increments): no list in the schedule longer than the increments and phase 1
    sizes = [len(v) for v in vars(schedule).values() if isinstance(v, list)]
    assert max(sizes) <= len(schedule.increments) + 1


CASES = {
    "count": (dict(num_increments=4), 100, 1, 1),
    "window, 2 epochs each": (dict(increment_window=350.0, retrain_epochs=2), 64, 2, 2),
    "batches that do not divide": (dict(num_increments=3, val_fraction=0.3), 37, 3, 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_units_are_those_of_the_listed_run_through_resizes(case):
    over, batch, epochs, _ = CASES[case]
    t = torch.sort(torch.rand(2000, generator=torch.Generator().manual_seed(1)) * 3000).values
    schedule = Schedule(t.double(), ContinualConfig(**over), batch, epochs)
    listed = Listed(schedule, epochs)
    for k, (lo, hi) in enumerate(schedule.increments):
        listed.increment(k, lo, hi)
    _same(schedule, listed)
    # resizes after phase 1 and after increment 1 change the training batch of what follows
    for end, new in ((0, batch // 2), (2, batch * 3)):
        at = _ends(schedule)[end]
        schedule.rebatch(at, new)
        keep = listed.units[:at]
        listed.units, listed.train_batch = keep, new
        listed.step = sum(u.kind == "train" for u in keep)
        done = keep[-1].increment
        for k in range(done + 1, len(schedule.increments)):
            listed.increment(k, *schedule.increments[k])
        _same(schedule, listed)
    with pytest.raises(ValueError, match="does not follow an increment's end"):
        schedule.rebatch(_ends(schedule)[1] + 1, 10)


def _ends(schedule: Schedule) -> list[int]:
    """The units that follow phase 1's end and each increment's."""
    ends = ("phase_end", "increment_end")
    return [i + 1 for i, u in enumerate(schedule.units) if u.kind in ends]


def test_a_live_schedule_grows_by_increments_and_rebatches_at_its_end():
    t = torch.arange(500, dtype=torch.float64)
    schedule = Schedule(t, ContinualConfig(retrain_epochs=2), 50, 1, live=True)
    listed = Listed(schedule, 1)
    _same(schedule, listed)
    schedule.rebatch(len(schedule), 30)  # after phase 1, before any increment arrived
    listed.train_batch = 30
    for k, (lo, hi) in enumerate([(500, 640), (640, 700), (700, 1001)]):
        schedule.add_increment(lo, hi)
        listed.increment(k, lo, hi)
        _same(schedule, listed)
