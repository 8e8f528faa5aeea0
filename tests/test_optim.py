"""FlatAdam: parameters re-homed into one buffer, same arithmetic as fused Adam."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tidegraph.training.optim import FlatAdam


def _net(seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    # widths multiple of 16, so the fused kernel takes the same vector path for every value
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(device)


def _train(net: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    device = next(net.parameters()).device
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).to(device)
        opt.zero_grad(set_to_none=True)
        net(x).pow(2).mean().backward()
        opt.step()


def test_same_parameters_as_fused_adam(device):
    ref, flat = _net(device=device), _net(device=device)
    _train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True), 10)
    _train(flat, FlatAdam(flat.parameters(), lr=1e-2), 10)
    for a, b in zip(ref.parameters(), flat.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_parameters_and_gradients_are_views_of_the_buffers(device):
    net = _net(device=device)
    opt = FlatAdam(net.parameters(), lr=1e-2)
    _train(net, opt, 2)
    offset = 0
    for p in net.parameters():
        n = p.numel()
        assert p.data_ptr() == opt.flat.data_ptr() + offset * p.element_size()
        assert p.grad.data_ptr() == opt.flat_grad.data_ptr() + offset * p.element_size()
        assert torch.equal(opt.flat.detach()[offset : offset + n], p.detach().flatten())
        offset += n
    opt.zero_grad(set_to_none=True)  # zeroed in place, never detached
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    assert not opt.flat_grad.any()


def test_gradients_accumulate_into_the_buffer():
    net = _net()
    opt = FlatAdam(net.parameters(), lr=1e-2)
    x = torch.randn(4, 16)
    opt.zero_grad()
    net(x).sum().backward()
    once = opt.flat_grad.clone()
    net(x).sum().backward()
    assert torch.allclose(opt.flat_grad, 2 * once)


@pytest.mark.parametrize("rule", ["adam", "lamb"])
def test_state_round_trips_into_a_new_optimizer(rule):
    """Also inside a warm-up: the loaded step count goes on with it."""
    a, b = _net(), _net()
    opt_a = FlatAdam(a.parameters(), lr=1e-2, rule=rule, warmup_steps=8)
    _train(a, opt_a, 5)
    b.load_state_dict(a.state_dict())
    opt_b = FlatAdam(b.parameters(), lr=1e-2, rule=rule, warmup_steps=8)
    # a deep copy, as a checkpoint gives: Optimizer.load_state_dict keeps the tensors it is given
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    _train(a, opt_a, 5, seed=7)
    _train(b, opt_b, 5, seed=7)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_unused_parameter_gets_zero_gradient_and_keeps_momentum():
    net = _net()
    opt = FlatAdam(net.parameters(), lr=1e-2)
    _train(net, opt, 3)
    first = net[0].weight.detach().clone()
    opt.zero_grad()
    net[2].weight.sum().backward()  # only the last layer's weight takes part
    opt.step()
    assert not net[0].weight.grad.any()
    assert not torch.equal(net[0].weight, first)  # moved by its momentum


@pytest.mark.parametrize(
    "params, match",
    [
        ([], "no parameters"),
        ([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2).double())], "dtype"),
    ],
)
def test_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        FlatAdam(params, lr=1e-3)


def test_loading_moments_of_another_size_names_both():
    a = _net()
    opt_a = FlatAdam(a.parameters(), lr=1e-2)
    _train(a, opt_a, 1)
    other = nn.Linear(16, 8)
    opt_b = FlatAdam(other.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="exp_avg.* 1072 values.* 136"):
        opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))


def test_regrow_keeps_the_moments_of_old_values_and_trains_the_grown_table():
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(5, 3))
    bias = torch.nn.Parameter(torch.randn(3))
    opt = FlatAdam([table, bias], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        (table.sum(0) * bias).sum().backward()
        opt.step()
    before = {k: v.clone() for k, v in opt.state[opt.flat].items()}
    grown = torch.nn.Parameter(torch.cat([table.data, torch.zeros(2, 3)]))
    opt.regrow([grown, bias])
    state = opt.state[opt.flat]
    assert torch.equal(state["step"], before["step"])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[key][:15], before[key][:15])  # the old table's values
        assert torch.equal(state[key][15:21], torch.zeros(6))  # its new rows
        assert torch.equal(state[key][21:], before[key][15:])  # the bias, moved along
    flat = opt.flat.untyped_storage().data_ptr()
    assert grown.untyped_storage().data_ptr() == flat and bias.untyped_storage().data_ptr() == flat
    old = grown.detach().clone()
    opt.zero_grad()
    (grown.sum(0) * bias).sum().backward()
    opt.step()
    assert not torch.equal(grown.detach()[5:], old[5:])  # new rows train
    with pytest.raises(ValueError, match="grown or equal"):
        opt.regrow([bias])


def test_state_moves_between_flat_adam_and_torch_adam_over_the_buffer():
    """Adam's layout: a FlatAdam checkpoint continues in `torch.optim.Adam(fused=True)` over
    the same buffer bitwise, and back."""
    a, b = _net(), _net()
    opt_a = FlatAdam(a.parameters(), lr=1e-2)
    opt_b = FlatAdam(b.parameters(), lr=1e-2)
    _train(a, opt_a, 3)
    _train(b, opt_b, 3)
    torch_adam = torch.optim.Adam([opt_b.flat], lr=1e-2, fused=True)
    torch_adam.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    for opt, net in ((opt_a, a), (torch_adam, b)):  # same seeds: the same gradients
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            x = torch.randn(8, 16, generator=gen)
            if opt is opt_a:
                opt.zero_grad()
            else:
                opt_b.zero_grad()  # the views' buffer (torch's zero_grad would drop it)
            net(x).pow(2).mean().backward()
            opt.step()
    assert torch.equal(opt_a.flat, opt_b.flat)
    back = FlatAdam(_net(9).parameters(), lr=0.5)
    back.load_state_dict(copy.deepcopy(torch_adam.state_dict()))
    assert back.param_groups[0]["lr"] == 1e-2
    for key, value in torch_adam.state[opt_b.flat].items():
        assert torch.equal(back.state[back.flat][key], value), key
    with pytest.raises(ValueError, match="one parameter group of one buffer"):
        back.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})


# ---- LAMB and the warm-up ---------------------------------------------------------------------


def _lamb_reference(params, grads, state, lr, betas=(0.9, 0.999), eps=1e-8, wd=0.0):
    """LAMB written out per parameter tensor (You et al. 2020, with Adam's bias correction and
    the trust ratio clipped at 10): the test's independent reading of the rule."""
    state["t"] = state.get("t", 0) + 1
    t, (b1, b2) = state["t"], betas
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        m = state.setdefault(("m", i), torch.zeros_like(p))
        v = state.setdefault(("v", i), torch.zeros_like(p))
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).add_(g * g, alpha=1 - b2)
        u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * p
        wn, un = p.norm(), u.norm()
        trust = min(wn / un, 10.0) if wn > 0 and un > 0 else 1.0
        p.sub_(lr * trust * u)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_lamb_matches_the_rule_written_per_parameter(device, weight_decay):
    net = _net(device=device)
    ref = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():  # a zero matrix: its first trust ratio is 1 (||w|| = 0)
        net[2].weight.zero_()
        ref[2].zero_()
    opt = FlatAdam(net.parameters(), lr=1e-2, rule="lamb", weight_decay=weight_decay)
    state: dict = {}
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        x = torch.randn(8, 16, generator=gen).to(device)
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
        _lamb_reference(ref, grads, state, 1e-2, wd=weight_decay)
        for p, q in zip(net.parameters(), ref, strict=True):
            torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-7)


