"""The stochastic codec's two kernels (encode rows of fp32 to packed codes, decode them back),
written once in torch ops and run either eagerly or compiled by inductor, bit for bit alike.

Why: unfused, the codec is ~10 passes over fp32 plus a float draw per value from the
generator (the costliest part): ~0.5 GB/s against a copy's 20 GB/s on one core. Compiled, one
loop per row computes the row's range and then, row still in cache, codes it.

Random bits are a counter-based hash of the value's index in the call, not a generator
stream: u = top 16 bits of mix((index + k1) mod 2^32, k2) with (k1, k2) one 64-bit draw per
call from the caller's generator. `mix` (multiply by an odd constant, xor-shift, xor k2,
multiply) is a bijection of 32-bit words, and (index + k1) is uniform over them when k1 is, so
every value's u is exactly uniform over 2^16 levels whatever the quality of the mix; the mix
only decorrelates neighbours. Rounding up with probability frac(v) to 2^-16 (the fp32 sum
v + u rounds at that scale anyway for codes near 255) keeps the codec unbiased.

Identical on every path: the hash is int64 arithmetic on values below 2^63 (exact); the float
ops are sub, mul, add, floor, min and mul by powers of two, each rounded once in both modes;
inductor is told not to contract a * b + c into an FMA (its default; forced here), so the
decode's code * scale + min rounds twice in both. Eager runs blocks of rows so that its many
passes stay in the L2 cache; the hash depends on the global index only, so blocks change
nothing. Tests check compiled == eager bitwise.

Packing: 8 // bits codes per byte, planar within a row of S codes: byte j holds codes
j, j + S/p, ..., j + (p-1) S/p (p = 8 // bits) at bits 0, bits, ... . Planes are contiguous
slices, so packing and unpacking vectorize (adjacent fields would need strided access).
"""

from __future__ import annotations

import logging
import shutil
import threading
import types

import torch

from tidegraph.runtime import inductor_determinism

__all__ = [
    "CODECS",
    "decode_rows",
    "encode_rows",
    "pack_rows",
    "shifted_key",
    "sum_encode_rows",
    "unpack_rows",
]

log = logging.getLogger(__name__)

CODECS = ("auto", "compiled", "eager")
_M32 = 0xFFFFFFFF
_A, _B = 0x7FEB352D, 0x5BD1E995  # odd, below 2^31: a 32-bit word times one stays below 2^63
_EAGER_BLOCK = 1 << 16  # values per eager block: its ~15 passes stay in L2
_COMPILED_BLOCK = 1 << 20  # compiled: a block's second read (after the range) hits cache


