"""The elasticity decisions RayGroup acts on, as tables of cases, without Ray: the member
that stays, renumbering after a resize, pending slots to keep, free bundles, shard actors that
leave, and partitions that need a successor."""

from __future__ import annotations

import pytest

from tidegraph.elastic.policy import (
    free_bundles,
    partitions_to_move,
    plan_shard_leavers,
    renumber,
    spare_slots,
    stays,
)


def cases(table):
    """pytest.param per row (name, *values)."""
    return [pytest.param(*row[1:], id=row[0]) for row in table]


STAYS = [
    # members, ranks leaving, members joining -> the rank that stays (None: some stay anyway)
    ("one of three leaves", 3, {1}, 0, None),
    ("two of three leave", 3, {1, 2}, 0, None),
    ("all leave, nobody joins: the lowest stays", 3, {2, 0, 1}, 0, 0),
    ("all leave, one joins", 2, {0, 1}, 1, None),
    ("the only member leaves, nobody joins", 1, {0}, 0, 0),
    ("nobody leaves", 2, set(), 0, None),
]  # fmt: skip


@pytest.mark.parametrize(("world", "leave", "join", "want"), cases(STAYS))
def test_stays(world, leave, join, want):
    assert stays(world, leave, join) == want
    assert stays(world, sorted(leave), join) == want  # a set (resize) or a list (the plan)


RENUMBER = [
    # ranks kept, joined (member, trainer) -> trainers, members, incarnations by new rank
    ("a middle rank dropped", [0, 2], [], (["t0", "t2"], [0, 5], [1, 0])),
    ("the first rank dropped: the rest move down", [1, 2], [], (["t1", "t2"], [3, 5], [2, 0])),
    ("nothing dropped", [0, 1, 2], [], (["t0", "t1", "t2"], [0, 3, 5], [1, 2, 0])),
    ("joiners after the kept ranks, not replaced yet", [2], [(7, "j7"), (8, "j8")],
     (["t2", "j7", "j8"], [5, 7, 8], [0, 0, 0])),
    ("all replaced by joiners", [], [(9, "j9")], (["j9"], [9], [0])),
]  # fmt: skip


@pytest.mark.parametrize(("keep", "joined", "want"), cases(RENUMBER))
def test_renumber(keep, joined, want):
    # ranks 0, 1, 2 are members 0, 3, 5 (renumbered before), replaced 1, 2 and 0 times
    assert renumber(keep, ["t0", "t1", "t2"], [0, 3, 5], [1, 2, 0], joined) == want


SPARES = [
    # target, members now, starting, idle spares wanted -> pending slots to keep
    ("trainers at target", 2, 2, 0, 0, 0),
    ("trainers below target", 4, 2, 0, 0, 2),
    ("trainers above target: none", 2, 3, 0, 0, 0),
    ("trainers at target, spare trainers", 2, 2, 0, 1, 1),
    ("trainers below target and spares", 3, 1, 0, 2, 4),
    ("trainers above target and a spare", 1, 3, 0, 1, 1),
    ("shard actors below target, one starting", 4, 2, 1, 0, 1),
    ("shard actors: more starting than lacking", 4, 2, 3, 0, 0),
]  # fmt: skip


@pytest.mark.parametrize(("target", "have", "starting", "spares", "want"), cases(SPARES))
def test_spare_slots(target, have, starting, spares, want):
    assert spare_slots(target, have, starting, spares) == want


SPREAD, OTHER = object(), object()  # placement groups: compared by identity

BUNDLES = [
    # slots taken, bundles in the SPREAD group -> its free bundles
    ("all taken", [(SPREAD, 0), (SPREAD, 1)], 2, ()),
    ("none taken", [], 3, (0, 1, 2)),
    ("others' groups do not count", [(SPREAD, 1), (OTHER, 0), (OTHER, 2)], 3, (0, 2)),
    ("a bundle taken twice", [(SPREAD, 2), (SPREAD, 2)], 4, (0, 1, 3)),
]  # fmt: skip


@pytest.mark.parametrize(("taken", "size", "want"), cases(BUNDLES))
def test_free_bundles(taken, size, want):
    assert free_bundles(taken, SPREAD, size) == want


def test_free_bundles_compares_groups_by_identity():
    assert free_bundles([([], 0)], [], 2) == (0, 1)  # equal, not the same group


LEAVERS = [
    # hosts {actor: (node, slot a reserved bundle, partitions)}, draining nodes, target
    # -> actors that leave, how many of them for draining
    ("at target, nothing draining", {"a": ("n1", True, 2), "b": ("n2", True, 2)}, {}, 2,
     ((), 0)),
    ("a host's node drains", {"a": ("n1", True, 2), "b": ("n2", True, 2)}, {"n2": 0}, 2,
     (("b",), 1)),
    ("every host's node drains: nowhere to go", {"a": ("n1", True, 2), "b": ("n1", True, 2)},
     {"n1": 0}, 2, ((), 0)),
    ("above target: own slots first, fewest partitions first",
     {"a": ("n1", True, 1), "b": ("n2", False, 3), "c": ("n3", False, 1)}, {}, 1,
     (("c", "b"), 0)),
    ("above target, equal hosts: the earliest", {"a": ("n1", False, 2), "b": ("n2", False, 2),
     "c": ("n3", True, 1)}, {}, 2, (("a",), 0)),
    ("draining and above target", {"a": ("n1", True, 2), "b": ("n2", False, 1),
     "c": ("n3", False, 1)}, {"n1": 5}, 1, (("a", "b"), 1)),
    ("a host not placed yet is not draining", {"a": (None, False, 1), "b": ("n1", True, 1)},
     {"n1": 0}, 2, (("b",), 1)),
    ("no hosts", {}, {"n1": 0}, 1, ((), 0)),
]  # fmt: skip


@pytest.mark.parametrize(("hosts", "draining", "target", "want"), cases(LEAVERS))
def test_plan_shard_leavers(hosts, draining, target, want):
    assert plan_shard_leavers(hosts, draining, target) == want


MOVES = [
    # partition p's node, draining nodes, partitions asked to move -> partitions to move
    ("nothing draining or asked", ["n1", "n2"], {}, set(), ()),
    ("a node drains, a shard elsewhere takes its partitions", ["n1", "n2"], {"n1": 0}, set(),
     ()),
    ("every shard's node drains", ["n1", "n1", "n2"], {"n1": 0, "n2": 0}, set(), (0, 1, 2)),
    ("an operator's move", ["n1", "n2"], {}, {1}, (1,)),
    ("an operator's move and all draining", ["n1", "n1"], {"n1": 0}, {0}, (0, 1)),
    ("a shard not placed yet counts as elsewhere", [None, "n1"], {"n1": 0}, set(), ()),
    ("no partitions", [], {"n1": 0}, set(), ()),
]  # fmt: skip


@pytest.mark.parametrize(("nodes", "draining", "wanted", "want"), cases(MOVES))
def test_partitions_to_move(nodes, draining, wanted, want):
    assert partitions_to_move(nodes, draining, wanted) == want
