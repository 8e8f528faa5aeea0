"""The resize decision (`elastic.policy.plan_resize`), without Ray: a table of cases."""

from __future__ import annotations

import pytest

from tidegraph.elastic import ResizeDecision, plan_resize

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
