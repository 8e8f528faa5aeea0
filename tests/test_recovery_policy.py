"""The recovery decisions as a table of cases, without Ray."""

from __future__ import annotations

import pytest

from tidegraph.recovery import Plan, plan_trainer_recovery

CASES = [
    # world, lost, finished steps per survivor -> source, steps, replace, copy_to
    (2, [1], {0: 3}, Plan(0, 3, (1,), (1,))),
    (2, [0], {1: 3}, Plan(1, 3, (0,), (0,))),
    # the survivor that finished the step before its peer died is ahead: the other copies it
    (3, [2], {0: 4, 1: 3}, Plan(0, 4, (2,), (1, 2))),
    (3, [0], {1: 3, 2: 4}, Plan(2, 4, (0,), (0, 1))),
    # equal survivors: the lowest rank is the source, nobody else copies
    (4, [1, 3], {0: 7, 2: 7}, Plan(0, 7, (1, 3), (1, 3))),
    # nothing lost (a shard was): survivors behind still catch up
    (2, [], {0: 5, 1: 5}, Plan(0, 5, (), ())),
    (2, [], {0: 4, 1: 5}, Plan(1, 5, (), (0,))),
    # no replica left: the checkpoint path
    (2, [0, 1], {}, Plan(None, 0, (0, 1), ())),
]


@pytest.mark.parametrize(("world", "lost", "done", "plan"), CASES)
def test_the_source_is_the_survivor_furthest_ahead_and_no_step_is_undone(world, lost, done, plan):
    assert plan_trainer_recovery(world, lost, done) == plan


@pytest.mark.parametrize(
    ("world", "lost", "done", "message"),
    [
        (2, [1], {0: 3, 1: 3}, "every survivor"),
        (2, [2], {0: 1, 1: 1}, "not all in a group"),
        (3, [2], {0: 5, 1: 3}, "more than one step apart"),
    ],
)
def test_inconsistent_reports_are_refused(world, lost, done, message):
    with pytest.raises(ValueError, match=message):
        plan_trainer_recovery(world, lost, done)
