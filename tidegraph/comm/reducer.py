"""`QuantizedAllReduce`: one rank's compressed all-reduce of a flat fp32 buffer.

Per step it plans the buckets and their bits (buckets.py) and runs the exchanges. Buckets
below `min_bucket_bytes` and every bucket during the first `warmup_steps` go through one exact
fp32 all-reduce; the other buckets, whatever their bit widths, share one all-to-all and one
all-gather (one latency per step, not per bucket), in the messages of exchange.py. The
all-to-all is torch.distributed's `all_to_all_single`, which gloo implements in this torch
(2.13; checked by tests/test_qallreduce.py) as NCCL does, so no emulation is needed; the gather
is `all_gather_single` (`all_gather_into_tensor` in torches that lack it). In one process the
same calls go to `ops` (loopback.py).

Top-k: each rank sends the k = ratio * n largest-magnitude values of each bucket with their
indices (all-gather; sparse sums do not shrink under a reduce-scatter), and every rank adds the
W sparse vectors in rank order. Indices of one rank are distinct, so the sum is deterministic
even with atomics.

`ErrorFeedback` (optional) keeps what each rank's encoding dropped and, for the owner's
re-quantization, what the second encoding dropped, and adds it to the next step's input.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tidegraph import rng
from tidegraph.comm.buckets import (
    EXACT_BITS,
    TOPK_BITS,
    CommStats,
    _check_flat,
    _scatter_back,
    _starts,
    choose_bits,
    plan_buckets,
    ring_bytes,
)
from tidegraph.comm.config import CommConfig
from tidegraph.comm.exchange import (
    _buckets,
    _clear,
    _decode,
    _Exchange,
    _guarded,
    _Pending,
    _raise_flagged,
    _rank_flag,
    _Stage,
    _stages,
    _unframe,
)
from tidegraph.comm.overlap import OverlapRound
from tidegraph.comm.quantize import (
    ErrorFeedback,
    _pad_to,
    dequantize_into,
    topk_densify,
    topk_sparsify,
)

if TYPE_CHECKING:
    from tidegraph.comm.loopback import Loopback

__all__ = ["QuantizedAllReduce"]

log = logging.getLogger(__name__)

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class QuantizedAllReduce:
    """Compressed all-reduce of one flat fp32 buffer for rank `rank` of `world` in `group`.

    `allreduce_(flat, step, average=False)` replaces `flat` by the (approximate) sum over
    ranks, or mean with `average`, identical on every rank, and returns `CommStats`. `sizes`
    (the tensors the flat buffer holds, e.g. `FlatAdam.sizes`) align buckets to them; without
    it, or when the buffer's size changes, the buffer counts as one tensor. Randomness comes
    from the named stream "comm" of `seed`, one per rank.
    """

    def __init__(
        self,
        config: CommConfig,
        group: dist.ProcessGroup | None,
        rank: int,
        world: int,
        seed: int = 0,
        sizes: Sequence[int] | None = None,
    ) -> None:
        self.config, self.group, self.rank, self.world, self.seed = config, group, rank, world, seed
        self.sizes = None if sizes is None else [int(n) for n in sizes]
        self.ops: Loopback | None = None  # None: torch.distributed over `group`
        self._numel: int | None = None
        self._ranges: list[tuple[int, int]] = []
        self._bits: list[int] | None = None  # per bucket, adaptive
        self._decided_at: int | None = None
        self._worker_fb = ErrorFeedback()
        self._owner_fb = ErrorFeedback()
        self._buffers: dict[str, torch.Tensor] = {}
        self._holders: tuple[tuple, list[list[int]]] | None = None  # see `_bucket_tensors`

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return list(self._ranges)

    def set_sizes(self, sizes: Sequence[int] | None) -> None:
        """New tensor sizes (the optimizer's buffer grew): buckets are planned again, and
        adaptive bits decided again, at the next all-reduce; unchanged sizes change nothing."""
        sizes = None if sizes is None else [int(n) for n in sizes]
        if sizes != self.sizes:
            self.sizes, self._numel = sizes, None

    def allreduce_(self, flat: torch.Tensor, step: int, average: bool = False) -> CommStats:
        _check_flat(flat)
        cfg, world = self.config, self.world
        stats = CommStats(step, cfg.compression, 0, ring_bytes(flat.numel() * 4, world))
        if world == 1:
            stats.bits = (EXACT_BITS,) * len(self._plan(flat))
            return stats
        ranges = self._plan(flat)
        chosen = self._compressed(ranges, step)
        picked_set = set(chosen)
        exact = [r for i, r in enumerate(ranges) if i not in picked_set]
        bits = [EXACT_BITS] * len(ranges)
        if chosen:
            picked = [ranges[i] for i in chosen]
            if cfg.compression == "topk":
                stats.bytes_sent += self._topk(flat, picked, average, step)
                codes = [TOPK_BITS] * len(chosen)
            else:
                codes, decided, sent = self._bits_for(flat, picked, step)
                stats.decided = decided
                stats.bytes_sent += sent + self._quantized(flat, picked, codes, average, step)
            for i, b in zip(chosen, codes, strict=True):
                bits[i] = b
        # exact buckets last: a compressed exchange that raises leaves `flat` as it was
        stats.bytes_sent += self._exact(flat, exact, average)
        stats.bits = tuple(bits)
        return stats

    def begin(self, flat: torch.Tensor, step: int, average: bool = False) -> OverlapRound:
        """Start `allreduce_(flat, step, average)` while `flat` is still being written: the
        caller says when each tensor of `sizes` holds its final values (`OverlapRound.ready`,
        typically from a gradient hook during backward), buckets leave as soon as they are
        complete, and `OverlapRound.finish()` sends the rest and returns what `allreduce_`
        would. Compressed buckets end bit for bit as with `allreduce_` at any W (codes,
        rounding and owners' sums do not depend on when a bucket leaves); exact (fp32)
        buckets are all-reduced one by one, which is bitwise the same at W = 2 (a + b = b + a)
        but at W >= 3 lets gloo's ring add in another order than one call over all of them
        (last-bit differences, as between gloo and the in-process group). Steps that need
        the whole tensor first (a due adaptive decision, top-k, error feedback) or a group of
        one send everything at `finish`. A tensor that gets no gradient holds back every
        bucket after it in sending order until `finish`."""
        return OverlapRound(self, flat, step, average)

    # -- buckets and bit widths ------------------------------------------------------------

    def _plan(self, flat: torch.Tensor) -> list[tuple[int, int]]:
        n = flat.numel()
        if n != self._numel:
            sizes = self.sizes if self.sizes and sum(self.sizes) == n else [n]
            if self.sizes and sum(self.sizes) != n:
                log.info("comm: buffer of %d values is not the %d of `sizes`; one tensor", n,
                         sum(self.sizes))  # fmt: skip
            self._ranges = plan_buckets(sizes, self.config) if n else []
            self._numel, self._bits, self._decided_at = n, None, None
        return self._ranges

    def _generator(self, device: torch.device, step: int, role: str = "") -> torch.Generator:
        """This rank's stream for `step` and `role` (a function of (seed, rank, step) alone)."""
        name = f"comm{'-' + role if role else ''}/rank{self.rank}"
        return rng.stream(self.seed, name, step, device=str(device))

    # -- the collectives (torch.distributed, or `ops` in one process) ------------------------

    def _all_reduce(self, x: torch.Tensor) -> None:
        if self.ops is not None:
            return self.ops.all_reduce(x)
        dist.all_reduce(x, group=self.group)

    def _broadcast0(self, x: torch.Tensor) -> None:
        if self.ops is not None:
            return self.ops.broadcast0(x)
        dist.broadcast(x, src=_global_rank(self.group, 0), group=self.group)

    def _scratch(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """uint8 buffer `name` of `shape`, kept from the last call when it fits: a fresh one
        of a hundred MB costs more in page faults (each call) than its codes take to encode."""
        buf = self._buffers.get(name)
        if buf is None or tuple(buf.shape) != shape or buf.device != device:
            buf = self._buffers[name] = torch.empty(shape, dtype=torch.uint8, device=device)
        return buf

    def _start_all_to_all(self, recv: torch.Tensor, send: torch.Tensor) -> _Pending:
        """Row r of `send` to rank r, rank r's row into row r of `recv`, under way."""
        if self.ops is not None:
            self.ops.all_to_all(recv, send)
            return _Pending(None, recv)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        return _Pending(work, recv)

    def _start_gather(self, piece: torch.Tensor, scratch: str | None = None) -> _Pending:
        """[W, bytes]: every rank's uint8 `piece` in rank order, under way (gloo wants a flat
        output), into scratch buffer `scratch` if named."""
        n = self.world * piece.numel()
        if scratch is None:
            out = torch.empty(n, dtype=piece.dtype, device=piece.device)
        else:
            out = self._scratch(scratch, (n,), piece.device)
        if self.ops is not None:
            self.ops.all_gather(out, piece)
            return _Pending(None, out.reshape(self.world, -1))
        work = _all_gather(out, piece, group=self.group, async_op=True)
        return _Pending(work, out.reshape(self.world, -1))

    def _bucket_tensors(self, sizes: list[int]) -> list[list[int]]:
        """Per bucket of the current plan, the tensors of `sizes` (lengths, in flat order)
        that overlap it; worked out once per plan and sizes, not every step."""
        key = (tuple(sizes), tuple(self._ranges))
        if self._holders is None or self._holders[0] != key:
            starts = _starts(sizes)
            per_bucket = []
            for lo, hi in self._ranges:
                per_bucket.append([t for t, (a, n) in enumerate(zip(starts, sizes, strict=True))
                                   if n and a < hi and a + n > lo])  # fmt: skip
            self._holders = (key, per_bucket)
        return self._holders[1]

    def _compressed(self, ranges: list[tuple[int, int]], step: int) -> list[int]:
        """Indexes of the buckets of `ranges` compressed at `step` (none during warm-up or
        without compression; never an empty one or one below `min_bucket_bytes`)."""
        cfg = self.config
        if cfg.compression == "none" or step < cfg.warmup_steps:
            return []
        return [i for i, (lo, hi) in enumerate(ranges)
                if hi > lo and (hi - lo) * 4 >= cfg.min_bucket_bytes]  # fmt: skip

    def _cached_bits(self, n_buckets: int, step: int) -> list[int] | None:
        """The bits of `n_buckets` compressed buckets at `step` when known without looking at
        the values (fixed bits, or adaptive ones not due for a decision), else None."""
        cfg = self.config
        if cfg.fixed_bits is not None:
            return [cfg.fixed_bits] * n_buckets
        due = self._decided_at is None or step - self._decided_at >= cfg.adaptive_every
        if self._bits is not None and len(self._bits) == n_buckets and not due:
            return list(self._bits)
        return None

    def _bits_for(self, flat, ranges, step: int) -> tuple[list[int], bool, int]:
        """(bits per bucket, re-decided now, bytes the decision sent)."""
        cfg = self.config
        known = self._cached_bits(len(ranges), step)
        if known is not None:
            return known, False, 0
        S = cfg.chunk_size
        stats = torch.zeros(len(ranges) + 1, dtype=torch.float64, device=flat.device)
        for k, (lo, hi) in enumerate(ranges):  # one vectorized pass per bucket
            x = flat[lo:hi].float()
            chunks = _pad_to(x, -(-x.numel() // S) * S).reshape(-1, S)
            lo_c, hi_c = chunks.amin(dim=1), chunks.amax(dim=1)
            stats[k] = ((hi_c - lo_c).double().square() * S).sum()
            stats[-1] += x.double().square().sum()
        self._all_reduce(stats)
        numel = torch.tensor([hi - lo for lo, hi in ranges], dtype=torch.float64)
        bits = torch.tensor(
            choose_bits(stats[:-1].cpu(), numel, float(stats[-1]), cfg.adaptive_bits,
                        cfg.adaptive_lambda, S),
            dtype=torch.int64, device=flat.device,
        )  # fmt: skip
        self._broadcast0(bits)
        self._bits, self._decided_at = [int(b) for b in bits.tolist()], step
        log.info("comm: step %d bits per bucket %s", step, self._bits)
        sent = ring_bytes(stats.numel() * 8, self.world) + bits.numel() * 8
        return self._bits, True, sent

    # -- the three exchanges ---------------------------------------------------------------

    def _exact(self, flat: torch.Tensor, ranges: list[tuple[int, int]], average: bool) -> int:
        if not ranges:
            return 0
        whole = len(ranges) == len(self._ranges)
        buf = flat if whole else torch.cat([flat[lo:hi] for lo, hi in ranges])
        self._all_reduce(buf)
        if average:
            buf.div_(self.world)
        if not whole:
            _scatter_back(flat, ranges, buf)
        return ring_bytes(buf.numel() * buf.element_size(), self.world)

    def _compensated(self, flat: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The compressed buckets' values in one fp32 tensor (plus the residual, with error
        feedback); a view of `flat` when they are adjacent and need nothing added."""
        adjacent = all(a[1] == b[0] for a, b in zip(ranges[:-1], ranges[1:], strict=True))
        if adjacent and flat.dtype == torch.float32 and not self.config.error_feedback:
            return flat[ranges[0][0] : ranges[-1][1]]  # read only: encoded before any write
        x = torch.cat([flat[lo:hi] for lo, hi in ranges]).float()
        return self._worker_fb.compensate(x) if self.config.error_feedback else x

    def _quantized(self, flat, ranges, bits: list[int], average: bool, step: int) -> int:
        """Two-way quantized exchange of the compressed buckets, pipelined in stages of whole
        buckets (see `_stages`): each stage's all-to-all leaves as soon as it is encoded,
        owners sum each stage once it arrived and send it on, and gathered stages are
        decoded as they arrive. A failure in any stage must leave `flat` unchanged on every
        rank, so decoding into it starts once every rank said it encoded all its values (a
        one-value all-reduce after the last encode; `_clear`). Codes come from per-bucket draws
        of two streams (worker, owner) taken in bucket order, so the result does not depend
        on the number of stages."""
        cfg, W, S = self.config, self.world, self.config.chunk_size
        comp = self._compensated(flat, ranges)
        buckets = _buckets(ranges, bits, W, S)
        stages = _stages(buckets, S, cfg.pipeline_stages)
        ex = _Exchange(self, comp, stages, average, step)
        # encode every stage, each sent to its owners at once (the link is the slower part)
        for stage in stages:
            ex.send_stage(stage)
        return self._complete(ex, flat, step)

    def _complete(self, ex: _Exchange, flat: torch.Tensor, step: int) -> int:
        """The rest of a compressed exchange whose stages were all sent: say whether every
        rank encoded (once no rank failed, no later step can: workers refuse magnitudes whose
        sum could overflow, so gathered stages may be decoded into `flat` as they arrive, not
        after the last one), owners' sums, gathers and decoding. Collectives start in the
        same order on every rank (gloo matches them by order), whatever arrives when.
        Returns the bytes this rank sent."""
        cfg, W, S = self.config, self.world, self.config.chunk_size
        stages, comp = ex.stages, ex.comp
        gathers: list[_Pending] = []
        flags = self._start_flags(ex.worker_flag, comp.device) if len(stages) > 1 else None
        done, ready = 0, False  # stages decoded into `flat`; no stage can fail any more
        decoded_own: list[torch.Tensor] = []
        while len(gathers) < len(stages):
            gathers.append(self._owner_step(ex, stages, len(gathers)))
            ready = ready or _clear(flags, block=False)
            while ready and done < len(gathers) and gathers[done].done():
                self._decode_stage(flat, stages[done], gathers[done].wait(), step, decoded_own)
                done += 1
        if not (ready or _clear(flags, block=True)):  # a failure anywhere flags every later
            # piece of its owner, the last ones included: every rank raises alike
            _raise_flagged(torch.stack([g.wait()[:, -1] for g in gathers]), step)
        for k in range(done, len(stages)):
            self._decode_stage(flat, stages[k], gathers[k].wait(), step, decoded_own)
        if cfg.error_feedback:  # what each of the two encodings dropped
            mine = [_decode(send[:, o : o + w], b.seg, S, b.bits, cfg.codec).reshape(-1)[: b.n]
                    for stage, send in zip(stages, ex.sent, strict=True)
                    for b, o, w in stage.columns]  # fmt: skip
            self._worker_fb.update(comp, torch.cat(mine))
            self._owner_fb.update(torch.cat(ex.owned), torch.cat(decoded_own))
        return 2 * (W - 1) * sum(stage.width + 1 for stage in stages)

    def _start_flags(self, flag: int, device: torch.device) -> _Pending:
        """Every rank's worker flag (one value per rank; all zero: no rank failed), under way."""
        flags = torch.zeros(self.world, dtype=torch.float32, device=device)
        flags[self.rank] = flag
        if self.ops is not None:
            self.ops.all_reduce(flags)
            return _Pending(None, flags)
        return _Pending(dist.all_reduce(flags, group=self.group, async_op=True), flags)

    def _decode_stage(self, flat, stage: _Stage, rows: torch.Tensor, step: int, own: list):
        """Decode a gathered stage's rows into `flat` (this rank's own segments into `own`
        too, with error feedback)."""
        cfg, S = self.config, self.config.chunk_size
        _raise_flagged(rows[:, -1], step)
        for b, o, w in stage.columns:
            codes = _unframe(rows[:, o : o + w], b.seg, S, b.bits)
            dequantize_into(flat[b.lo : b.hi], *codes, b.bits, cfg.codec)
            if cfg.error_feedback:  # this rank's own segment, as everyone decoded it
                mine = rows[self.rank : self.rank + 1, o : o + w]
                own.append(_decode(mine, b.seg, S, b.bits, cfg.codec).reshape(-1))

    def _owner_step(self, ex: _Exchange, stages: list[_Stage], k: int) -> _Pending:
        ex.owner_stage(stages[k], k)
        return self._start_gather(ex.owner_piece(k), f"{ex.tag}gather{k}")

    def _topk(self, flat, ranges, average: bool, step: int) -> int:
        W, ratio = self.world, self.config.topk_ratio
        comp = self._compensated(flat, ranges)
        ks = [math.ceil(ratio * (hi - lo)) for lo, hi in ranges]
        starts = _starts([hi - lo for lo, hi in ranges])
        k = sum(ks)

        def encode() -> torch.Tensor:
            parts = [topk_sparsify(comp[a : a + hi - lo], kb)
                     for (lo, hi), a, kb in zip(ranges, starts, ks, strict=True)]  # fmt: skip
            idx = torch.cat([i + a for (i, _), a in zip(parts, starts, strict=True)])
            val = torch.cat([v for _, v in parts])
            return torch.cat([idx.to(torch.int32).view(torch.uint8), val.view(torch.uint8)])[None]

        piece, _ = _guarded(encode, (1, 8 * k), _rank_flag(self.rank), flat.device)
        gathered = self._start_gather(piece.reshape(-1)).wait()
        _raise_flagged(gathered[:, -1], step)
        body = gathered[:, :-1].contiguous()  # rows of 8k bytes: aligned for int32 / fp32 views
        total = torch.zeros_like(comp)
        for w in range(W):  # rank order; one rank's indices are distinct: deterministic
            row = body[w]
            idx = row[: 4 * k].view(torch.int32).long()
            total.index_add_(0, idx, row[4 * k : 8 * k].view(torch.float32))
            if w == self.rank and self.config.error_feedback:
                self._worker_fb.update(comp, topk_densify(idx, row[4 * k : 8 * k].view(
                    torch.float32), comp.numel()))  # fmt: skip
        if average:
            total.div_(W)
        _scatter_back(flat, ranges, total)
        return (W - 1) * piece.numel()

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "bits": self._bits,
            "decided_at": self._decided_at,
            "numel": self._numel,
            "worker_feedback": self._worker_fb.state_dict(),
            "owner_feedback": self._owner_fb.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._numel = state["numel"]
        if self._numel is not None:
            sizes = self.sizes if self.sizes and sum(self.sizes) == self._numel else [self._numel]
            self._ranges = plan_buckets(sizes, self.config) if self._numel else []
        self._bits, self._decided_at = state["bits"], state["decided_at"]
        self._worker_fb.load_state_dict(state["worker_feedback"])
        self._owner_fb.load_state_dict(state["owner_feedback"])


def _global_rank(group, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)
