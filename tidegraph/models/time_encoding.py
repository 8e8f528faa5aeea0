"""Functional time encoding (TGAT, Xu et al. 2020): phi(dt) = cos(dt * w + b).

Frequencies start geometrically spaced from 1 to 1e-9 (GraphMixer's fixed init) so that both
seconds and months are resolved; they stay trainable as in TGN, or stay fixed with
`trainable=False` (GraphMixer finds that as accurate, and it saves the backward through the
cosines of every neighbour slot). Inputs are time differences in
float32 (the caller subtracts float64 times first, so large absolute times lose no precision).
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.ops import bf16_cos_

__all__ = ["TimeEncoder"]


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
        x = torch.addcmul(self.bias, dt.to(self.weight.dtype).unsqueeze(-1), self.weight)
        if bf16_consumer and x.device.type == "cpu" and not x.requires_grad:
            return bf16_cos_(x)
        return torch.cos(x)
