"""Lossy codecs for what trainers send: stochastic low-bit chunks, int8 rows, top-k.

Gradients cross the network every step and feature/memory rows at every fetch; at 1-25 Gb/s
between cloud nodes fp32 traffic bounds scaling. Three codecs cut it:

* `quantize` / `dequantize`: stochastic rounding to 8, 4 or 2 bits with one offset (the
  chunk's minimum) and one scale per chunk of `chunk_size` values. Rounding up with probability
  equal to the fractional part makes the decoded value an unbiased estimate of the input
  (E[decode(encode(x))] = x), so errors average out across ranks and steps instead of adding
  up as a bias would; the per-value error is below one step (range / (2^b - 1)) and its variance
  below step^2 / 4. Codes are clamped to 2^b - 1 after rounding, so a value that floating-point
  rounding pushes past the top level can never carry into the neighbouring field of a packed
  byte. 4- and 2-bit codes are packed two or four to a byte, planar within a chunk (byte j of
  a chunk of S holds its codes j and j + S/2 at 4 bits, j, j + S/4, j + S/2, j + 3S/4 at 2
  bits), low bits first; a chunk's codes are contiguous, so a run of whole chunks can be cut
  out of the payload and sent alone (the quantized all-reduce sends each rank its own run).
  The tensor is padded to whole chunks with copies of its last value (padding never widens the
  last chunk's range) and cut back on decoding. Randomness: one key per call drawn from a
  `torch.Generator` the caller passes (the same generator state gives the same codes), hashed
  with each value's index (`kernels`: each value's uniform is exactly uniform over 2^16
  levels); the code is the same on CPU and CUDA, vectorized over chunks, and runs compiled
  by inductor or eagerly with identical results (`codec`).
* `quantize_rows` / `dequantize_rows`: symmetric int8 with one scale per row, for feature and
  memory rows fetched from remote shards (a row of zeros, like fresh TGN memory, stays exact).
* `topk_sparsify` / `topk_densify`: the k largest magnitudes and their indices.

`ErrorFeedback` carries what a lossy step dropped (input minus decoded) into the next step's
input, so the dropped part is delayed instead of lost; top-k needs it to converge, stochastic
quantization is unbiased without it but has lower variance over time with it.

Non-finite input (inf, nan) raises `ValueError`: a nan would decode as garbage for a whole chunk
and an inf would make the scale infinite, silently corrupting every replica.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tidegraph.comm.kernels import (
    decode_rows,
    encode_rows,
    pack_rows,
    shifted_key,
    sum_encode_rows,
    unpack_rows,
)

__all__ = [
    "BITS",
    "ErrorFeedback",
    "Quantized",
    "QuantizedRows",
    "dequantize",
    "dequantize_chunks",
    "dequantize_into",
    "dequantize_rows",
    "pack_bits",
    "quantize",
    "quantize_chunks",
    "quantize_flat",
    "quantize_rows",
    "requantize_sum",
    "topk_densify",
    "topk_sparsify",
    "unpack_bits",
]

log = logging.getLogger(__name__)

BITS = (2, 4, 8)
_META_BYTES = 8  # per chunk: fp32 offset and fp32 scale


@dataclass(frozen=True)
class Quantized:
    """A tensor as packed `bits`-bit codes with a (min, scale) pair per chunk."""

    payload: torch.Tensor  # uint8, n_chunks * chunk_size * bits / 8
    mins: torch.Tensor  # fp32, one per chunk
    scales: torch.Tensor  # fp32, one per chunk
    bits: int
    chunk_size: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes this takes on the wire (codes and per-chunk metadata)."""
        return self.payload.numel() + _META_BYTES * self.mins.numel()


@dataclass(frozen=True)
class QuantizedRows:
    """Rows as int8 with one fp32 scale per row (value = code * scale)."""

    values: torch.Tensor  # int8 [N, D]
    scales: torch.Tensor  # fp32 [N]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.values.numel() + 4 * self.scales.numel()


def _numel(shape: torch.Size) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 4 or chunk_size % 4:
        raise ValueError(
            f"chunk_size must be a positive multiple of 4 (whole bytes at 2 bits), got {chunk_size}"
        )


def pack_bits(codes: torch.Tensor, bits: int, row: int | None = None) -> torch.Tensor:
    """uint8 codes below 2^bits packed 8 // bits to a byte, planar per `row` codes (a chunk's;
    default all of them): byte j of a row holds its codes j, j + row / p, ... (p = 8 // bits),
    low bits first. `row` is a multiple of p."""
    _check_bits(bits)
    flat = codes.reshape(-1)
    return pack_rows(flat.reshape(-1, row or max(flat.numel(), 1)), bits).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, row: int | None = None) -> torch.Tensor:
    """The codes `pack_bits(codes, bits, row)` packed, as uint8."""
    _check_bits(bits)
    flat = packed.reshape(-1)
    width = row * bits // 8 if row else max(flat.numel(), 1)
    return unpack_rows(flat.reshape(-1, width), bits).reshape(-1)


