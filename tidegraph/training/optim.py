"""Adam over parameters that live in one flat buffer, their gradients in another.

`FlatAdam(params, lr)` copies the parameters into one contiguous tensor and makes each of them
a view of it (`p.data`), and gives each a gradient that is a view of one flat gradient buffer
(`p.grad`); backward accumulates into those views in place, and one fused Adam step updates the
whole buffer. Against Adam over the separate tensors this saves the per-parameter Python work of
every step (grouping, state lookups, setting gradients to None; measured in
benchmarks/RESULTS.md). An all-reduce ships `flat_grad` as one tensor.

Semantics against `torch.optim.Adam(..., fused=True)` with `zero_grad(set_to_none=True)`: the
same arithmetic per value, except that a parameter that took no part in a step (a GRU with no
pending message in the first batch) gets a zero gradient instead of none, so Adam still moves it
by its momentum, as `set_to_none=False` would. Moving or replacing a parameter afterwards
(`module.to`, a learned table that grows into a new Parameter) detaches it from the buffer:
`regrow(params)` then re-homes the parameters into a larger buffer and keeps the Adam moments
of every old value (new values start with zero moments, under the group's step count), so new
nodes do not reset what the optimizer learned about the others.

`rule="lamb"` takes LAMB's step instead (You et al. 2020, for large batches): the same moments,
and each parameter tensor's Adam update scaled by its trust ratio ||w|| / ||update||, clipped
to at most `TRUST_MAX` (the paper's clipping function; 1 where either norm is zero), so that
every layer moves by about `lr` of its own norm a step whatever its gradients' scale. The
clip matters for a tensor whose gradient is zero but for rounding (attention's key bias):
unclipped, it would step `lr` of its norm along that rounding, which differs with the
summation order and so with W.

`warmup_steps` ramps the learning rate linearly over the first steps (step k of them takes
k / warmup_steps of it). Both it and LAMB read only the step count, which checkpoints keep.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["FlatAdam", "OPTIMIZER_RULES"]

OPTIMIZER_RULES = ("adam", "lamb")
TRUST_MAX = 10.0  # lamb: the largest trust ratio


class FlatAdam:
    """Fused Adam over `params` (same dtype and device), re-homed into one flat buffer.

    Not a `torch.optim.Optimizer`: its methods import torch's compiler stack (dynamo) on first
    use, which costs every trainer process a run starts about as much CPU as importing torch
    (benchmarks/RESULTS.md). The step is the fused kernel Adam's `fused=True` step calls, with
    the same arguments; `param_groups`, `state`, `state_dict` and `load_state_dict` have
    Adam's layout, so checkpoints move between the two."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        maximize: bool = False,
        rule: str = "adam",
        warmup_steps: int = 0,
    ) -> None:
        if rule not in OPTIMIZER_RULES:
            raise ValueError(f"FlatAdam: rule must be one of {OPTIMIZER_RULES}, got {rule!r}")
        if rule == "lamb" and (amsgrad or maximize):
            raise ValueError("FlatAdam: rule 'lamb' takes neither amsgrad nor maximize")
        if warmup_steps < 0:
            raise ValueError(f"FlatAdam: warmup_steps must be >= 0, got {warmup_steps}")
        self.rule, self.warmup_steps = rule, warmup_steps
        params = list(params)
        if not params:
            raise ValueError("FlatAdam: no parameters to optimize")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"FlatAdam: parameters must share one dtype and device, got {kinds}")
        dtype, device = kinds.pop()
        if not dtype.is_floating_point:
            raise ValueError(f"FlatAdam: parameters must be floating point, got {dtype}")
        self.flat = _rehome(params, dtype, device)
        self.sizes = [p.numel() for p in params]
        self.param_groups = [{
            "params": [self.flat], "lr": lr, "betas": tuple(betas), "eps": eps,
            "weight_decay": weight_decay, "amsgrad": amsgrad, "maximize": maximize,
            "foreach": None, "capturable": False, "differentiable": False, "fused": True,
            "decoupled_weight_decay": False,
        }]  # fmt: skip
        self.state: dict[torch.Tensor, dict] = {}
        self._steps = 0  # steps taken (the state's count, kept on the host for the warm-up)
        self._lengths = None  # the parameters' sizes as a tensor on the buffer's device (lamb)

    def _lr(self) -> float:
        """This step's learning rate: the group's, ramped over `warmup_steps`."""
        lr = self.param_groups[0]["lr"]
        if self._steps < self.warmup_steps:
            lr *= self._steps / self.warmup_steps
        return lr

    @torch.no_grad()
    def step(self) -> None:
        """One Adam (or LAMB) step of the whole buffer from `flat_grad` (moments made at the
        first)."""
        group, flat = self.param_groups[0], self.flat
        state = self.state.get(flat)
        if not state:
            state = self.state[flat] = {
                "step": torch.zeros((), dtype=torch.float32, device=flat.device),
                "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format),
            }
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(flat)
        state["step"].add_(1)
        self._steps += 1
        if self.rule == "lamb":
            return self._lamb(group, state)
        beta1, beta2 = group["betas"]
        torch._fused_adam_(
            [flat], [flat.grad], [state["exp_avg"]], [state["exp_avg_sq"]],
            [state["max_exp_avg_sq"]] if group["amsgrad"] else [], [state["step"]],
            amsgrad=group["amsgrad"], lr=self._lr(), beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
            grad_scale=None, found_inf=None,
        )  # fmt: skip

    def _lamb(self, group: dict, state: dict) -> None:
        """LAMB's step over the buffer: Adam's bias-corrected update (with L2 weight decay
        added to it), each parameter's scaled by its trust ratio; the per-parameter norms are
        one fused norm over views, never a Python loop over values."""
        flat, grad, t = self.flat, self.flat.grad, self._steps
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        update = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        update = torch.div(m, update).div_(1 - beta1**t)
        if group["weight_decay"]:
            update.add_(flat, alpha=group["weight_decay"])
        if self._lengths is None or self._lengths.device != flat.device:
            self._lengths = torch.tensor(self.sizes, device=flat.device)
        w_norm = torch.stack(torch._foreach_norm(list(flat.split(self.sizes))))
        u_norm = torch.stack(torch._foreach_norm(list(update.split(self.sizes))))
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0).clamp_(max=TRUST_MAX)
        scale = trust.repeat_interleave(self._lengths, output_size=flat.numel())
        flat.addcmul_(update, scale, value=-self._lr())

    def regrow(self, params: Iterable[nn.Parameter]) -> None:
        """Take `params` (the same parameters in the same order, some of them larger: rows
        appended, so each old parameter's values are a prefix of its new flattened values)
        into a new buffer; moments of old values move along, new ones start at zero."""
        params = list(params)
        sizes = [p.numel() for p in params]
        if len(sizes) != len(self.sizes) or any(
            n < m for n, m in zip(sizes, self.sizes, strict=True)
        ):
            raise ValueError(
                "FlatAdam.regrow: parameters must be the same ones, grown or equal "
                f"(had sizes {self.sizes}, got {sizes})"
            )
        old_flat = self.flat
        new_flat = _rehome(params, old_flat.dtype, old_flat.device)
        old_off = _offsets(self.sizes)
        new_off = _offsets(sizes)
        state = self.state.pop(old_flat, {})
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                grown = torch.zeros_like(new_flat, memory_format=torch.contiguous_format)
                for a, b, n in zip(old_off, new_off, self.sizes, strict=True):
                    grown[b : b + n].copy_(state[key][a : a + n])
                state[key] = grown
        self.param_groups[0]["params"] = [new_flat]
        if state:
            self.state[new_flat] = state
        self.flat, self.sizes, self._lengths = new_flat, sizes, None

    def state_dict(self) -> dict:
        """Adam's layout (the buffer is parameter 0) and the parameters' sizes."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        state = self.state.get(self.flat)
        return {"state": {0: dict(state)} if state else {},
                "param_groups": [{**group, "params": [0]}], "sizes": list(self.sizes)}  # fmt: skip

    def load_state_dict(self, state_dict: dict) -> None:
        """Hyperparameters and moments from `state_dict` (this class's or Adam's over one
        buffer of the same size), copied: nothing stays shared with it."""
        groups = state_dict.get("param_groups", [])
        if len(groups) != 1 or len(groups[0].get("params", [])) != 1:
            raise ValueError(
                "FlatAdam.load_state_dict: expected one parameter group of one buffer, got "
                f"{[len(g.get('params', [])) for g in groups]} parameters per group"
            )
        saved = state_dict.get("state", {})
        moments = saved.get(groups[0]["params"][0], {})
        total, flat = self.flat.numel(), self.flat
        for key, value in moments.items():
            if key != "step" and torch.is_tensor(value) and value.numel() != total:
                raise ValueError(
                    f"FlatAdam.load_state_dict: saved {key!r} has {value.numel()} values, this "
                    f"optimizer's parameters have {total} (a different model or layout)"
                )
        group = {k: v for k, v in groups[0].items() if k != "params"}
        group["betas"] = tuple(group.get("betas", self.param_groups[0]["betas"]))
        self.param_groups = [{**self.param_groups[0], **group, "params": [flat]}]
        self.state = {}
        self._steps = int(moments["step"]) if "step" in moments else 0
        if moments:
            self.state[flat] = {
                key: (value.to(dtype=torch.float32, device=flat.device, copy=True) if key == "step"
                      else value.to(dtype=flat.dtype, device=flat.device, copy=True))
                for key, value in moments.items()
            }  # fmt: skip

    @property
    def flat_grad(self) -> torch.Tensor:
        return self.flat.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffer (never None: the parameters' views must stay)."""
        self.flat.grad.zero_()


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def _rehome(params: list[nn.Parameter], dtype, device) -> nn.Parameter:
    """One flat parameter whose storage every `p.data` (and a flat gradient every `p.grad`)
    is a view of."""
    total = sum(p.numel() for p in params)
    flat = torch.empty(total, dtype=dtype, device=device)
    grad = torch.zeros(total, dtype=dtype, device=device)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            flat[offset : offset + n].copy_(p.reshape(-1))
            p.data = flat[offset : offset + n].view_as(p)
            p.grad = grad[offset : offset + n].view_as(p)
            offset += n
    out = nn.Parameter(flat)  # shares `flat`'s storage with the views
    out.grad = grad
    return out
