"""Runs compared beyond float32 noise: models built in float64 in this process and in every
Ray actor that a `RayGroup` starts meanwhile.

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

from tidegraph.orchestrator.ray_group import RayGroup

__all__ = ["float64_everywhere"]


@contextlib.contextmanager
def float64_everywhere():
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
