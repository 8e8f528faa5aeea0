"""Compressed all-reduce of a flat gradient: two-way stochastic quantization, or top-k.

Why two-way (BytePS-Compress, ZeRO++ qgZ) and not "quantize, all-reduce": an all-reduce sums
partial results at every hop, so each hop would need fp32 (or re-quantize with error growing
per hop). Here every rank sends each peer the quantized chunk that peer owns (all-to-all), the
owner decodes the W contributions and sums them in fp32, re-quantizes the sum once and the
owners' results are all-gathered and decoded. Each value is quantized twice, whatever W, and
each rank sends 2 (W - 1) / W of the codes, like a ring all-reduce sends of fp32.

Every rank, the owner of a piece included, decodes the same gathered bytes with the same code,
so all replicas end bitwise identical (they must, or they drift apart). The all-to-all is
torch.distributed's `all_to_all_single`, which gloo implements in this torch (2.13; checked by
tests/test_qallreduce.py) as NCCL does, so no emulation is needed; the gather is
`all_gather_single` (`all_gather_into_tensor` in torches that lack it).

Per step, the flat tensor is cut into buckets (`plan_buckets`: a fixed size, or sized by a link
cost model, MG-WFBP style: small tensors merged until a message's latency alpha is a small
fraction of its transfer time bytes * beta, and merged further while the link would still be
busy when the next gradient is ready). Buckets below `min_bucket_bytes` and every bucket during
the first `warmup_steps` go through one exact fp32 all-reduce; the other buckets, whatever
their bit widths, share one all-to-all and one all-gather (one latency per step, not per
bucket).

Adaptive bit width (AdaQP's objective): bucket k at b bits adds quantization variance
V_k(b) = sum over its values of range^2 / (2^b - 1)^2 (range of the value's chunk) and costs
bytes B_k(b). Every `adaptive_every` steps the ranks sum their V_k and |g|^2 (one small
all-reduce) and pick, per bucket, b minimising V_k(b) / |g|^2 + lambda * B_k(b) / B_fp32. The
objective is a sum of per-bucket terms, so trying each bit width per bucket solves it exactly
(no solver); rank 0's choice is broadcast so ranks can never disagree on message sizes.

Top-k: each rank sends the k = ratio * n largest-magnitude values of each bucket with their
indices (all-gather; sparse sums do not shrink under a reduce-scatter), and every rank adds the
W sparse vectors in rank order. Indices of one rank are distinct, so the sum is deterministic
even with atomics.

Non-finite gradients: a rank whose values cannot be encoded (inf or nan; or an owner whose sum
leaves fp32's range) sends zeros with a flag byte (the last byte of every message), so every
rank raises the same ValueError at that step, with its buffer unchanged (compressed buckets are
exchanged before exact ones), instead of its peers waiting for the collective's timeout.

`ErrorFeedback` (optional) keeps what each rank's encoding dropped and, for the owner's
re-quantization, what the second encoding dropped, and adds it to the next step's input.

Randomness: the stochastic rounding of rank r at step s draws from its own stream seeded by
(seed, r, s), not from one generator carried along: a trainer that replaces a lost rank (and
knows the step) draws what the lost one would have drawn, so compression adds no state that
recovery would have to copy from the lost process (error-feedback residuals aside).

In one process: `allreduce_in_process_(reducers, flats, step)` runs W reducers in W threads
over `Loopback`, an in-memory stand-in for the group's collectives (sums in rank order), so W
in-process trainers compute exactly what W processes do, codes and all.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tidegraph import rng
from tidegraph.comm.config import CommConfig
from tidegraph.comm.quantize import (
    ErrorFeedback,
    _key,
    _pad_to,
    dequantize_chunks,
    dequantize_into,
    quantize_chunks,
    quantize_flat,
    requantize_sum,
    topk_densify,
    topk_sparsify,
)

__all__ = [
    "CommStats",
    "DDPHookState",
    "Loopback",
    "OverlapRound",
    "QuantizedAllReduce",
    "allreduce_in_process_",
    "choose_bits",
    "ddp_bucket_cap_mb",
    "plan_buckets",
    "quantized_ddp_hook",
]

log = logging.getLogger(__name__)

EXACT_BITS = 32  # a bucket's entry in `CommStats.bits` when it went uncompressed
TOPK_BITS = 0  # ... when it was sparsified by top-k
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommStats:
    """What one all-reduce did: bytes this rank sent, and each bucket's bit width."""

    step: int
    compression: str  # the configured one; "none" during warm-up too, see `bits`
    bytes_sent: int  # by this rank (ring all-reduce / all-to-all + ring all-gather)
    bytes_fp32: int  # what an fp32 ring all-reduce of the same tensor sends
    bits: tuple[int, ...] = field(default_factory=tuple)  # 32 exact, 8/4/2, 0 top-k
    decided: bool = False  # adaptive bits were re-decided this step
    early: int = 0  # messages (buckets) that left before the tensor was complete (overlap)

    @property
    def ratio(self) -> float:
        return self.bytes_sent / self.bytes_fp32 if self.bytes_fp32 else 1.0


