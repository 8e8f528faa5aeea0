"""The resize decision (`elastic.policy.plan_resize`), without Ray: a table of cases."""

from __future__ import annotations

import pytest

from tidegraph.elastic import ResizeDecision, plan_resize, scaled
from tidegraph.elastic.policy import plan_parts

CASES = [
    # world, target, ready slots, draining {rank: node} -> leave, join (None: no change)
    ("at target, nothing ready", 2, 2, 0, {}, None),
    ("at target, a slot ready: not needed", 2, 2, 1, {}, None),
    ("below max, a slot ready: grow", 1, 3, 1, {}, ((), 1)),
    ("below max, more ready than lacking", 1, 2, 3, {}, ((), 1)),
    ("below max, two ready", 1, 3, 2, {}, ((), 2)),
    ("above target: highest ranks leave", 4, 2, 0, {}, ((2, 3), 0)),
    ("above target, slots ready: still shrink", 3, 1, 2, {}, ((1, 2), 0)),
    ("a drained member leaves", 3, 3, 0, {1: "nodeB"}, ((1,), 0)),
    ("a drained member is replaced by a ready slot", 3, 3, 1, {1: "nodeB"}, ((1,), 1)),
    ("drain and above target", 4, 2, 0, {0: "nodeA"}, ((0, 3), 0)),
    ("drain below target: only the drained", 3, 4, 0, {2: "nodeC"}, ((2,), 0)),
    ("all drained, a slot ready", 2, 2, 1, {0: "nodeA", 1: "nodeA"}, ((0, 1), 1)),
    ("all drained, nothing ready: the lowest stays", 2, 2, 0, {0: "a", 1: "a"}, ((1,), 0)),
    ("the only member drained, nothing ready", 1, 1, 0, {0: "a"}, None),
]


@pytest.mark.parametrize(
    ("world", "target", "ready", "draining", "want"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_plan_resize(world, target, ready, draining, want):
    got = plan_resize(world, target, ready, draining)
    if want is None:
        assert got is None
        return
    assert isinstance(got, ResizeDecision)
    assert (got.leave, got.join) == want
    assert got.size(world) >= 1
    assert got.reason  # every resize says why


def test_reasons_name_the_draining_node_and_the_target():
    got = plan_resize(3, 2, 0, {0: "b1e3f0a9c4d2e6f7"})
    assert "b1e3f0a9c4d2" in got.reason and "draining" in got.reason
    got = plan_resize(3, 1, 0, {})
    assert "target 1" in got.reason


@pytest.mark.parametrize(
    ("rule", "start", "world", "want"),
    [
        ("keep_batch", 2, 1, (200, 1e-3)),
        ("keep_batch", 2, 4, (200, 1e-3)),
        ("linear", 2, 1, (100, 5e-4)),
        ("linear", 2, 4, (400, 2e-3)),
        ("sqrt", 1, 4, (800, 2e-3)),
        ("sqrt", 4, 1, (50, 5e-4)),
        ("linear", 3, 3, (200, 1e-3)),
    ],
)
def test_scale_rules(rule, start, world, want):
    batch, lr = scaled(rule, 200, 1e-3, start, world)
    assert batch == want[0] and lr == pytest.approx(want[1])


def test_an_unknown_scale_rule_names_the_field():
    with pytest.raises(ValueError, match="cluster.scale_rule"):
        scaled("cubic", 200, 1e-3, 1, 2)


def test_rebatch_makes_the_later_increments_training_passes_anew():
    """Training passes after the rebatch point use the new global batch; evaluation passes,
    earlier units and the step numbers before it are kept, and steps stay consecutive."""
    import torch

    from tidegraph.training.config import ContinualConfig
    from tidegraph.training.schedule import Schedule

    t = torch.arange(3000, dtype=torch.float64)
    cfg = ContinualConfig(num_increments=3)
    schedule = Schedule(t, cfg, 100, 1)
    at = next(i for i, u in enumerate(schedule.units) if u.kind == "increment_end") + 1
    before = list(schedule.units[:at])
    schedule.rebatch(at, 50)
    assert schedule.units[:at] == before
    later = schedule.units[at:]
    train = [u for u in later if u.kind == "train"]
    evals = [u for u in later if u.kind == "eval"]
    assert train and all(u.hi - u.lo <= 50 for u in train)
    assert any(u.hi - u.lo > 50 for u in evals)  # evaluation keeps its batches
    steps = [u.step for u in schedule.units if u.kind == "train"]
    assert steps == list(range(len(steps)))
    with pytest.raises(ValueError, match="does not follow an increment's end"):
        schedule.rebatch(at + 1, 50)


PART_CASES = [
    # hosts {host: parts}, sizes {part: events}, leaving, joining -> moves (part, from, to)
    ("balanced already", {0: [0, 1], 1: [2, 3]}, {}, set(), [], []),
    ("a host joins: takes from the one holding most", {0: [0, 1, 2], 1: [3]},
     {0: 5, 1: 9, 2: 1, 3: 4}, set(), [7], [(1, 0, 7)]),
    ("a host joins one: the largest partitions go", {0: [0, 1, 2, 3]},
     {0: 10, 1: 20, 2: 5, 3: 7}, set(), [1], [(1, 0, 1), (0, 0, 1)]),
    ("a host leaves: its partitions to the lightest", {0: [0], 1: [1], 2: [2]},
     {0: 1, 1: 2, 2: 3}, {2}, [], [(2, 2, 0)]),
    ("two leave, one joins", {0: [0, 1], 1: [2], 2: [3]}, {q: 1 for q in range(4)}, {1, 2},
     [5], [(2, 1, 5), (3, 2, 5)]),
    ("more hosts than partitions: the extra joiner gets none", {0: [0, 1]}, {0: 2, 1: 1},
     set(), [1, 2], [(0, 0, 1)]),
    ("everyone leaves: nowhere to go", {0: [0], 1: [1]}, {}, {0, 1}, [], []),
]  # fmt: skip


@pytest.mark.parametrize(
    ("hosts", "sizes", "leaving", "joining", "want"),
    [c[1:] for c in PART_CASES],
    ids=[c[0] for c in PART_CASES],
)
def test_plan_parts(hosts, sizes, leaving, joining, want):
    moves = plan_parts(hosts, sizes, leaving, joining)
    assert moves == want
    held = {h: list(v) for h, v in hosts.items() if h not in leaving}
    held.update({h: [] for h in joining})
    for q, src, dst in moves:
        assert q in hosts[src]
        if src in held:
            held[src].remove(q)
        held[dst].append(q)
    if held:  # every partition held exactly once, P // H or P // H + 1 per host
        everything = sorted(q for v in held.values() for q in v)
        assert everything == sorted(q for v in hosts.values() for q in v)
        share = len(everything) // len(held)
        assert all(share <= len(v) <= share + 1 for v in held.values())
