"""Comparing float results: `rel`, the relative distance of two tensors, and
`float64_everywhere`, runs compared beyond float32 noise: models built in float64 in this
process and in every Ray actor that a `RayGroup` starts meanwhile.

A run whose trainer group changes size sums each step's slices in another order than a fixed
group; in float32, Adam amplifies those last-bit differences over hundreds of steps to 1e-4 of
a weight, and by how much depends on the CPU's vector width (AVX2 or AVX-512 kernels). In
float64 the same runs agree to ~1e-15 (measured: 2 -> 1 -> 2 trainers against 2 fixed, 546
steps), while a semantic error (a slice cut at the wrong batch start, a lost step) moves a
weight by 1e-2 or more: a bound of 1e-9 tells the two apart on any CPU.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["float64_everywhere", "rel"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative distance of the finite entries; non-finite ones (empty mail slots at -inf)
    must sit at the same places with the same values (else inf)."""
    a, b = a.double(), b.double()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite], b[~finite]):
        return float("inf")
    a, b = a[finite], b[finite]
    return float((a - b).norm() / a.norm().clamp(min=1e-30)) if a.numel() else 0.0


@contextlib.contextmanager
def float64_everywhere():
    from tidegraph.orchestrator.ray_group import RayGroup

    runtime = RayGroup._runtime
    before = torch.get_default_dtype()

    def in_float64(self, rank: int) -> dict:
        return {**runtime(self, rank), "default_dtype": "float64"}

    RayGroup._runtime = in_float64
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        RayGroup._runtime = runtime
        torch.set_default_dtype(before)
