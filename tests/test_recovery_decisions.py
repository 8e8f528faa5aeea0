"""The recovery decisions RayGroup acts on, as tables of cases, without Ray: the triage of a
failure, the recovery budget, the shard recovery plan and its replay, the steps of the window
sent again, and when a pass gives up."""

from __future__ import annotations

import pytest

from tidegraph.recovery.budget import RecoveryBudget
from tidegraph.recovery.policy import Triage, triage_recovery
from tidegraph.recovery.shards import ShardRecoveryPlan, plan_shard_recovery, replay_ops
from tidegraph.recovery.steps import Redo, pass_stall, plan_redo, stall_message


def cases(table):
    """pytest.param per row (name, *values)."""
    return [pytest.param(*row[1:], id=row[0]) for row in table]


ALL_LOST = "all {} trainers were lost; no replica to recover from"

TRIAGE = [
    # lost trainers, lost shards, lost replicas, group failure, world -> action, shards, reason
    ("nothing lost, an error of its own: raised again", [], [], [], False, 2, "raise", (), ""),
    ("nothing lost, the group's collective failed: rebuilt", [], [], [], True, 2, "recover",
     (), ""),
    ("a replica lost", [], [], [(0, 0)], False, 2, "recover", (), ""),
    ("a shard lost", [], [1], [], False, 2, "recover", (1,), ""),
    ("a trainer lost", [1], [], [], False, 3, "recover", (), ""),
    ("a trainer lost in a group failure", [0], [], [], True, 2, "recover", (), ""),
    ("every trainer lost", [0, 1], [], [], False, 2, "no_replica", (), ALL_LOST.format(2)),
    ("every trainer and shards lost: the shards are rebuilt first", [0], [0, 2], [], True, 1,
     "no_replica", (0, 2), ALL_LOST.format(1)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("lost", "shards", "replicas", "group", "world", "action", "rebuild", "reason"), cases(TRIAGE)
)
def test_triage(lost, shards, replicas, group, world, action, rebuild, reason):
    got = triage_recovery(lost, shards, replicas, group, world, 1)
    assert got == Triage(action, rebuild, world, 1, reason)


SHRINK = [
    # world, min trainers, each replaced rank's slot placed in time? -> may it shrink, per rank
    ("above the minimum: each may shrink", 3, 1, [False, False], [True, True]),
    ("at the minimum: none may, every rank waits for its slot", 2, 2, [True], [False]),
    ("down to the minimum, then waiting", 4, 2, [False, False, True], [True, True, False]),
    ("a replacement placed does not count", 4, 2, [True, False, True], [True, True, True]),
]  # fmt: skip


@pytest.mark.parametrize(("world", "least", "placed", "want"), cases(SHRINK))
def test_may_shrink_per_replaced_rank(world, least, placed, want):
    """RayGroup._recover's loop: a rank whose replacement got no slot in time is dropped."""
    triage = triage_recovery(list(range(len(placed))), [], [], False, world, least)
    dropped, got = 0, []
    for ok in placed:
        got.append(triage.may_shrink(dropped))
        dropped += not ok
    assert got == want


BUDGET = [
    # max recoveries, recoveries spent in order -> the spend that raises (None), left after
    ("within the budget", 2, ["trainer", "shard"], None, 0),
    ("none allowed: the first raises", 0, ["trainer"], 0, -1),
    ("one allowed: the second raises, named by its kind", 1, ["trainer", "shard"], 1, -1),
    ("shard rebuilds count with trainer recoveries", 2, ["shard", "shard", "trainer"], 2, -1),
]  # fmt: skip


@pytest.mark.parametrize(("most", "spends", "raises", "left"), cases(BUDGET))
def test_recovery_budget(most, spends, raises, left):
    budget = RecoveryBudget(most)
    cause = ConnectionError("a trainer died")
    for i, what in enumerate(spends):
        if i == raises:
            with pytest.raises(RuntimeError) as info:
                budget.spend(what, cause)
            assert str(info.value) == f"{what} recovery: the retry budget is spent"
            assert info.value.__cause__ is cause
            break
        budget.spend(what, cause)
    else:
        assert raises is None
    assert budget.left == left
    assert len(budget.tries()) == most + 1  # retry loops: one try more, whatever is spent


def test_a_spent_budget_stays_spent():
    budget = RecoveryBudget(0)
    for expected in (-1, -2):
        with pytest.raises(RuntimeError, match="^trainer recovery: the retry budget is spent$"):
            budget.spend("trainer")
        assert budget.left == expected
    assert str(RecoveryBudget.error("shard")) == "shard recovery: the retry budget is spent"


SHARD_PLAN = [
    # lost partitions, live replicas per partition -> promoted, rebuilt (in the order lost)
    ("no replicas: all rebuilt", [2, 0], [0, 0, 0], (), (2, 0)),
    ("replicas: all promoted", [1, 0], [1, 2], (1, 0), ()),
    ("some with a replica left", [0, 1, 3], [1, 0, 1, 1], (0, 3), (1,)),
    ("nothing lost", [], [1, 1], (), ()),
]  # fmt: skip


@pytest.mark.parametrize(("lost", "replicas", "promote", "rebuild"), cases(SHARD_PLAN))
def test_plan_shard_recovery(lost, replicas, promote, rebuild):
    assert plan_shard_recovery(lost, replicas) == ShardRecoveryPlan(promote, rebuild)


JOURNAL = [("ingest", 0), ("apply", "u0"), ("ingest", 1), ("reset", None), ("apply", "u1")]
SNAP = {"shards": [], "ingests": []}

REPLAY = [
    # snapshot, ingests it covers, ingests, journal (None: node state on trainers), its base
    # -> ops replayed
    ("no snapshot: every ingest", None, 0, 3, None, 0, (("ingest", 0), ("ingest", 1),
                                                        ("ingest", 2))),
    ("a snapshot of the first two: the third", SNAP, 2, 3, None, 0, (("ingest", 2),)),
    ("a snapshot of all: nothing", SNAP, 3, 3, None, 0, ()),
    ("sharded node state, no snapshot: the whole journal", None, 0, 2, JOURNAL, 0,
     tuple(JOURNAL)),
    ("sharded, a snapshot: the journal since its position", {**SNAP, "journal_pos": 7}, 1, 2,
     JOURNAL, 5, tuple(JOURNAL[2:])),
    ("sharded, a snapshot at the journal's end: nothing", {**SNAP, "journal_pos": 10}, 2, 2,
     JOURNAL, 5, ()),
]  # fmt: skip


@pytest.mark.parametrize(("snap", "start", "ingests", "journal", "base", "ops"), cases(REPLAY))
def test_replay_ops(snap, start, ingests, journal, base, ops):
    assert replay_ops([1], snap, start, ingests, journal, base) == ops


GONE = [
    # snapshot, journal base: the journal no longer reaches back to the snapshot
    ("no snapshot, the journal's start dropped", None, 2),
    ("a snapshot older than the journal", {**SNAP, "journal_pos": 1}, 2),
    ("a snapshot with no journal position (taken before journaling)", SNAP, 0),
]  # fmt: skip


@pytest.mark.parametrize(("snap", "base"), cases(GONE))
def test_replay_refuses_when_the_journal_is_gone(snap, base):
    cause = ConnectionError("shard actor died")
    with pytest.raises(RuntimeError) as info:
        replay_ops([0, 2], snap, 0, 3, JOURNAL, base, cause)
    assert str(info.value) == (
        "shards [0, 2] were lost with the node state they own (cluster.memory 'sharded') and "
        "no replica (cluster.shard_replicas), and the journal of node-state updates since "
        "their snapshot is gone: resume the run from its last checkpoint"
    )
    assert info.value.__cause__ is cause


REDO = [
    # window's step indices, steps the group holds -> per step: held, or sent again carrying
    # the `after` of the window step at this position (None: its own `before`)
    ("every step held: each answered", [3, 4], 5, [Redo(True), Redo(True)]),
    ("none held: all sent again, each after the one before",
     [3, 4, 5], 3, [Redo(False), Redo(False, 0), Redo(False, 1)]),
    ("the first held: the next carries its answered updates",
     [3, 4, 5], 4, [Redo(True), Redo(False, 0), Redo(False, 1)]),
    ("one step, not held: its own updates before", [7], 7, [Redo(False)]),
    ("a survivor ahead holds all but the last", [0, 1, 2], 2,
     [Redo(True), Redo(True), Redo(False, 1)]),
    ("an empty window", [], 4, []),
]  # fmt: skip


@pytest.mark.parametrize(("indices", "done", "want"), cases(REDO))
def test_plan_redo(indices, done, want):
    plan = plan_redo(indices, done)
    assert plan == tuple(want)
    assert sum(not r.held for r in plan) == sum(i >= done for i in indices)  # the log's count


STALL = [
    # recoveries in a row without progress before, results before, after -> count, gives up
    ("progress: the count starts again", 2, 4, 6, 0, False),
    ("no progress, first time", 0, 4, 4, 1, False),
    ("no progress, second time", 1, 4, 4, 2, False),
    ("no progress, third time: gives up", 2, 4, 4, 3, True),
    ("a recovery at the pass's start that made none", 2, 0, 0, 3, True),
]  # fmt: skip


@pytest.mark.parametrize(("stalled", "done", "now", "count", "stuck"), cases(STALL))
def test_pass_stall(stalled, done, now, count, stuck):
    assert pass_stall(stalled, done, now) == (count, stuck)


def test_the_stall_message_names_the_step_the_pass_and_the_lost():
    assert stall_message("train_pass", 4, 10, 3, [1]) == (
        "trainers keep failing at step 4 of a train_pass of 10 steps (3 recoveries without "
        "progress); last lost: [1]"
    )