def test_lamb_moves_each_tensor_by_lr_of_its_norm_whatever_its_gradient_scale():
    net = _net()
    with torch.no_grad():
        net[0].weight.mul_(50.0)  # layers of very different norms
    before = [p.detach().clone() for p in net.parameters()]
    opt = FlatAdam(net.parameters(), lr=1e-2, rule="lamb")
    opt.zero_grad()
    (net(torch.randn(8, 16)).pow(2).mean() * 1e4).backward()
    opt.step()
    for p, q in zip(net.parameters(), before, strict=True):
        torch.testing.assert_close((p.detach() - q).norm(), 1e-2 * q.norm(), rtol=1e-4, atol=0)


def test_lamb_leaves_a_rounding_only_gradient_about_where_adam_does():
    """A tensor whose gradient is rounding noise moves at most 10x what Adam moves it (the
    clipped trust ratio), not `lr` of its norm."""
    bias = nn.Parameter(torch.ones(4))
    weight = nn.Parameter(torch.ones(4, 4))
    lamb = FlatAdam([weight, bias], lr=1e-2, rule="lamb")
    lamb.zero_grad()
    bias.grad.fill_(1e-20)
    weight.grad.fill_(1.0)
    lamb.step()
    assert (bias.detach() - 1).abs().max() < 1e-12


@pytest.mark.parametrize("rule", ["adam", "lamb"])
def test_warmup_ramps_the_rate_as_setting_it_each_step_would(rule):
    a, b = _net(), _net()
    warm = FlatAdam(a.parameters(), lr=1e-2, rule=rule, warmup_steps=4)
    manual = FlatAdam(b.parameters(), lr=1e-2, rule=rule)
    gen_a, gen_b = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    for k in range(1, 8):
        manual.param_groups[0]["lr"] = 1e-2 * min(k / 4, 1.0)
        for net, opt, gen in ((a, warm, gen_a), (b, manual, gen_b)):
            opt.zero_grad()
            net(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
            opt.step()
        assert torch.equal(warm.flat, manual.flat), k
    assert warm.param_groups[0]["lr"] == 1e-2  # the group keeps the base rate


def test_lamb_regrow_keeps_training_the_grown_table():
    torch.manual_seed(0)
    table, bias = nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(3))
    opt = FlatAdam([table, bias], lr=0.1, rule="lamb")
    for _ in range(2):
        opt.zero_grad()
        (table.sum(0) * bias).sum().backward()
        opt.step()
    grown = nn.Parameter(torch.cat([table.data, torch.ones(2, 3)]))
    opt.regrow([grown, bias])
    old = grown.detach().clone()
    opt.zero_grad()
    (grown.sum(0) * bias).sum().backward()
    opt.step()  # the trust ratio over the grown table's 21 values, not its old 15
    assert not torch.equal(grown.detach()[5:], old[5:])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rule": "sgd"}, "rule must be one of"),
        ({"rule": "lamb", "amsgrad": True}, "neither amsgrad"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
    ],
)
def test_bad_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlatAdam(_net().parameters(), lr=1e-3, **kwargs)
