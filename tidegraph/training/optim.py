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
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["FlatAdam"]


class FlatAdam(torch.optim.Adam):
    """Fused Adam over `params` (same dtype and device), re-homed into one flat buffer."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float, **kwargs) -> None:
        params = list(params)
        if not params:
            raise ValueError("FlatAdam: no parameters to optimize")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"FlatAdam: parameters must share one dtype and device, got {kinds}")
        dtype, device = kinds.pop()
        self.flat = _rehome(params, dtype, device)
        self.sizes = [p.numel() for p in params]
        kwargs.setdefault("fused", True)
        super().__init__([self.flat], lr=lr, **kwargs)

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
        self.state[new_flat] = state
        self.flat, self.sizes = new_flat, sizes

    def load_state_dict(self, state_dict: dict) -> None:
        """Adam's, after checking that the saved moments cover this buffer (Adam itself would
        only fail at the next step, inside the fused kernel)."""
        total = self.flat.numel()
        for key, value in state_dict.get("state", {}).get(0, {}).items():
            if key != "step" and torch.is_tensor(value) and value.numel() != total:
                raise ValueError(
                    f"FlatAdam.load_state_dict: saved {key!r} has {value.numel()} values, this "
                    f"optimizer's parameters have {total} (a different model or layout)"
                )
        state_dict = {k: v for k, v in state_dict.items() if k != "sizes"}
        super().load_state_dict(state_dict)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "sizes": list(self.sizes)}

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
