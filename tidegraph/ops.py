"""Small tensor helpers shared by the hot paths.

`gather_rows(x, index)` is `x[index]` for an integer index of any shape, through
`index_select`. On the CPU, PyTorch's advanced indexing is several times slower than
`index_select`, and its backward (`index_put_` with accumulate) slower than `index_add_`
(figures in benchmarks/RESULTS.md). On CUDA both are one gather kernel, and `index_select`'s
backward is deterministic when `torch.use_deterministic_algorithms` is on.

`slot_linear(lin, x, precision)` is `lin(x)` without bias, in bfloat16 where asked and the
device multiplies bfloat16 natively (`native_bf16`): the per-neighbour-slot projections of the
attention layers are the largest matrix products of a step, and on CPUs with AVX512-BF16 a
bfloat16 product of that shape takes about half the float32 time (rows padded to a multiple of
512 so that oneDNN reuses its kernels across batches). An input without gradient
(fixed time encodings, stored edge features) goes through one autograd function that casts each
operand once into a padded buffer and computes only the weight gradient.

`bf16_cos_(x)` is the cosine those bfloat16 products need, 2e-6 from `torch.cos` and faster on
the CPU for the large arguments of time encodings (measured in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "bf16_cos_",
    "gather_rows",
    "latest_rows",
    "native_bf16",
    "resolved_slot_precision",
    "slot_linear",
    "SLOT_PRECISIONS",
]

SLOT_PRECISIONS = ("auto", "fp32", "bf16")
# bf16 products on the CPU pad their rows to a multiple of this: oneDNN creates a kernel for
# each new shape, and per-slot row counts change every batch (unpadded, varying row counts
# were slower than float32)
_CPU_ROW_BUCKET = 512
# cos(r) for r in [-pi, pi] as an even polynomial in r^2 of degree 5 (least squares on 4,001
# Chebyshev nodes, float64; evaluated in float32 its error is at most 1.2e-6)
_TWO_PI_HI = 6.2831854820251465  # 2 pi rounded to float32
_TWO_PI_LO = 2.0 * math.pi - _TWO_PI_HI
_MAX_REDUCED = 4.0  # |r| after the reduction is clamped to this (see bf16_cos_)
_COS_POLY = (
    0.999999211,
    -0.499994212,
    0.0416597767,
    -0.00138587864,
    2.42028949e-05,
    -2.19727546e-07,
)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[index]` for an int64 (or int32) index of any shape: [*index.shape, *x.shape[1:]]."""
    if index.dim() == 1:
        return x.index_select(0, index)
    flat = x.index_select(0, index.reshape(-1))
    return flat.view(*index.shape, *x.shape[1:])


