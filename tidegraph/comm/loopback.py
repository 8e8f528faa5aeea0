"""W ranks of `QuantizedAllReduce` in threads of one process, for in-process trainer groups.

`allreduce_in_process_(reducers, flats, step)` runs W reducers in W threads over `Loopback`, an
in-memory stand-in for the group's collectives (sums in rank order), so W in-process trainers
compute exactly what W processes do, codes and all. Apart from reducer.py: it replaces the
transport, not the algorithm (the reducer calls `ops` where it would call torch.distributed).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tidegraph.comm.buckets import CommStats
    from tidegraph.comm.reducer import QuantizedAllReduce

__all__ = ["Loopback", "allreduce_in_process_"]


class _Hub:
    """Where W in-process ranks meet: each posts its value, all read everyone's."""

    def __init__(self, world: int, timeout_s: float) -> None:
        self.slots: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout_s)

    def exchange(self, rank: int, value) -> list:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # everyone has read before anyone posts again
        return out


class Loopback:
    """The collectives `QuantizedAllReduce` uses, between threads of one process: sums in rank
    order (for two ranks that is what gloo computes, a + b = b + a; for more, gloo's order
    may differ in the last bit of the exact buckets, as for the uncompressed sum)."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def all_reduce(self, x: torch.Tensor) -> None:
        parts = self.hub.exchange(self.rank, x.clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        x.copy_(total)

    def broadcast0(self, x: torch.Tensor) -> None:
        x.copy_(self.hub.exchange(self.rank, x.clone())[0])

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        parts = self.hub.exchange(self.rank, send)
        recv.copy_(torch.stack([part[self.rank] for part in parts]))

    def all_gather(self, out: torch.Tensor, piece: torch.Tensor) -> None:
        out.copy_(torch.cat(self.hub.exchange(self.rank, piece)))


def allreduce_in_process_(
    reducers: Sequence[QuantizedAllReduce],
    flats: Sequence[torch.Tensor],
    step: int,
    average: bool = False,
    timeout_s: float = 600.0,
) -> list[CommStats]:
    """`reducers[r].allreduce_(flats[r], step)` for every rank r of one process at once (the
    reducers' ranks 0..W-1 in order): each in a thread, their collectives over a `Loopback`.
    Every flat ends with what W processes would hold. A rank that fails for another reason
    than the flagged ones (which every rank raises alike) breaks the others' wait at once."""
    world = len(reducers)
    if [r.rank for r in reducers] != list(range(world)) or len(flats) != world:
        raise ValueError("allreduce_in_process_: one reducer and tensor per rank, in rank order")
    hub = _Hub(world, timeout_s)

    def run(reducer: QuantizedAllReduce, flat: torch.Tensor) -> CommStats:
        reducer.ops, reducer.world = Loopback(hub, reducer.rank), world
        try:
            return reducer.allreduce_(flat, step, average=average)
        except BaseException:
            hub.barrier.abort()
            raise
        finally:
            reducer.ops = None

    with ThreadPoolExecutor(max_workers=world, thread_name_prefix="loopback") as pool:
        futures = [pool.submit(run, r, f) for r, f in zip(reducers, flats, strict=True)]
        errors = [f.exception() for f in futures]
    first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError | None)),
                 None) or next((e for e in errors if e is not None), None)  # fmt: skip
    if first is not None:
        raise first
    return [f.result() for f in futures]