def _link_target_bytes(config: CommConfig) -> float:
    """Smallest message whose latency is at most `latency_fraction` of its whole time."""
    beta = 8.0 / (config.link_bandwidth_gbps * 1e9)  # seconds per byte
    f = config.latency_fraction
    return config.link_latency_s * (1 - f) / (f * beta)


def ddp_bucket_cap_mb(config: CommConfig) -> float:
    """DDP's `bucket_cap_mb` for `config` (fixed size, or the cost model's target)."""
    size = config.bucket_bytes if config.bucketing == "fixed" else _link_target_bytes(config)
    return size / 2**20


def plan_buckets(
    sizes: Sequence[int],
    config: CommConfig,
    ready_s: Sequence[float] | None = None,
    itemsize: int = 4,
) -> list[tuple[int, int]]:
    """Element ranges [lo, hi) of a flat buffer holding tensors of `sizes`, in order.

    "fixed": tensors in order fill a bucket up to `bucket_bytes`; a tensor larger than that is
    split into equal pieces. "cost_model": tensors taken in backward order (last first, as
    their gradients become ready, at `ready_s` seconds if known) merge until the bucket reaches
    the link's target size, and keep merging while the link would still be busy sending
    earlier buckets when the next gradient is ready (MG-WFBP's rule: waiting is free then,
    a separate message costs alpha). Tensors are never split in that mode.
    """
    if any(int(n) < 0 for n in sizes):
        raise ValueError(f"plan_buckets: sizes must be >= 0, got {list(sizes)}")
    if config.bucketing == "fixed":
        return _fixed_buckets([int(n) for n in sizes], max(1, config.bucket_bytes // itemsize))
    return _cost_model_buckets([int(n) for n in sizes], config, ready_s, itemsize)


def _fixed_buckets(sizes: list[int], cap: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    lo = at = 0
    for n in sizes:
        if at > lo and at - lo + n > cap:
            out.append((lo, at))
            lo = at
        if n > cap:
            pieces = -(-n // cap)
            cuts = [at + (n * i) // pieces for i in range(pieces + 1)]
            out.extend(zip(cuts[:-1], cuts[1:], strict=True))
            lo = at + n
        at += n
    if at > lo:
        out.append((lo, at))
    return out


def _cost_model_buckets(
    sizes: list[int], config: CommConfig, ready_s: Sequence[float] | None, itemsize: int
) -> list[tuple[int, int]]:
    if ready_s is not None and len(ready_s) != len(sizes):
        raise ValueError(f"plan_buckets: {len(ready_s)} ready times for {len(sizes)} tensors")
    target = _link_target_bytes(config)
    alpha, beta = config.link_latency_s, 8.0 / (config.link_bandwidth_gbps * 1e9)
    ends = list(_cumsum(sizes))
    cuts: list[int] = []  # flat offsets where a bucket starts, found in backward order
    link_free, cur_bytes, cur_ready = 0.0, 0, 0.0
    for i in reversed(range(len(sizes))):
        ready = 0.0 if ready_s is None else float(ready_s[i])
        if cur_bytes >= target:
            start = max(cur_ready, link_free)
            if ready_s is None or ready >= start:  # link idle by then: send the bucket now
                cuts.append(ends[i])
                link_free = start + alpha + beta * cur_bytes
                cur_bytes = 0
        cur_bytes += sizes[i] * itemsize
        cur_ready = ready
    bounds = [0, *sorted(set(cuts)), ends[-1] if ends else 0]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _cumsum(sizes: list[int]):
    at = 0
    for n in sizes:
        at += n
        yield at


def _starts(lengths: list[int]) -> list[int]:
    return [0, *_cumsum(lengths)][:-1]


def choose_bits(
    range_sq: torch.Tensor,
    numel: torch.Tensor,
    energy: float,
    candidates: Sequence[int],
    lam: float,
    chunk_size: int,
) -> list[int]:
    """Per bucket, the bit width minimising V(b) / energy + lam * bytes(b) / fp32 bytes.

    `range_sq[k]` is the sum over bucket k's values of their chunk's range squared (so
    V_k(b) = range_sq[k] / (2^b - 1)^2), `numel[k]` its values, `energy` |g|^2 over all
    compressed buckets. Exact (the objective is separable); ties go to fewer bits.
    """
    cand = torch.tensor(sorted(candidates), dtype=torch.float64)
    range_sq = range_sq.to(torch.float64).reshape(-1, 1)
    numel = numel.to(torch.float64).reshape(-1, 1)
    variance = range_sq / (2.0**cand - 1.0) ** 2
    nbytes = numel * cand / 8 + 8.0 * torch.ceil(numel / chunk_size)
    fp32_bytes = max(4.0 * float(numel.sum()), 1.0)
    cost = variance / max(float(energy), 1e-30) + lam * nbytes / fp32_bytes
    return [int(b) for b in cand[cost.argmin(dim=1)].tolist()]


@dataclass(frozen=True)
class _Bucket:
    lo: int  # in the flat tensor
    hi: int
    at: int  # offset in the concatenation of compressed buckets
    seg: int  # values per rank's segment (whole chunks)
    bits: int

    @property
    def n(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class _Stage:
    """Whole buckets sent as one message: (bucket, first column, columns) per bucket, in
    rows of `width` bytes plus a flag byte."""

    columns: tuple[tuple[_Bucket, int, int], ...]
    width: int


def _buckets(ranges: list[tuple[int, int]], bits: list[int], world: int, chunk_size: int):
    """The compressed buckets of `ranges` at `bits`, laid out one after the other in the
    compressed values (`at`), each cut into `world` segments of whole chunks."""
    out, at = [], 0
    for (lo, hi), b in zip(ranges, bits, strict=True):
        out.append(_Bucket(lo, hi, at, -(-(hi - lo) // (world * chunk_size)) * chunk_size, b))
        at += hi - lo
    return out


def _stages(buckets: list[_Bucket], chunk_size: int, most: int) -> list[_Stage]:
    """`buckets` in order, cut into at most `most` runs of about equal size."""
    total = sum(b.n for b in buckets)
    groups: list[list[_Bucket]] = [[]]
    done = 0
    for b in buckets:
        if groups[-1] and done >= total * len(groups) / most:
            groups.append([])
        groups[-1].append(b)
        done += b.n
    out = []
    for group in groups:
        widths = [_row_bytes(b.seg, chunk_size, b.bits) for b in group]
        cols = tuple(zip(group, _starts(widths), widths, strict=True))
        out.append(_Stage(cols, sum(widths)))
    return out


def _row_bytes(seg: int, chunk_size: int, bits: int) -> int:
    return seg * bits // 8 + 8 * (seg // chunk_size)


def _frame(dst: torch.Tensor, codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Write into uint8 `dst` [rows, row_bytes] the (packed, mins, scales) of whole chunks:
    each row a run of chunks' codes, then their (min, scale) pairs."""
    packed, mins, scales = codes
    rows = dst.shape[0]
    code_bytes = packed.numel() // rows
    dst[:, :code_bytes] = packed.reshape(rows, code_bytes)
    dst[:, code_bytes:] = torch.stack([mins, scales], dim=1).view(torch.uint8).reshape(rows, -1)


def _unframe(block: torch.Tensor, seg: int, chunk_size: int, bits: int):
    """(packed [chunks, bytes], mins, scales) of `_frame`'s rows of `seg` values each (a
    column slice of a received buffer)."""
    rows, cps = block.shape[0], seg // chunk_size
    code_bytes = seg * bits // 8
    # a copy at offset 0: fp32 views need an aligned start, which a column slice lacks
    meta = block[:, code_bytes:].reshape(-1).clone().view(torch.float32).reshape(rows * cps, 2)
    packed = block[:, :code_bytes].reshape(rows * cps, chunk_size * bits // 8)
    return packed, meta[:, 0], meta[:, 1]


def _decode(block: torch.Tensor, seg: int, chunk_size: int, bits: int, codec: str) -> torch.Tensor:
    """fp32 [rows, seg] of `_frame`'s rows."""
    codes = _unframe(block, seg, chunk_size, bits)
    return dequantize_chunks(*codes, bits, codec).reshape(block.shape[0], seg)


def _check_summable(codes, bits: int, world: int) -> None:
    """Raise ValueError if a value could make the owners' sum of `world` decoded values
    leave fp32's range (magnitudes up to max / (4 world) cannot)."""
    _, mins, scales = codes
    limit = torch.finfo(torch.float32).max / (4 * world)
    tops = mins + scales * ((1 << bits) - 1)
    if mins.numel() and not bool((mins.abs().amax() < limit) & (tops.abs().amax() < limit)):
        raise ValueError(f"quantize: a magnitude above {limit:.3g}, whose sum over {world} "
                         "ranks could overflow fp32; scale the input down first")  # fmt: skip


class _Pending:
    """A collective under way (`work`, None if done); `wait()` returns `result`."""

    def __init__(self, work, result: torch.Tensor) -> None:
        self.work, self.result = work, result

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.result


class _Exchange:
    """One compressed all-reduce's stages: this rank's messages as worker (its values, one
    segment per owner) and as owner (the sums of its segments), and the worst failure flag
    seen. Rounding draws from two streams of (seed, rank, step), worker and owner, in bucket
    order."""

    def __init__(
        self, red, comp: torch.Tensor, stages: list[_Stage], average: bool, step: int, tag=""
    ):
        self.red, self.comp, self.stages, self.average = red, comp, stages, average
        self.tag = tag  # names this exchange's kept message buffers (see `_scratch`)
        self.cfg, self.device = red.config, comp.device
        # one key per bucket, drawn in bucket order whatever order the stages are sent in
        worker_gen = red._generator(self.device, step)
        self.keys = {b.lo: _key(worker_gen, self.device) for s in stages for b, _, _ in s.columns}
        self.owner_gen = red._generator(self.device, step, "owner")
        self.sent: list[torch.Tensor] = []
        self.received: list[_Pending] = []
        self.pieces: list[torch.Tensor | None] = []
        self.owned: list[torch.Tensor] = []  # compensated sums, kept for error feedback
        self.worker_flag = 0  # this rank could not encode its values
        self.owner_flag = 0  # worst flag among received rows and this owner's own failure
        owned = sum(b.seg for stage in stages for b, _, _ in stage.columns)
        fb = red._owner_fb
        self.residual = fb.residual_for(owned, self.device) if self.cfg.error_feedback else None
        self.owned_at = 0

    def send_stage(self, stage: _Stage) -> None:
        """Encode this rank's values of `stage` (or zeros and its flag) and start sending."""
        W, S = self.red.world, self.cfg.chunk_size
        k = len(self.sent)
        send = self.red._scratch(f"{self.tag}send{k}", (W, stage.width + 1), self.device)
        if not self.worker_flag:
            try:
                for b, o, w in stage.columns:
                    x = self.comp[b.at : b.at + b.n]  # padded to W segments of whole chunks
                    codes = quantize_flat(x, W * b.seg // S, S, b.bits, key=self.keys[b.lo],
                                          codec=self.cfg.codec)  # fmt: skip
                    _check_summable(codes, b.bits, W)
                    _frame(send[:, o : o + w], codes)
            except ValueError as e:  # non-finite values: every rank will raise, none hangs
                log.error("comm: %s", e)
                self.worker_flag = _rank_flag(self.red.rank)
        if self.worker_flag:
            send.zero_()
        send[:, -1] = self.worker_flag
        self.sent.append(send)
        recv = self.red._scratch(f"{self.tag}recv{k}", tuple(send.shape), self.device)
        self.received.append(self.red._start_all_to_all(recv, send))

    def owner_stage(self, stage: _Stage, k: int) -> None:
        """Wait for stage `k`'s rows from every rank, sum them in rank order and encode."""
        recv = self.received[k].wait()
        self.owner_flag = max(self.owner_flag, int(recv[:, -1].max()))
        piece = None
        if not self.owner_flag:
            piece = self.red._scratch(f"{self.tag}piece{k}", (1, stage.width + 1), self.device)
            try:
                for b, o, w in stage.columns:
                    _frame(piece[:, o : o + w], self._requantized(recv[:, o : o + w], b))
            except ValueError as e:  # a sum beyond fp32's range
                log.error("comm: %s", e)
                self.owner_flag = _OWNER_FLAG
        self.pieces.append(piece)

    def _requantized(self, block: torch.Tensor, b: _Bucket):
        """The codes of bucket `b`'s owned segment: the W rows of `block` decoded, summed in
        rank order (divided by W for a mean), quantized again; in one pass over the codes
        unless error feedback needs the sum (plus the owner's residual) itself."""
        S, codec, W = self.cfg.chunk_size, self.cfg.codec, self.red.world
        codes = _unframe(block, b.seg, S, b.bits)
        if not self.cfg.error_feedback:
            return requantize_sum(*codes, W, self.average, b.bits, self.owner_gen, codec)
        values = dequantize_chunks(*codes, b.bits, codec).reshape(W, b.seg)
        total = values[0].clone()
        for row in values[1:]:  # rank order, as `requantize_sum` adds
            total += row
        if self.average:
            total = total / W
        if self.residual is not None:
            total += self.residual[self.owned_at : self.owned_at + b.seg]
        self.owned_at += b.seg
        self.owned.append(total)
        return quantize_chunks(total.reshape(-1, S), b.bits, self.owner_gen, codec)

    def owner_piece(self, k: int) -> torch.Tensor:
        """Stage `k`'s message to everyone: this owner's codes and its worst flag so far
        (zeros with the flag once a stage failed anywhere)."""
        piece = self.pieces[k]
        if self.owner_flag:
            shape = (1, self.stages[k].width + 1)
            piece = self.red._scratch(f"{self.tag}piece{k}", shape, self.device)
            piece.zero_()
        piece[:, -1] = self.owner_flag
        return piece.reshape(-1)


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
        stats = CommStats(step, cfg.compression, 0, _ring_bytes(flat.numel() * 4, world))
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
        sent = _ring_bytes(stats.numel() * 8, self.world) + bits.numel() * 8
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
        return _ring_bytes(buf.numel() * buf.element_size(), self.world)

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
        stats = CommStats(step, cfg.compression, 0, _ring_bytes(flat.numel() * 4, red.world))
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
        for lo, hi in self.exact:  # exact buckets last: a compressed one that raised left
            buf, pending = self.copies[lo]  # `flat` as it was
            pending.wait()
            if self.average:
                buf.div_(red.world)
            if self.ex is not None:
                flat[lo:hi].copy_(buf)
        if self.exact:
            stats.bytes_sent += _ring_bytes(sum(hi - lo for lo, hi in self.exact) * 4, red.world)
        stats.bits = tuple(self.bits)
        stats.early = self.early
        return stats


_OWNER_FLAG = 255  # an owner could not encode its sum (a range beyond fp32)


def _check_flat(flat: torch.Tensor) -> None:
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("QuantizedAllReduce: expected a contiguous 1-D tensor")


def _rank_flag(rank: int) -> int:
    return min(rank + 1, _OWNER_FLAG - 1)


def _guarded(encode, shape: tuple[int, int], flag: int, device, failed: bool = False):
    """(`encode()` [rows, bytes] with a last column of 0, 0) or, when it raises ValueError
    (non-finite input) or `failed`, (zeros with a column of `flag`, `flag`): every rank learns
    of the failure from the exchange instead of waiting on the rank that stopped."""
    out = None
    if not failed:
        try:
            out = encode()
        except ValueError as e:
            log.error("comm: %s", e)
    code = 0 if out is not None else flag
    if out is None:
        out = torch.zeros(shape, dtype=torch.uint8, device=device)
    column = torch.full((shape[0], 1), code, dtype=torch.uint8, device=device)
    return torch.cat([out, column], dim=1), code


def _clear(flags: _Pending | None, block: bool) -> bool:
    """Whether every rank is known to have encoded all its values (then no stage can fail:
    workers refuse magnitudes whose sum could overflow, so owners cannot), which allows
    decoding stages into the buffer before the last one arrived."""
    if flags is None or not (block or flags.done()):
        return False
    return not bool(flags.wait().any())


def _raise_flagged(flags: torch.Tensor, step: int) -> None:
    worst = int(flags.max())
    if worst == _OWNER_FLAG:
        raise ValueError(
            f"compressed all-reduce, step {step}: a sum of gradients exceeds fp32's range; "
            "the buffer is unchanged on every rank"
        )
    if worst:
        raise ValueError(
            f"compressed all-reduce, step {step}: rank {worst - 1}'s gradient holds inf or nan "
            "(or a magnitude whose sum over the ranks could overflow fp32) and cannot be "
            "encoded; the buffer is unchanged on every rank"
        )


def _scatter_back(flat: torch.Tensor, ranges: list[tuple[int, int]], buf: torch.Tensor) -> None:
    at = 0
    for lo, hi in ranges:
        flat[lo:hi].copy_(buf[at : at + hi - lo])
        at += hi - lo


def _ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `nbytes`."""
    return -(-2 * (world - 1) * nbytes // world)


def _global_rank(group, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


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


class DDPHookState:
    """State of `quantized_ddp_hook`: one `QuantizedAllReduce` per DDP bucket, a step count.

    ddp.register_comm_hook(DDPHookState(config, seed=seed), quantized_ddp_hook)
    """

    def __init__(self, config: CommConfig, group: dist.ProcessGroup | None = None, seed: int = 0):
        self.config, self.group, self.seed = config, group, seed
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.step = 0
        self.reducers: dict[int, QuantizedAllReduce] = {}
        self.last_stats: dict[int, CommStats] = {}


def quantized_ddp_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """A DDP communication hook: the bucket's mean gradient through `QuantizedAllReduce`.

    Runs synchronously inside backward and returns a completed future (DDP copies the result
    back into the parameters' gradients). Steps count the buckets marked last.
    """
    buf = bucket.buffer()
    reducer = state.reducers.get(bucket.index())
    if reducer is None:
        seed = rng.seed_for(state.seed, "comm-ddp-bucket", bucket.index())
        reducer = QuantizedAllReduce(state.config, state.group, state.rank, state.world, seed)
        state.reducers[bucket.index()] = reducer
    state.last_stats[bucket.index()] = reducer.allreduce_(buf, state.step, average=True)
    if bucket.is_last():
        state.step += 1
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them
# strings, so give it the evaluated ones
quantized_ddp_hook.__annotations__ = {
    "state": DDPHookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