def latest_rows(keys: torch.Tensor, times: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct keys, the row of each key's latest time), ties going to the later row: rows
    ranked by a stable sort on time, then a scatter-amax of the rank per key (no race between
    duplicate keys)."""
    order = torch.argsort(times, stable=True)
    rank = torch.empty_like(order).index_copy_(
        0, order, torch.arange(order.shape[0], device=order.device)
    )
    uniq, inv = torch.unique(keys, return_inverse=True)
    best = torch.full_like(uniq, -1).scatter_reduce(0, inv, rank, "amax")
    return uniq, order.index_select(0, best)


def bf16_cos_(x: torch.Tensor) -> torch.Tensor:
    """cos(x) to within bfloat16's resolution, overwriting `x` (no autograd): x reduced modulo
    2 pi by a two-constant (Cody-Waite) subtraction, then `_COS_POLY`. On the CPU this is
    faster than `torch.cos`, whose accurate (Sleef u10) path slows down for arguments beyond
    125 and again beyond 39,000, which time differences in seconds times the unit frequency
    reach. Error against `torch.cos(x)`: 2e-6 for |x| < 1e6 where the device rounds the
    reduction's multiply-add once (CPUs with FMA do; elsewhere up to ~|x| * 6e-8); finite and
    within [-1.01, 1] for any finite x (inf and NaN give NaN, as `torch.cos`). For inputs that
    only a bfloat16 product consumes (per-slot time encodings on the CPU)."""
    n = torch.mul(x, 1.0 / (2.0 * math.pi)).round_()
    r = torch.add(x, n, alpha=-_TWO_PI_HI).add_(n, alpha=-_TWO_PI_LO)
    # beyond |x| ~ 1e7 the float32 reduction leaves |r| > pi (7 at 1e8, 7e3 at 1e11) and the
    # polynomial grows as r^10 (to inf, then NaN); x itself is then coarser than a radian, so
    # any bounded value is as good: r is kept within +-4 (never reached below |x| = 1e7, so
    # smaller arguments give the same bits), and the result stays within [-1, 1]-ish
    r.clamp_(-_MAX_REDUCED, _MAX_REDUCED)
    r2 = r.mul_(r)
    acc = torch.mul(r2, _COS_POLY[-1], out=x)
    for c in reversed(_COS_POLY[1:-1]):
        acc.add_(c).mul_(r2)
    return acc.add_(_COS_POLY[0])


@functools.cache
def native_bf16(device_type: str, index: int | None = None) -> bool:
    """Whether `device` multiplies bfloat16 matrices in hardware: a CUDA device with bf16 support
    (Ampere and later), or a CPU with AVX512-BF16 or AMX-BF16 instructions (Linux: read from
    /proc/cpuinfo; other systems: False)."""
    if device_type == "cuda":
        with torch.cuda.device(index if index is not None else torch.cuda.current_device()):
            return torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type != "cpu":
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolved_slot_precision(precision: str, device: torch.device) -> str:
    """ "fp32" or "bf16": what `precision` ("auto" included) means on `device`."""
    device = torch.device(device)
    if precision == "auto":
        return "bf16" if native_bf16(device.type, device.index) else "fp32"
    return precision


def slot_linear(lin: nn.Linear, x: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """`x @ lin.weight.T` (no bias) in float32, or multiplied in bfloat16 and returned in
    x's dtype when `precision` is "bf16", or "auto" on a device with native bfloat16."""
    dev = x.device
    if resolved_slot_precision(precision, dev) != "bf16":
        return F.linear(x, lin.weight)
    flat = x.reshape(-1, x.shape[-1])
    if flat.requires_grad:  # a trained time encoding: autograd through the casts
        wb = lin.weight.to(torch.bfloat16)
        out = F.linear(_padded_bf16(flat), wb)[: flat.shape[0]].to(x.dtype)
    else:
        out = _Bf16Rows.apply(flat, lin.weight)
    return out.view(*x.shape[:-1], out.shape[-1])


def _padded_bf16(x: torch.Tensor) -> torch.Tensor:
    """x [n, d] cast to bfloat16 into a buffer whose row count is rounded up to
    `_CPU_ROW_BUCKET` on the CPU (padding rows zero), in one pass: oneDNN builds a kernel per
    shape, and row counts in buckets reuse its cache. Differentiable (the copy records x)."""
    n = x.shape[0]
    pad = (-n) % _CPU_ROW_BUCKET if x.device.type == "cpu" else 0
    buf = torch.empty((n + pad, x.shape[1]), dtype=torch.bfloat16, device=x.device)
    buf[:n].copy_(x)
    buf[n:].zero_()
    return buf


class _Bf16Rows(torch.autograd.Function):
    """`x @ w.T` multiplied in bfloat16, returned in x's dtype, for an `x` without gradient:
    the backward is the weight gradient alone, from the saved bfloat16 rows. Each operand is
    cast once into a row-padded buffer (no separate pad, slice and cast passes, forward or
    backward); the products and their roundings are those of the autograd version above."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xb = _padded_bf16(x)
        ctx.save_for_backward(xb)
        ctx.w_dtype = w.dtype
        return F.linear(xb, w.to(torch.bfloat16))[: x.shape[0]].to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (xb,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None
        return None, (_padded_bf16(grad).t() @ xb).to(ctx.w_dtype)
