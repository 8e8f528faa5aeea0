"""The two-way exchange's messages: how compressed buckets travel, and how a failure does.

Apart from `QuantizedAllReduce` (reducer.py) because two drivers send the same messages: its
one-call all-reduce (stages of whole buckets, `comm.pipeline_stages`) and `OverlapRound`
(overlap.py: a stage per bucket, sent as backward finishes it). Both encode and sum through
`_Exchange` and finish in the reducer's `_complete`, so codes do not depend on when a bucket
left.

Layout: the compressed buckets are laid one after the other (`_buckets`), each cut into W
segments of whole chunks, segment r owned by rank r. A stage (`_stages`) is a run of whole
buckets sent as one message: per owner a row holding each bucket's codes, then its chunks'
(min, scale) pairs (`_frame`), and a flag byte last.

Non-finite gradients: a rank whose values cannot be encoded (inf or nan; or an owner whose sum
leaves fp32's range) sends zeros with a flag byte (the last byte of every message), so every
rank raises the same ValueError at that step, with its buffer unchanged (compressed buckets are
exchanged before exact ones), instead of its peers waiting for the collective's timeout.

Randomness: the stochastic rounding of rank r at step s draws from its own stream seeded by
(seed, r, s), not from one generator carried along: a trainer that replaces a lost rank (and
knows the step) draws what the lost one would have drawn, so compression adds no state that
recovery would have to copy from the lost process (error-feedback residuals aside).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tidegraph.comm.buckets import _starts
from tidegraph.comm.quantize import (
    _key,
    dequantize_chunks,
    quantize_chunks,
    quantize_flat,
    requantize_sum,
)

__all__: list[str] = []  # internals of reducer.py and overlap.py

log = logging.getLogger(__name__)


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


_OWNER_FLAG = 255  # an owner could not encode its sum (a range beyond fp32)


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
