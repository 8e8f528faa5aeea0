"""Codecs of tidegraph.comm.quantize: unbiased low-bit chunks, int8 rows, top-k, error feedback."""

from __future__ import annotations

import pytest
import torch

from tidegraph.comm import kernels
from tidegraph.comm.quantize import (
    BITS,
    ErrorFeedback,
    dequantize,
    dequantize_rows,
    pack_bits,
    quantize,
    quantize_rows,
    topk_densify,
    topk_sparsify,
    unpack_bits,
)


def _gen(seed: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _steps(x: torch.Tensor, chunk: int, bits: int) -> torch.Tensor:
    """Per value, its chunk's quantization step range / (2^bits - 1)."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % chunk
    chunks = torch.cat([flat, flat[-1:].expand(pad)]).reshape(-1, chunk)
    step = (chunks.amax(1) - chunks.amin(1)) / (2**bits - 1)
    return step.repeat_interleave(chunk)[: flat.numel()]


@pytest.mark.parametrize("bits", BITS)
def test_mean_of_independent_quantizations_converges_like_one_over_sqrt_n(bits, device):
    x = torch.randn(1000, generator=_gen(1), device="cpu").to(device)
    n_max = 1024
    # each row of the batch is one independent quantization (chunks never straddle rows)
    batch = x.expand(n_max, -1).contiguous()
    decoded = dequantize(quantize(batch, bits, chunk_size=200, generator=_gen(2, device)))
    errors = {}
    for n in (16, 64, 256, 1024):
        errors[n] = (decoded[:n].mean(0) - x).pow(2).mean().sqrt().item()
    # rms error of a mean of n unbiased draws shrinks like 1/sqrt(n): x4 per x16 draws
    assert 2.5 < errors[16] / errors[256] < 6.5
    assert 1.3 < errors[256] / errors[1024] < 3.0
    # and no bias: with 1024 draws every value is within 5 sigma (sigma <= step / 2 / 32)
    step = _steps(x, 200, bits)
    assert ((decoded.mean(0) - x).abs() <= 5 * (step / 2) / 32 + 1e-6).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("chunk", [4, 64, 256])
def test_error_is_below_one_step_per_value_and_variance_below_step_squared_over_4(bits, chunk):
    x = torch.randn(10_007, generator=_gen(3)) * torch.linspace(0.01, 10, 10_007)
    decoded = dequantize(quantize(x, bits, chunk_size=chunk, generator=_gen(4)))
    step = _steps(x, chunk, bits)
    err = decoded - x
    assert (err.abs() <= step * (1 + 1e-5) + 1e-6).all()
    assert err.pow(2).mean() <= (step.pow(2) / 4).mean() * 1.1


@pytest.mark.parametrize("bits", BITS)
def test_packing_round_trips_every_code_at_every_bit_width(bits):
    codes = torch.arange(2**bits, dtype=torch.uint8).repeat(8)  # every value, in every field
    codes = codes[torch.randperm(codes.numel(), generator=_gen(5))]
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == codes.numel() * bits // 8
    assert torch.equal(unpack_bits(packed, bits), codes)
    top = torch.full((8,), 2**bits - 1, dtype=torch.uint8)
    assert torch.equal(unpack_bits(pack_bits(top, bits), bits), top)


@pytest.mark.parametrize("bits", [2, 4])
def test_rounding_never_spills_into_the_neighbouring_packed_field(bits):
    # values at and just below the top of a huge offset: (x - min) / scale lands on or a hair
    # above the top level in fp32, where rounding up would carry into the next field
    base = torch.tensor([1e6, 1e6 + 0.0625, 1e6 + 0.125, 1e6 + 0.1875]).repeat(256)
    for seed in range(20):
        q = quantize(base, bits, chunk_size=4, generator=_gen(seed))
        codes = unpack_bits(q.payload, bits)
        assert int(codes.max()) <= 2**bits - 1
        decoded = dequantize(q)
        assert (decoded >= base.reshape(-1, 4).amin(1).repeat_interleave(4) - 1e-3).all()
        assert (decoded <= base.reshape(-1, 4).amax(1).repeat_interleave(4) + 1e-3).all()
    top = torch.tensor([0.0, 1.0] * 8)  # maximum = top level exactly: code 2^b - 1, never more
    q = quantize(top, bits, chunk_size=16, generator=_gen(0))
    codes = unpack_bits(q.payload, bits)
    assert torch.equal(codes[1::2], torch.full((8,), 2**bits - 1, dtype=torch.uint8))
    assert torch.equal(dequantize(q), top)


@pytest.mark.parametrize("bits", BITS)
def test_zero_constant_empty_and_odd_length_tensors(bits, device):
    zeros = torch.zeros(3, 7, device=device)
    assert torch.equal(dequantize(quantize(zeros, bits, 8, _gen(0, device))), zeros)
    const = torch.full((13,), -2.5, device=device)
    assert torch.equal(dequantize(quantize(const, bits, 8, _gen(0, device))), const)
    for shape in [(0,), (0, 3), (4, 0)]:
        empty = torch.empty(shape, device=device)
        q = quantize(empty, bits, 8, _gen(0, device))
        assert q.nbytes == 0 and dequantize(q).shape == empty.shape
    odd = torch.randn(5, 3, generator=_gen(6)).to(device)  # 15 values, chunks of 8
    back = dequantize(quantize(odd, bits, 8, _gen(1, device)))
    assert back.shape == odd.shape and back.device == odd.device
    assert ((back - odd).abs() <= _steps(odd, 8, bits).reshape(5, 3) + 1e-6).all()
    scalar = torch.tensor(3.0, device=device)
    assert torch.equal(dequantize(quantize(scalar, bits, 8, _gen(0, device))), scalar)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_returns_the_original_shape_and_dtype(dtype):
    x = torch.randn(2, 3, 5, generator=_gen(7)).to(dtype)
    q = quantize(x, 8, chunk_size=4, generator=_gen(8))
    back = dequantize(q)
    assert back.dtype == dtype and back.shape == x.shape
    # 30 values padded to 8 chunks of 4: one byte a value, 8 bytes (min, scale) a chunk
    assert q.nbytes == 32 + 8 * 8
    assert torch.allclose(back.float(), x.float(), atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="floating"):
        quantize(torch.arange(8), 8)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_input_raises_instead_of_corrupting(bad):
    x = torch.randn(100)
    x[57] = bad
    with pytest.raises(ValueError, match="inf or nan.*chunk 1"):
        quantize(x, 4, chunk_size=32)
    with pytest.raises(ValueError, match="row 2"):
        quantize_rows(x[:100].reshape(4, 25))
    with pytest.raises(ValueError, match="inf or nan"):
        topk_sparsify(x, 5)
    huge = torch.tensor([-3e38, 3e38, 0.0, 1.0])  # finite, but max - min overflows fp32
    with pytest.raises(ValueError, match="overflows"):
        quantize(huge, 8, chunk_size=4)


def test_bad_arguments_name_what_to_fix():
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(torch.ones(8), 3)
    with pytest.raises(ValueError, match="chunk_size must be a positive multiple of 4"):
        quantize(torch.ones(8), 8, chunk_size=6)
    with pytest.raises(ValueError, match=r"rows \[N, D\]"):
        quantize_rows(torch.ones(8))


def test_same_generator_state_gives_the_same_codes(device):
    x = torch.randn(999, generator=_gen(9)).to(device)
    a = quantize(x, 4, 64, _gen(11, device))
    b = quantize(x, 4, 64, _gen(11, device))
    c = quantize(x, 4, 64, _gen(12, device))
    assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales)
    assert not torch.equal(a.payload, c.payload)


@pytest.mark.parametrize("bits", [2, 8])
def test_error_feedback_delays_what_quantization_dropped_instead_of_losing_it(bits):
    g, fb = _gen(13), ErrorFeedback()
    inputs = [torch.randn(500, generator=_gen(100 + t)) for t in range(40)]
    sent_sum, plain_sum = torch.zeros(500), torch.zeros(500)
    for x in inputs:
        comp = fb.compensate(x)
        decoded = dequantize(quantize(comp, bits, 100, g))
        fb.update(comp, decoded)
        sent_sum += decoded
        plain_sum += dequantize(quantize(x, bits, 100, g))
    total = torch.stack(inputs).sum(0)
    # what was sent over all steps equals what came in, minus the one residual still held
    assert torch.allclose(sent_sum, total - fb.residual, atol=1e-4)
    assert (fb.residual.abs() <= _steps(inputs[-1] + fb.residual, 100, bits).max() * 3).all()
    if bits == 2:  # the residual stays bounded, plain errors add up like a random walk
        assert (sent_sum - total).norm() < 0.5 * (plain_sum - total).norm()
    state = fb.state_dict()
    other = ErrorFeedback()
    other.load_state_dict(state)
    assert torch.equal(other.residual, fb.residual)
    assert other.compensate(torch.zeros(7)).shape == (7,)  # a residual of another size is dropped
    assert other.residual is None


def test_topk_keeps_the_largest_magnitudes_and_error_feedback_sends_the_rest_later():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.05, 0.0, 4.0])
    idx, val = topk_sparsify(x, 3)
    assert sorted(idx.tolist()) == [1, 3, 6]
    assert torch.equal(topk_densify(idx, val, 7), torch.tensor([0, -5.0, 0, 3.0, 0, 0, 4.0]))
    assert topk_sparsify(x, 0)[0].numel() == 0 and topk_sparsify(x, 100)[0].numel() == 7
    fb, sent = ErrorFeedback(), torch.zeros(7)
    for _ in range(40):  # the same input each step: small entries accumulate until chosen
        comp = fb.compensate(x)
        idx, val = topk_sparsify(comp, 3)
        dense = topk_densify(idx, val, 7)
        fb.update(comp, dense)
        sent += dense
    assert torch.allclose(sent + fb.residual, 40 * x, atol=1e-4)
    assert (sent[[0, 2]] != 0).all()  # even small entries went out eventually


def test_int8_rows_have_per_row_scales_and_exact_zero_rows(device):
    rows = torch.randn(50, 33, generator=_gen(14)).to(device) * torch.logspace(
        -3, 3, 50, device=device
    ).unsqueeze(1)
    rows[7] = 0.0
    q = quantize_rows(rows)
    assert q.values.dtype == torch.int8 and q.scales.shape == (50,)
    assert q.nbytes == 50 * 33 + 4 * 50
    back = dequantize_rows(q)
    assert back.shape == rows.shape and back.dtype == rows.dtype
    assert torch.equal(back[7], rows[7])
    bound = rows.abs().amax(1, keepdim=True) / 127 / 2  # nearest rounding: half a step
    assert ((back - rows).abs() <= bound * (1 + 1e-5) + 1e-12).all()
    bf = quantize_rows(rows.bfloat16())
    assert dequantize_rows(bf).dtype == torch.bfloat16
    assert dequantize_rows(quantize_rows(torch.empty(0, 4, device=device))).shape == (0, 4)
    assert dequantize_rows(quantize_rows(torch.empty(3, 0, device=device))).shape == (3, 0)


def test_stochastic_int8_rows_are_unbiased():
    row = torch.linspace(-1, 1, 64).reshape(1, 64)
    batch = row.expand(4096, -1).contiguous()
    back = dequantize_rows(quantize_rows(batch, stochastic=True, generator=_gen(15)))
    step = 1 / 127
    assert ((back.mean(0) - row[0]).abs() <= 5 * (step / 2) / 64).all()
    assert ((back - batch).abs() <= step * (1 + 1e-5)).all()


def compiled_or_skip(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, a codec "compiled" call; a skip naming the cause where
    inductor compiles nothing for the CPU on this machine (no C++ compiler or Python
    headers: a trivial function fails too); a failure of our kernels alone still fails."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        if "compiling the kernels failed" not in str(e):
            raise
        try:
            torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
        except Exception as probe:  # noqa: BLE001 - any compiler failure
            pytest.skip(f"inductor cannot compile for the CPU here: {type(probe).__name__}: "
                        f"{str(probe).splitlines()[0] if str(probe) else ''}")  # fmt: skip
        raise


@pytest.mark.parametrize("bits", BITS)
def test_compiled_and_eager_kernels_give_the_same_bits(bits, monkeypatch):
    # blocks small enough that both paths cut the rows into several calls, differently
    monkeypatch.setattr(kernels, "_EAGER_BLOCK", 1000)
    monkeypatch.setattr(kernels, "_COMPILED_BLOCK", 3000)
    key = torch.tensor([2**32 - 5, 12345], dtype=torch.int64)  # index + k1 wraps past 2^32
    for rows, cols in [(1, 64), (2, 256), (37, 64), (300, 16)]:
        x = torch.randn(rows, cols, generator=_gen(rows)) * torch.logspace(0, -4, rows * cols).view(
            rows, cols
        )
        x[0, :4] = 0.0  # a constant run, and a chunk of one value repeated
        x[-1] = 3.0
        eager = kernels.encode_rows(x, key, bits, codec="eager")
        compiled = compiled_or_skip(kernels.encode_rows, x, key, bits, codec="compiled")
        for a, b in zip(eager, compiled, strict=True):
            assert torch.equal(a, b)
        back = kernels.decode_rows(*eager, bits, codec="eager")
        assert torch.equal(back, kernels.decode_rows(*eager, bits, codec="compiled"))
        assert torch.equal(back[-1], x[-1])


def test_random_levels_are_uniform_and_neighbours_uncorrelated():
    key = torch.tensor([7, 99], dtype=torch.int64)
    u = kernels._uniform16(torch.arange(1 << 20), key)
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.bincount((u * 256).long(), minlength=256).double()
    expected = u.numel() / 256
    assert ((counts - expected).abs() <= 5 * expected**0.5).all()  # 5 sigma per bin
    c = u - 0.5
    for lag in (1, 2, 256):
        assert abs(float((c[:-lag] * c[lag:]).mean() / c.pow(2).mean())) < 0.01
    # a key shifted by d is the same stream shifted by d values (blocks rely on it)
    shifted = kernels._uniform16(torch.arange(100), kernels.shifted_key(key, 1000))
    assert torch.equal(shifted, u[1000:1100])


def test_codec_names_are_checked():
    with pytest.raises(ValueError, match="codec must be one of"):
        quantize(torch.ones(8), 8, 4, codec="fast")


@pytest.mark.parametrize("bits", BITS)
def test_quantize_flat_pads_like_quantize_chunks_without_copying_whole_chunks(bits):
    from tidegraph.comm.quantize import _pad_to, dequantize_into, quantize_chunks, quantize_flat

    x = torch.randn(1000, generator=_gen(20))  # 15 whole chunks of 64 and 40 values
    padded = _pad_to(x, 17 * 64).reshape(17, 64)  # two more chunks than needed
    flat = quantize_flat(x, 17, 64, bits, _gen(21))
    for a, b in zip(flat, quantize_chunks(padded, bits, _gen(21)), strict=True):
        assert torch.equal(a, b)
    out = torch.full((1000,), float("nan"))
    dequantize_into(out, *flat, bits)
    step = _steps(x, 64, bits)
    assert ((out - x).abs() <= step * (1 + 1e-5) + 1e-6).all()


# each case compiles the codec afresh (10-16 s on 2 cores): three ranks are in the slow suite
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("bits", BITS)
def test_requantize_sum_is_decode_sum_quantize_in_one_pass(world, bits):
    from tidegraph.comm.quantize import dequantize_chunks, quantize_chunks, requantize_sum

    for average in (False, True):
        x = torch.randn(world * 37, 64, generator=_gen(world)) * 3
        codes = quantize_chunks(x, bits, _gen(30))
        values = dequantize_chunks(*codes, bits).view(world, 37, 64)
        total = values[0].clone()
        for row in values[1:]:  # rank order
            total += row
        if average:
            total = total / world
        expected = quantize_chunks(total, bits, _gen(31), codec="eager")
        for codec in ("eager", "compiled"):
            got = compiled_or_skip(requantize_sum, *codes, world, average, bits, _gen(31), codec)
            for a, b in zip(expected, got, strict=True):
                assert torch.equal(a, b)
