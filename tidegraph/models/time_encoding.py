"""Functional time encoding (TGAT, Xu et al. 2020): phi(dt) = cos(dt * w + b).

Frequencies start geometrically spaced from 1 to 1e-9 (GraphMixer's fixed init) so that both
seconds and months are resolved; they stay trainable as in TGN, or stay fixed with
`trainable=False` (GraphMixer finds that as accurate, and it saves the backward through the
cosines of every neighbour slot). Inputs are time differences in
float32 (the caller subtracts float64 times first, so large absolute times lose no precision).

Time differences are clamped to +-`MAX_DT` (1e15) first. No gap of a stream in seconds,
milliseconds or microseconds reaches it (3e7, 3e4, 32 years), so normal inputs give the same
bits; past it every feature has long wrapped around (the slowest initial period is 2 pi 1e9),
so nothing is lost. The clamp
keeps any gap finite: a float64 gap beyond float32's range arrives as inf (cos(inf) is NaN),
and `w dt` and the frequencies' gradients (dt times the upstream gradient) stay finite for
trained frequencies up to ~1e23. The alternative, the phase reduced modulo 2 pi in float64,
would change normal results (and cost a float64 pass over every slot).
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.ops import bf16_cos_

__all__ = ["MAX_DT", "TimeEncoder"]

MAX_DT = 1e15  # |time differences| are clamped to this (see the module)


class TimeEncoder(nn.Module):
    """Maps time differences [...] to [..., dim] cosine features."""

    def __init__(self, dim: int, trainable: bool = True) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"TimeEncoder: dim must be >= 1, got {dim}")
        self.dim = dim
        self.weight = nn.Parameter(1.0 / 10 ** torch.linspace(0, 9, dim), requires_grad=trainable)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=trainable)

    def forward(self, dt: torch.Tensor, bf16_consumer: bool = False) -> torch.Tensor:
        """phi(dt); `bf16_consumer`: the result only feeds a bfloat16 product, so on the CPU
        and without autograd the cosine may be `bf16_cos_`'s (2e-6 from `torch.cos`, and
        faster for the large arguments of time differences)."""
        dt = dt.to(self.weight.dtype).clamp(-MAX_DT, MAX_DT)
        x = torch.addcmul(self.bias, dt.unsqueeze(-1), self.weight)
        if bf16_consumer and x.device.type == "cpu" and not x.requires_grad:
            return bf16_cos_(x)
        return torch.cos(x)