def _uniform16(idx: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """fp32 of `idx`'s shape in (0, 1): (r + 1/2) / 2^16, r the hash of each value's index."""
    h = ((idx + key[0]) & _M32) * _A & _M32
    h = h ^ (h >> 15) ^ key[1]
    h = ((h * _B) & _M32) >> 16
    return h.to(torch.float32) * 2.0**-16 + 2.0**-17


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [R, S] below 2^bits packed planar per row: [R, S * bits / 8]."""
    if bits == 8:
        return codes
    per = 8 // bits
    width = codes.shape[1] // per
    out = codes[:, :width]
    for k in range(1, per):
        out = out | (codes[:, k * width : (k + 1) * width] << (k * bits))
    return out


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes [R, S] of `pack_rows`'s [R, S * bits / 8]."""
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    planes = [(packed >> (k * bits)) & mask for k in range(8 // bits)]
    # stacked then viewed, not concatenated: the same layout, and inductor vectorizes it
    return torch.stack(planes, dim=1).view(packed.shape[0], -1)


def _encode(chunks: torch.Tensor, key: torch.Tensor, bits: int):
    levels = (1 << bits) - 1
    mins, maxs = chunks.amin(dim=1), chunks.amax(dim=1)
    scales = (maxs - mins) * (1.0 / levels)
    inv = torch.where(scales > 0, 1.0 / scales, 0.0)
    # one plane at a time (see pack_rows): each plane's codes go straight into the packed
    # byte, so the compiled kernel keeps no buffer of unpacked codes
    R, S = chunks.shape
    per = 8 // bits
    width = S // per
    row = torch.arange(R, device=chunks.device, dtype=torch.int64)[:, None] * S
    col = torch.arange(width, device=chunks.device, dtype=torch.int64)[None, :]
    packed = None
    for k in range(per):
        plane = chunks[:, k * width : (k + 1) * width]
        v = (plane - mins[:, None]) * inv[:, None]  # >= 0: a nonnegative difference stays >= 0
        v = v + _uniform16(row + (col + k * width), key)
        # floor(v + u): up with probability frac(v); clamp: never spill into the next field
        codes = v.floor().clamp(max=levels).to(torch.uint8)
        packed = codes if k == 0 else packed | (codes << (k * bits))
    return packed, mins, scales


def _decoded(packed, mins, scales, bits: int) -> torch.Tensor:
    codes = unpack_rows(packed, bits).to(torch.float32)
    return codes * scales[:, None] + mins[:, None]


def _decode(packed, mins, scales, out: torch.Tensor, bits: int) -> None:
    # compiled only (it writes `out` in place); eager `decode_rows` rounds alike, per block
    out.copy_(_decoded(packed, mins, scales, bits))


def _sum_encode(packed, mins, scales, key, world: int, average: bool, bits: int):
    """`_encode` of the sum over `world` row groups of decoded rows, in group order (and
    divided by `world` with `average`): the owner's step, no fp32 buffer in between."""
    values = _decoded(packed, mins, scales, bits)
    values = values.view(world, values.shape[0] // world, values.shape[1])
    total = values[0]
    for w in range(1, world):
        total = total + values[w]
    if average:
        total = total / world
    return _encode(total, key, bits)


_KERNELS = {"encode": _encode, "decode": _decode, "sum_encode": _sum_encode}
_MIN_ROWS = 2  # dynamo specialises sizes 0 and 1: fewer rows run eagerly, never recompile


class _Compiled:
    """The kernels compiled by inductor, once per process and bit width.

    "compiled" compiles on first use, in the caller's thread. "auto" compiles in a background
    thread (compiling one kernel takes seconds to tens of seconds; a rank stalled that long
    inside a collective would hold its peers up to their timeout) and runs eagerly until the
    kernel is ready: the results are the same either way, so ranks may switch at different
    steps. A failure to compile (no compiler, an inductor error) logs once and leaves eager.
    """

    lock = threading.RLock()
    ready: dict[tuple[str, int], object] = {}
    started: set[tuple[str, int]] = set()
    failed = False
    error = ""  # why compiling failed: the first line of the error

    @classmethod
    def get(cls, name: str, bits: int):
        """The compiled kernel, compiling (and trying) it now if needed; None if that failed."""
        with cls.lock:
            fn = cls.ready.get((name, bits))
            if fn is None and not cls.failed:
                inductor_determinism()
                fn = torch.compile(_own_code(_KERNELS[name], bits), dynamic=True, options=_OPTIONS)
                try:
                    fn(*_sample(name, bits))
                except Exception as e:  # noqa: BLE001 - any compiler failure: eager is exact
                    cls.fail(e)
                    return None
                cls.ready[(name, bits)] = fn
            return fn

    @classmethod
    def get_or_start(cls, name: str, bits: int):
        """The compiled kernel if ready, else None after starting to compile it aside."""
        with cls.lock:
            fn = cls.ready.get((name, bits))
            if fn is not None or cls.failed or (name, bits) in cls.started:
                return fn
            cls.started.add((name, bits))
        threading.Thread(target=cls.get, args=(name, bits), daemon=True,
                         name=f"codec-compile-{name}{bits}").start()  # fmt: skip
        return None

    @classmethod
    def fail(cls, err: BaseException) -> None:
        with cls.lock:
            if not cls.failed:
                first = str(err).splitlines()[0] if str(err) else ""
                cls.error = f"{type(err).__name__}: {first}"
                log.warning("codec: compiling the kernels failed (%s); running them eagerly "
                            "from now on (same results, slower)", cls.error)  # fmt: skip
            cls.failed = True


# inductor's defaults, pinned: no FMA contraction (eager rounds a * b and + c apart), and
# compile in this process (no worker pool to outlive a background compile at exit)
_OPTIONS = {"cpp.enable_floating_point_contract_flag": "off", "compile_threads": 1}


def _own_code(fn, bits: int):
    """`fn` with a code object of its own: dynamo keeps at most 8 compiled variants per code
    object (then runs it eagerly), and bit widths times worlds would reach that."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{bits}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__)


def _sample(name: str, bits: int) -> tuple:
    chunks = torch.linspace(-1, 1, 4 * 64).reshape(4, 64)
    key = torch.tensor([1, 2], dtype=torch.int64)
    if name == "encode":
        return chunks, key, bits
    packed, mins, scales = _encode(chunks, key, bits)
    if name == "sum_encode":  # the world and average of the first call specialise anyway
        return packed, mins, scales, key, 2, True, bits
    return packed, mins, scales, torch.empty_like(chunks), bits


def _kernel(name: str, codec: str, bits: int, device: torch.device, rows: int):
    """The compiled kernel to run, or None for eager."""
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    if codec == "eager" or rows < _MIN_ROWS:
        return None
    if codec == "compiled":
        fn = _Compiled.get(name, bits)
        if fn is None:
            raise RuntimeError(
                f"codec 'compiled': compiling the kernels failed ({_Compiled.error})"
            )
        return fn
    # auto: inductor's C++ backend on CPU only (CUDA eager is bandwidth-bound already)
    if device.type != "cpu" or not _has_compiler():
        return None
    return _Compiled.get_or_start(name, bits)


def _has_compiler() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def _blocks(n_rows: int, cols: int, block: int, least: int):
    """Row ranges of about `block` values; none of fewer than `least` rows (the last block
    takes a short remainder)."""
    step = max(least, block // max(cols, 1))
    lo = 0
    while lo < n_rows:
        hi = n_rows if n_rows - lo < step + least else lo + step
        yield lo, hi
        lo = hi


def shifted_key(key: torch.Tensor, offset: int) -> torch.Tensor:
    """`key` for values numbered from `offset`: the hash sees index + k1 mod 2^32 alike."""
    if offset == 0:
        return key
    return torch.stack([(key[0] + offset) & _M32, key[1]])


def _run(name: str, codec: str, device, bits: int, args_for_block, n_rows: int, cols: int):
    """Kernel `name` over blocks of rows (`args_for_block(lo, hi)`, contiguous tensors),
    compiled or eager (see `_kernel`); a list of each block's results."""
    fn = _kernel(name, codec, bits, device, n_rows)
    if fn is not None:
        try:
            with _Compiled.lock:  # one caller at a time: a guard miss recompiles in place
                return [fn(*args_for_block(lo, hi), bits) for lo, hi in
                        _blocks(n_rows, cols, _COMPILED_BLOCK, _MIN_ROWS)]  # fmt: skip
        except Exception as e:  # noqa: BLE001 - any compiler failure: eager is exact
            if codec == "compiled":
                raise
            _Compiled.fail(e)
    eager = _KERNELS[name]
    return [eager(*args_for_block(lo, hi), bits) for lo, hi in
            _blocks(n_rows, cols, _EAGER_BLOCK, 1)]  # fmt: skip


def _joined(parts: list[tuple]) -> tuple:
    """Blocks' (packed, mins, scales) as one."""
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


def encode_rows(chunks: torch.Tensor, key: torch.Tensor, bits: int, codec: str = "auto"):
    """(packed uint8 [C, S * bits / 8], mins [C], scales [C]) of fp32 `chunks` [C, S]:
    stochastic `bits`-bit codes, random bits from `key` (int64 [2], each below 2^32).
    Non-finite input gives non-finite scales (the caller checks)."""
    C, S = chunks.shape
    if C == 0:
        empty = chunks.new_empty(0)
        return torch.empty(0, S * bits // 8, dtype=torch.uint8, device=chunks.device), empty, empty

    def block(lo: int, hi: int) -> tuple:
        return chunks[lo:hi].contiguous(), shifted_key(key, lo * S)

    return _joined(_run("encode", codec, chunks.device, bits, block, C, S))


def sum_encode_rows(
    packed: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    key: torch.Tensor,
    world: int,
    average: bool,
    bits: int,
    codec: str = "auto",
):
    """`encode_rows` of the sum of `world` groups of C decoded rows (`packed` [world * C,
    S * bits / 8], group after group; mins, scales [world * C]), summed in group order and
    divided by `world` with `average`: bit for bit `encode_rows(decode_rows(...) summed)`."""
    C = packed.shape[0] // world
    S = packed.shape[1] * 8 // bits
    if C == 0:
        return encode_rows(torch.empty(0, S, device=packed.device), key, bits, codec)
    p3 = packed.view(world, C, -1)
    m2, s2 = mins.view(world, C), scales.view(world, C)

    def block(lo: int, hi: int) -> tuple:
        rows = p3[:, lo:hi].reshape(world * (hi - lo), -1)
        m, s = m2[:, lo:hi].reshape(-1), s2[:, lo:hi].reshape(-1)
        return rows, m, s, shifted_key(key, lo * S), world, average

    return _joined(_run("sum_encode", codec, packed.device, bits, block, C, S))


def decode_rows(
    packed: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    codec: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [C, S] of `encode_rows`'s packed [C, S * bits / 8], mins and scales (written
    into `out`, a contiguous fp32 [C, S], if given)."""
    C = packed.shape[0]
    S = packed.shape[1] * 8 // bits
    if out is None:
        out = torch.empty(C, S, dtype=torch.float32, device=packed.device)
    fn = _kernel("decode", codec, bits, packed.device, C)
    if fn is not None:  # one call: a stream, nothing to keep in cache between passes
        try:
            with _Compiled.lock:
                fn(packed.contiguous(), mins.contiguous(), scales.contiguous(), out, bits)
            return out
        except Exception as e:  # noqa: BLE001 - any compiler failure: eager is exact
            if codec == "compiled":
                raise
            _Compiled.fail(e)
    for lo, hi in _blocks(C, S, _EAGER_BLOCK, 1):  # `_decode`'s rounding, in place per block
        block = out[lo:hi]
        block.copy_(unpack_rows(packed[lo:hi], bits))
        block.mul_(scales[lo:hi, None]).add_(mins[lo:hi, None])
    return out
