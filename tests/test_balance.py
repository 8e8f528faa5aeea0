"""Slice bounds among trainers: even, or at equal estimated sampled edges when skewed."""

from __future__ import annotations

import pytest
import torch

from tidegraph.storage.events import EventBatch
from tidegraph.training.balance import SliceBalancer
from tidegraph.training.schedule import slice_bounds


def batch(src, dst) -> EventBatch:
    src, dst = torch.tensor(src), torch.tensor(dst)
    n = len(src)
    return EventBatch(src, dst, torch.arange(n, dtype=torch.float64), torch.arange(n))


def test_degrees_count_both_endpoints_and_grow_with_new_nodes() -> None:
    b = SliceBalancer([10])
    b.ingest(batch([0, 1], [1, 2]))
    b.ingest(batch([5], [1]))
    assert b.degree.tolist() == [1, 3, 1, 0, 0, 1]


def test_a_skewed_batch_is_cut_at_equal_estimated_work() -> None:
    b = SliceBalancer([4, 2], tolerance=0.1)
    b.ingest(batch(list(range(100)) * 5, [100 + i for i in range(500)]))  # nodes 0-99: degree 5
    # first half: events between busy nodes; second half: between new nodes (degree 0)
    ev = batch(
        list(range(50)) + list(range(1000, 1050)), list(range(50, 100)) + list(range(2000, 2050))
    )  # noqa: E501
    neg = torch.full((100, 1), 5000)  # unseen: degree 0
    bounds = b.bounds(ev, neg, 2)
    work = b.event_work(ev, neg)
    # busy event: 2 roots x (1 + min(5, 4) x (1 + 2)) + 1 negative = 27; new event: 3
    assert work[:50].eq(27).all() and work[50:].eq(3).all()
    assert bounds[0][0] == 0 and bounds[-1][1] == 100 and bounds[0][1] == bounds[1][0]
    shares = [int(work[lo:hi].sum()) for lo, hi in bounds]
    even = [int(work[lo:hi].sum()) for lo, hi in slice_bounds(100, 2)]
    assert max(shares) - min(shares) <= 27 < max(even) - min(even)
    assert b.rebalanced == 1


@pytest.mark.parametrize("tolerance", [None, 10.0])
def test_even_slices_when_rebalancing_is_off_or_the_skew_is_within_tolerance(tolerance) -> None:
    b = SliceBalancer([4], tolerance=tolerance)
    b.ingest(batch(list(range(10)) * 3, list(range(10, 20)) * 3))
    ev = batch(list(range(10)) + [50] * 10, list(range(10, 20)) + [60] * 10)
    assert b.bounds(ev, torch.zeros(20, 0, dtype=torch.int64), 3) == slice_bounds(20, 3)
    assert b.rebalanced == 0


def test_one_heavy_event_leaves_some_slices_empty_not_out_of_range() -> None:
    b = SliceBalancer([10], tolerance=0.0)
    b.ingest(batch([0] * 50, list(range(1, 51))))
    ev = batch([0, 99, 98], [1, 97, 96])
    bounds = b.bounds(ev, torch.zeros(3, 0, dtype=torch.int64), 4)
    assert len(bounds) == 4 and bounds[0][0] == 0 and bounds[-1][1] == 3
    assert all(lo <= hi for lo, hi in bounds)
    assert all(a[1] == b_[0] for a, b_ in zip(bounds, bounds[1:], strict=False))


def test_degrees_are_state() -> None:
    a = SliceBalancer([10])
    a.ingest(batch([0, 1, 2], [3, 3, 3]))
    b = SliceBalancer([10])
    b.load_state_dict(a.state_dict())
    a.ingest(batch([4], [3]))
    assert b.degree.tolist() == [1, 1, 1, 3]
