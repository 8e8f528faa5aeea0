"""Hot-path helpers: the bfloat16-resolution cosine and the bf16 slot products."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn

from tidegraph.models.time_encoding import MAX_DT, TimeEncoder
from tidegraph.ops import bf16_cos_, slot_linear


def test_bf16_cos_is_accurate_to_bfloat16_resolution():
    r = torch.linspace(-math.pi, math.pi, 100_001)
    err = (bf16_cos_(r.clone()).double() - torch.cos(r.double())).abs().max()
    assert err < 2e-6
    # bf16 steps by 2^-8; the reduction modulo 2 pi stays inside that (2e-6 where the device
    # rounds its multiply-add once, as this CPU does; up to |x| * 6e-8 where it does not)
    x = torch.linspace(-1e4, 1e4, 1_000_001)
    assert (bf16_cos_(x.clone()) - torch.cos(x)).abs().max() < 2.5e-3


def test_bf16_cos_overwrites_its_input_and_keeps_nan():
    x = torch.tensor([0.0, math.pi, 1e4, math.inf, math.nan])
    out = bf16_cos_(x)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(
        out[:3], torch.cos(torch.tensor([0.0, math.pi, 1e4])), atol=1e-3, rtol=0
    )
    assert out[3:].isnan().all()


def test_bf16_cos_is_bounded_for_any_finite_argument():
    # beyond |x| ~ 1e7 the float32 reduction leaves more than a period; the polynomial of the
    # remainder would reach inf (then NaN): the result stays a cosine's range instead
    x = torch.tensor([1e7, -3e8, 1e11, 1e15, 1e20, -1e30, 3.4e38])
    out = bf16_cos_(x.clone())
    assert bool(out.isfinite().all()) and float(out.abs().max()) <= 1.01
    small = torch.linspace(-1e6, 1e6, 200_001)  # below it the clamp changes no bit
    r = torch.add(small, torch.mul(small, 1 / (2 * math.pi)).round_(), alpha=-2 * math.pi)
    assert float(r.abs().max()) < 4.0


def test_time_encoder_is_finite_for_any_gap():
    """Time gaps in float64 beyond float32's range (inf once converted) and any finite gap
    between: finite encodings on both cosine paths, and finite gradients of the trained
    frequencies; gaps below `MAX_DT` encode as before."""
    dt = torch.tensor([0.0, 1e10, 1e12, 1e15, 1e20, 1e300, sys.float_info.max, -1e300],
                      dtype=torch.float64)  # fmt: skip
    fixed = TimeEncoder(16).requires_grad_(False)
    for out in (fixed(dt), fixed(dt, bf16_consumer=True)):
        assert bool(out.isfinite().all())
    trained = TimeEncoder(16)
    trained(dt).sum().backward()
    assert bool(trained.weight.grad.isfinite().all())
    normal = torch.rand(64, dtype=torch.float64) * 1e12
    assert MAX_DT >= 1e15
    want = torch.cos(torch.addcmul(fixed.bias, normal.float().unsqueeze(-1), fixed.weight))
    assert torch.equal(fixed(normal), want)


def test_time_encoder_takes_the_fast_cosine_only_without_autograd():
    dt = torch.rand(64) * 1e4
    fixed = TimeEncoder(16).requires_grad_(False)
    exact, fast = fixed(dt), fixed(dt, bf16_consumer=True)
    assert not torch.equal(exact, fast)
    torch.testing.assert_close(fast, exact, atol=2.5e-3, rtol=0)
    trained = TimeEncoder(16)  # trainable frequencies: the result needs a gradient
    assert torch.equal(trained(dt, bf16_consumer=True), trained(dt))


@pytest.mark.parametrize("rows", [0, 1, 777, 4380])
def test_bf16_rows_without_input_gradient_equal_the_autograd_path(rows, device):
    torch.manual_seed(rows)
    lin = nn.Linear(100, 60, bias=False).to(device)
    x = torch.randn(rows, 100, device=device)
    g = torch.randn(rows, 60, device=device)
    out = {}
    trained = x.clone().requires_grad_()  # as a trained time encoding gives
    for name, inp in (("function", x), ("autograd", trained)):
        lin.weight.grad = None
        y = slot_linear(lin, inp, "bf16")
        y.backward(g)
        out[name] = (y.detach(), lin.weight.grad.clone())
    assert out["function"][0].dtype == torch.float32
    assert torch.equal(out["function"][0], out["autograd"][0])
    assert torch.equal(out["function"][1], out["autograd"][1])
    # the input gradient reaches the trained input, in its dtype, as a bf16 product
    expected = (g.bfloat16() @ lin.weight.detach().bfloat16()).float()
    assert trained.grad.dtype == torch.float32
    torch.testing.assert_close(trained.grad, expected, atol=0.05, rtol=0.02)
