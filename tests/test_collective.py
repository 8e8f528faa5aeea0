"""The trainers' collective group: gathers of nested tensors, exact across ranks."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tidegraph.comm.collective import Collective, StoreHost


def _payload(rank: int):
    """A rank-dependent structure: different shapes, dtypes, None leaves, an empty tensor,
    odd byte lengths and a plain value."""
    g = torch.Generator().manual_seed(rank)
    return {
        "rows": [(torch.arange(3 + rank), torch.randn(3 + rank, 5, generator=g), 7 * rank)],
        "t": torch.rand(2 * rank + 1, dtype=torch.float64, generator=g),
        "mask": torch.rand(5 + rank, generator=g) > 0.5,
        "bytes": torch.arange(3 * rank + 1, dtype=torch.uint8),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(4, 6, generator=g)[:, ::2],
        "none": None if rank % 2 else (None, [torch.tensor(rank, dtype=torch.int32)]),
    }


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))  # fmt: skip
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))  # fmt: skip
    return a == b


def _gather_worker(rank: int, world: int, address, results) -> None:
    torch.set_num_threads(1)
    group = Collective(address, generation=3, rank=rank, world=world, timeout_s=30)
    try:
        got = group.all_gather_tensors(_payload(rank))
        later = group.all_gather_tensors_async(None if rank == 0 else _payload(9))
        x = torch.full((4,), float(rank + 1))
        group.allreduce_sum_(x)  # a collective issued while the gather is under way
        got_later = later.wait()
        ok = all(_same(got[r], _payload(r)) for r in range(world))
        ok = ok and got_later[0] is None and all(_same(p, _payload(9)) for p in got_later[1:])
        ok = ok and torch.equal(x, torch.full((4,), float(world * (world + 1) / 2)))
        results.put((rank, ok))
    finally:
        group.close()


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gathers_every_ranks_nested_tensors_exactly(world: int) -> None:
    host = StoreHost("127.0.0.1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_gather_worker, args=(r, world, host.address(), results))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    outcome = dict(results.get(timeout=5) for _ in range(world))
    assert all(p.exitcode == 0 for p in procs)
    assert outcome == {r: True for r in range(world)}


def test_a_group_of_one_returns_the_object_itself() -> None:
    group = Collective(("127.0.0.1", 0), generation=0, rank=0, world=1)
    obj = {"a": torch.arange(3)}
    assert group.all_gather_tensors(obj) == [obj]
