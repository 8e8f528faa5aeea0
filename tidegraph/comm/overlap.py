"""`OverlapRound`: a step's compressed all-reduce begun while backward still writes the tensor.

Apart from `QuantizedAllReduce` (reducer.py) because it is a second driver of the same
exchange with state of its own: the order its messages leave in and which tensors each waits
for. It takes the plan and bits from its reducer, sends each bucket's stage of `_Exchange`
(exchange.py) as soon as the bucket is complete, and leaves owners' sums, gathers and decoding
to the reducer's `_complete` at `finish`, so its result is the one-call all-reduce's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tidegraph.comm.buckets import EXACT_BITS, CommStats, _check_flat, ring_bytes
from tidegraph.comm.exchange import _buckets, _Exchange, _Pending, _row_bytes, _Stage

if TYPE_CHECKING:
    from tidegraph.comm.reducer import QuantizedAllReduce

__all__ = ["OverlapRound"]


class OverlapRound:
    """One step's all-reduce of a flat tensor whose tensors become final one by one (see
    `QuantizedAllReduce.begin`).

    Units are the step's messages: each exact bucket (an fp32 all-reduce of a copy, written
    back at `finish` so that a compressed bucket that raises still leaves `flat` unchanged)
    and each compressed bucket (its stage of the two-way exchange: encoded and sent to its
    owners). Units leave in one fixed order, the last bucket first (backward produces the
    last tensors' gradients first), each once its tensors are ready and every unit before it
    has left: gloo matches collectives by the order they are issued, and a rank with nothing
    to compute (an empty slice) issues them all at `finish`, in that same order. Owners'
    sums, gathers and decoding run at `finish`, bucket order, as `allreduce_` does.
    """

    def __init__(self, red: QuantizedAllReduce, flat: torch.Tensor, step: int, average: bool):
        _check_flat(flat)
        self.red, self.flat, self.step, self.average = red, flat, step, average
        self.units: list[tuple[str, object]] = []  # ("exact", (lo, hi)) / ("stage", _Stage)
        self.left = 0  # units sent
        self.early = 0  # ... by `ready`, before `finish`
        self.done = False
        self.sent_at: dict[int, float] = {}  # unit -> when it left (the timeline's buckets)
        cfg, W = red.config, red.world
        ranges = red._plan(flat) if W > 1 else []
        chosen = red._compressed(ranges, step)
        bits = None
        if chosen and cfg.compression != "topk" and not cfg.error_feedback:
            bits = red._cached_bits(len(chosen), step)
        self.deferred = W == 1 or (bool(chosen) and bits is None)
        if self.deferred:
            return
        picked = set(chosen)
        self.exact = [r for i, r in enumerate(ranges) if i not in picked]
        self.bits = [EXACT_BITS] * len(ranges)
        self.ex: _Exchange | None = None
        self.copies: dict[int, tuple[torch.Tensor, _Pending]] = {}
        units: list[tuple[int, str, object]] = [(i, "exact", ranges[i]) for i in range(len(ranges))
                                                if i not in picked]  # fmt: skip
        if chosen:
            S = cfg.chunk_size
            buckets = _buckets([ranges[i] for i in chosen], bits, W, S)
            for i, bb in zip(chosen, bits, strict=True):
                self.bits[i] = bb
            at = sum(b.n for b in buckets)
            stages = [_Stage(((b, 0, _row_bytes(b.seg, S, b.bits)),),
                             _row_bytes(b.seg, S, b.bits)) for b in buckets]  # fmt: skip
            adjacent = all(a.hi == b.lo for a, b in zip(buckets[:-1], buckets[1:], strict=True))
            # a view when the compressed buckets are one run of `flat` (read before any write),
            # else each bucket is copied in as it leaves
            comp = flat[buckets[0].lo : buckets[-1].hi] if adjacent else flat.new_empty(at)
            # its own message buffers: a bucket per message, where `allreduce_` (deferred
            # steps) has its own shapes; shared names would be reallocated at every switch
            self.ex = _Exchange(red, comp, stages, average, step, tag="overlap-")
            self.comp_is_view = adjacent
            units += [(i, "stage", st) for i, st in zip(chosen, stages, strict=True)]
        units.sort(key=lambda u: -u[0])  # buckets are in flat order: the last first
        self.units = [(kind, what) for _, kind, what in units]
        # tensors whose sizes are not the buffer's (`set_sizes` not told) mean nothing here:
        # everything then leaves at `finish`
        self.sized = bool(red.sizes) and sum(red.sizes) == flat.numel()
        holders = red._bucket_tensors(red.sizes if self.sized else [flat.numel()])
        self.waiting = [len(holders[i]) for i, _, _ in units]  # tensors each unit waits for
        self.unit_of: list[list[int]] = [[] for _ in (red.sizes if self.sized else [0])]
        for u, (i, _, _) in enumerate(units):
            for t in holders[i]:
                self.unit_of[t].append(u)
        self.seen = [False] * len(self.unit_of)

    def ready(self, tensor: int) -> None:
        """Tensor `tensor` (an index into `sizes`) holds its final values; send what can go.
        A tensor said ready twice counts once."""
        if self.deferred or self.done or not self.sized or self.seen[tensor]:
            return
        self.seen[tensor] = True
        for u in self.unit_of[tensor]:
            self.waiting[u] -= 1
        while self.left < len(self.units) and self.waiting[self.left] == 0:
            self._send(self.left)
            self.early += 1

    def _send(self, u: int) -> None:
        kind, what = self.units[u]
        self.left = u + 1
        self.sent_at[u] = time.perf_counter()
        red, flat = self.red, self.flat
        if kind == "exact":
            lo, hi = what
            # in place when nothing is compressed (no exchange can fail on a value after it)
            buf = flat[lo:hi] if self.ex is None else flat[lo:hi].clone()
            work = None if red.ops is not None else dist.all_reduce(buf, group=red.group,
                                                                    async_op=True)  # fmt: skip
            if red.ops is not None:
                red.ops.all_reduce(buf)
            self.copies[lo] = (buf, _Pending(work, buf))
            return
        b = what.columns[0][0]
        if not self.comp_is_view:
            self.ex.comp[b.at : b.at + b.n].copy_(flat[b.lo : b.hi])
        self.ex.send_stage(what)

    def finish(self) -> CommStats:
        """Send what has not left, complete every message, and replace `flat` by the sum (mean
        with `average`): `allreduce_`'s result (see `QuantizedAllReduce.begin`) and stats,
        whose bytes count a flag byte per bucket's message (`allreduce_` sends one per
        stage of `pipeline_stages`)."""
        if self.done:
            raise RuntimeError("OverlapRound.finish: called twice")
        self.done = True
        red, flat, step = self.red, self.flat, self.step
        if self.deferred:
            return red.allreduce_(flat, step, self.average)
        cfg = red.config
        stats = CommStats(step, cfg.compression, 0, ring_bytes(flat.numel() * 4, red.world))
        for u in range(self.left, len(self.units)):
            self._send(u)
        if self.ex is not None:
            # the exchange's stages were sent in unit order; owners go in bucket order, and
            # `_complete` reads them in the order of `ex.stages` and `ex.sent`
            ex = self.ex
            sent_in = {id(st): k for k, st in enumerate(st for kind, st in self.units
                                                        if kind == "stage")}  # fmt: skip
            at = [sent_in[id(st)] for st in ex.stages]  # ex.stages: bucket order
            ex.sent = [ex.sent[k] for k in at]
            ex.received = [ex.received[k] for k in at]
            stats.bytes_sent += red._complete(ex, flat, step)
        done_at = {}  # unit -> when its sum was complete
        t_stages = time.perf_counter()
        for lo, hi in self.exact:  # exact buckets last: a compressed one that raised left
            buf, pending = self.copies[lo]  # `flat` as it was
            pending.wait()
            done_at[lo] = time.perf_counter()
            if self.average:
                buf.div_(red.world)
            if self.ex is not None:
                flat[lo:hi].copy_(buf)
        if self.exact:
            stats.bytes_sent += ring_bytes(sum(hi - lo for lo, hi in self.exact) * 4, red.world)
        stats.bits = tuple(self.bits)
        stats.early = self.early
        stats.buckets = tuple(self._bucket_spans(done_at, t_stages))
        return stats

    def _bucket_spans(self, done_at: dict, t_stages: float) -> list[tuple]:
        """(sent, done, bytes, bits) per unit in the order they left: an exact bucket is
        done when its all-reduce returned, a compressed one when the owners' sums were
        gathered (all at once, `_complete`; its bytes are in the step's total only)."""
        out = []
        for u, (kind, what) in enumerate(self.units):
            if kind == "exact":
                lo, hi = what
                out.append((self.sent_at[u], done_at[lo], ring_bytes((hi - lo) * 4,
                            self.red.world), EXACT_BITS))  # fmt: skip
            else:
                out.append((self.sent_at[u], t_stages, 0, what.columns[0][0].bits))
        return out
