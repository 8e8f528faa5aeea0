"""A pass's steps packed by position (`PackedSteps`): the same tuples back, each in its own
storage, in a few tensors whatever the number of steps."""

import pickle

import pytest
import torch

from tidegraph.storage.events import EventBatch
from tidegraph.training.packed import PackedSteps


def _events(n: int, lo: int, feat: bool = True) -> EventBatch:
    ids = torch.arange(lo, lo + n)
    return EventBatch(ids % 7, ids % 5 + 7, ids.double() * 1.5, ids,
                      torch.rand(n, 3) if feat else None, None)  # fmt: skip


def _equal(a, b) -> bool:
    if isinstance(a, EventBatch):
        return all(_equal(getattr(a, k), getattr(b, k)) for k in a.__dataclass_fields__)
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _own_storage(x) -> bool:
    return x.untyped_storage().nbytes() == x.numel() * x.element_size()


@pytest.mark.parametrize("feat", [True, False])
def test_train_steps_come_back_equal_and_in_their_own_storage(feat):
    # (events, weights or None, negatives, new events, global batch, start), as train_slices
    # gives them; one empty slice (a trainer with nothing in a pass's last batch)
    sizes = [25, 25, 0, 13]
    steps, lo = [], 0
    for i, n in enumerate(sizes):
        weight = None if i % 2 else torch.rand(n)
        steps.append((_events(n, lo, feat), weight, torch.randint(0, 9, (n, 2)), n - i, 100,
                      None if i == 1 else float(lo)))  # fmt: skip
        lo += n
    packed = pickle.loads(pickle.dumps(PackedSteps(steps)))
    back = list(packed)
    assert len(packed) == len(back) == len(steps)
    for got, want in zip(back, steps, strict=True):
        assert len(got) == len(want)
        assert all(_equal(g, w) for g, w in zip(got, want, strict=True))
        ev, _, neg = got[:3]
        assert _own_storage(ev.src) and _own_storage(ev.t) and _own_storage(neg)
    # events, negatives and the counts travel as one tensor per field, not one per step
    kinds = [c[0] for c in packed.columns]
    assert kinds == ["events", "values", "tensor", "values", "values", "values"]


def test_eval_steps_pack_and_weights_present_everywhere_become_one_tensor():
    steps = [(_events(n, 10 * n), torch.rand(n)) for n in (4, 0, 9)]
    packed = PackedSteps(steps)
    assert [c[0] for c in packed.columns] == ["events", "tensor"]
    for got, want in zip(packed, steps, strict=True):
        assert _equal(got[0], want[0]) and _equal(got[1], want[1])


def test_unlike_parts_stay_a_list_and_own_their_storage():
    base = torch.rand(20, 3)
    steps = [(_events(3, 0), base[:3]), (_events(2, 3, feat=False), base[3:5])]
    packed = PackedSteps(steps)
    assert [c[0] for c in packed.columns] == ["values", "tensor"]
    got = list(packed)
    assert _equal(got[1][0], steps[1][0]) and _own_storage(got[0][0].edge_feat)
    assert _own_storage(got[0][1])
    assert list(PackedSteps([])) == []
    with pytest.raises(ValueError, match="same number of parts"):
        PackedSteps([(1, 2), (1,)])