def _uniform(shape: tuple[int, ...], like: torch.Tensor, generator) -> torch.Tensor:
    return torch.rand(shape, generator=generator, device=like.device, dtype=torch.float32)


def _key(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One call's random key (two words below 2^32), drawn from `generator`."""
    return torch.randint(0, 1 << 32, (2,), generator=generator, device=device, dtype=torch.int64)


def quantize_chunks(
    chunks: torch.Tensor,
    bits: int,
    generator: torch.Generator | None = None,
    codec: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stochastic codes of fp32 `chunks` [C, S] (S a multiple of 4), one range per row.

    Returns (packed uint8 [C, S * bits / 8], mins [C], scales [C]); raises ValueError on
    non-finite input or a range that overflows fp32. `codec`: run the kernels compiled or
    eagerly ("auto": compiled on CPU when a C++ compiler is there); the codes are the same.
    """
    _check_bits(bits)
    packed, mins, scales = encode_rows(chunks, _key(generator, chunks.device), bits, codec)
    if not bool(torch.isfinite(scales).all()):
        _raise_nonfinite(chunks, chunks.amin(dim=1), chunks.amax(dim=1))
    return packed, mins, scales


def quantize_flat(
    x: torch.Tensor,
    n_chunks: int,
    chunk_size: int,
    bits: int,
    generator: torch.Generator | None = None,
    codec: str = "auto",
    key: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_chunks` of 1-D fp32 `x` padded to `n_chunks` chunks (`_pad_to`), the same
    codes, without copying the whole chunks: only the last, padded ones are. `key`: the
    call's random key drawn beforehand (`_key`), instead of one drawn from `generator`."""
    _check_bits(bits)
    S = chunk_size
    if key is None:
        key = _key(generator, x.device)
    full = min(x.numel() // S, n_chunks)
    parts = []
    if full:
        parts.append(encode_rows(x[: full * S].view(full, S), key, bits, codec))
    if full < n_chunks or not parts:  # (no chunks at all: empty codes)
        tail = _pad_to(x[full * S :], (n_chunks - full) * S).view(-1, S)
        parts.append(encode_rows(tail, shifted_key(key, full * S), bits, codec))
    if len(parts) == 1:
        packed, mins, scales = parts[0]
    else:
        packed, mins, scales = (torch.cat(p) for p in zip(*parts, strict=True))
    if not bool(torch.isfinite(scales).all()):
        chunks = _pad_to(x, n_chunks * S).view(n_chunks, S)
        _raise_nonfinite(chunks, chunks.amin(dim=1), chunks.amax(dim=1))
    return packed, mins, scales


def requantize_sum(
    packed: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    world: int,
    average: bool,
    bits: int,
    generator: torch.Generator | None = None,
    codec: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_chunks` of the sum (mean with `average`) of `world` contributions of C
    chunks each (`packed` [world * C, bytes], contribution after contribution), decoded and
    summed in that order; the same codes as decoding, summing and quantizing apart."""
    packed, mins, scales = sum_encode_rows(packed, mins, scales, _key(generator, packed.device),
                                           world, average, bits, codec)  # fmt: skip
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(
            "quantize: a chunk's range (max - min) overflows fp32; scale the input down first"
        )
    return packed, mins, scales


def dequantize_into(
    out: torch.Tensor,
    packed: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    codec: str = "auto",
) -> None:
    """Write into 1-D fp32 `out` the first `out.numel()` values `dequantize_chunks` gives
    (whole chunks decoded in place, a last partial one through a small buffer)."""
    S = packed.shape[1] * 8 // bits
    n = out.numel()
    full = n // S
    if full:
        decode_rows(packed[:full], mins[:full], scales[:full], bits, codec,
                    out=out[: full * S].view(full, S))  # fmt: skip
    if full * S < n:
        last = decode_rows(packed[full : full + 1], mins[full : full + 1],
                           scales[full : full + 1], bits, codec)  # fmt: skip
        out[full * S :].copy_(last.reshape(-1)[: n - full * S])


def dequantize_chunks(
    packed: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, bits: int, codec: str = "auto"
) -> torch.Tensor:
    """fp32 [C, S] values of `quantize_chunks`'s output (`packed` [C, S * bits / 8])."""
    return decode_rows(packed, mins, scales, bits, codec)


def _raise_nonfinite(chunks: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor):
    bad = ~(torch.isfinite(mins) & torch.isfinite(maxs))
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"quantize: input holds inf or nan (first in chunk {first} of {chunks.shape[0]}, "
            f"{chunks.shape[1]} values per chunk); refusing to encode it"
        )
    raise ValueError(
        "quantize: a chunk's range (max - min) overflows fp32; scale the input down first"
    )


def _flat_fp32(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize: expected a floating tensor (fp32/bf16/fp16), got {x.dtype}")
    return x.reshape(-1).to(torch.float32)


def _pad_to(flat: torch.Tensor, length: int) -> torch.Tensor:
    """`flat` continued to `length` values with copies of its last value (zeros if empty)."""
    missing = length - flat.numel()
    if missing == 0:
        return flat
    fill = flat[-1:] if flat.numel() else flat.new_zeros(1)
    return torch.cat([flat, fill.expand(missing)])


def quantize(
    x: torch.Tensor,
    bits: int,
    chunk_size: int = 256,
    generator: torch.Generator | None = None,
    codec: str = "auto",
) -> Quantized:
    """Stochastic `bits`-bit codes of `x` (any shape; fp32, bf16 or fp16)."""
    _check_bits(bits)
    _check_chunk_size(chunk_size)
    flat = _flat_fp32(x)
    n_chunks = -(-flat.numel() // chunk_size)
    packed, mins, scales = quantize_flat(flat, n_chunks, chunk_size, bits, generator, codec)
    return Quantized(packed.reshape(-1), mins, scales, bits, chunk_size, x.shape, x.dtype)


def dequantize(q: Quantized, codec: str = "auto") -> torch.Tensor:
    """The decoded tensor, in `q`'s original shape and dtype."""
    packed = q.payload.reshape(q.mins.numel(), q.chunk_size * q.bits // 8)
    out = torch.empty(q.numel, dtype=torch.float32, device=q.payload.device)
    dequantize_into(out, packed, q.mins, q.scales, q.bits, codec)
    return out.reshape(q.shape).to(q.dtype)


def quantize_rows(
    rows: torch.Tensor, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> QuantizedRows:
    """int8 codes of 2-D `rows` [N, D] with scale max|row| / 127 per row.

    Round to nearest by default (lowest error for one fetch); `stochastic=True` rounds
    unbiasedly with `generator`, for values that are summed or averaged downstream.
    """
    if rows.dim() != 2:
        raise ValueError(f"quantize_rows: expected rows [N, D], got shape {tuple(rows.shape)}")
    x = rows.to(torch.float32)
    amax = x.abs().amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    if not bool(torch.isfinite(amax).all()):
        first = int((~torch.isfinite(amax)).nonzero()[0, 0])
        raise ValueError(f"quantize_rows: row {first} holds inf or nan; refusing to encode it")
    scales = amax / 127.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    v = x * inv[:, None]
    if stochastic:
        v.add_(_uniform(tuple(v.shape), v, generator)).floor_()
    else:
        v.round_()
    values = v.clamp_(-127, 127).to(torch.int8)
    return QuantizedRows(values, scales, rows.dtype)


def dequantize_rows(q: QuantizedRows) -> torch.Tensor:
    out = q.values.to(torch.float32) * q.scales[:, None]
    return out.to(q.dtype)


def topk_sparsify(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64, values) of the `k` entries of flat `x` largest in magnitude."""
    flat = x.reshape(-1)
    k = max(0, min(int(k), flat.numel()))
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("topk_sparsify: input holds inf or nan; refusing to select from it")
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    return idx, flat[idx]


def topk_densify(
    indices: torch.Tensor, values: torch.Tensor, numel: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A flat tensor of `numel` zeros with `values` at `indices` (indices unique)."""
    out = torch.zeros(numel, dtype=dtype or values.dtype, device=values.device)
    out[indices] = values.to(out.dtype)
    return out


class ErrorFeedback:
    """The residual a lossy codec left (input minus decoded), added to the next input.

    `compensate(x)` returns x + residual (a new fp32 tensor; x itself is not changed);
    after encoding it, `update(compensated, decoded)` keeps compensated - decoded. A residual
    whose size no longer matches (the flat buffer grew) is dropped with a log line: it only
    refines later steps, losing it loses nothing already applied.
    """

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None

    def compensate(self, x: torch.Tensor) -> torch.Tensor:
        out = x.reshape(-1).to(torch.float32, copy=True)
        residual = self.residual_for(out.numel(), out.device)
        if residual is not None:
            out.add_(residual)
        return out

    def residual_for(self, numel: int, device: torch.device) -> torch.Tensor | None:
        """The residual for an input of `numel` values on `device`, or None (none yet, or
        one of another size, which is dropped)."""
        if self.residual is not None and (
            self.residual.numel() != numel or self.residual.device != device
        ):
            log.info(
                "error feedback: dropping a residual of %d values for an input of %d",
                self.residual.numel(),
                numel,
            )
            self.residual = None
        return self.residual

    def update(self, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        self.residual = compensated - decoded.reshape(-1).to(torch.float32)

    def state_dict(self) -> dict:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        self.residual = state.get("residual")
