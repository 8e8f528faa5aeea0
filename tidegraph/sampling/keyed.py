"""Counter-based uniform draws: values that are a pure function of a key and a root.

A `uniform` neighbour draw of root (v, t) is computed, not consumed from a generator: slot j
of the root gets u = H(key, v, t_hi, t_lo, j) in [0, 1), with H a chain of 64-bit mixing
functions (the finalizer of splitmix64) over int64 tensors. So a draw does not depend on which
process samples the root, in which request, beside which other roots, or in which order the
requests arrive: P shards and W trainers (local or Ray actors, in-place segment views or
remote shards, CPU or CUDA) draw what one sampler holding every edge draws for the same key.
The price is that identical (node, time, window) roots under one key share one draw, which is
what root deduplication (TGL) does anyway.

Keys: a trainer draws with `step_key(seed, step)` for training step `step` (every replica
knows the global step count, and recovery and checkpoints carry it), and `step_key(seed, -1)`
for evaluation, whose draws are then a function of (node, time) alone; `hop_key` derives one
key per hop and snapshot window. A sampler asked without a key takes a fresh one from its own
seeded generator.

Integer arithmetic wraps modulo 2^64 (two's complement) on CPU and CUDA alike; logical right
shifts are arithmetic shifts masked to the low bits.
"""

from __future__ import annotations

import torch

from tidegraph.rng import seed_for

__all__ = ["hop_key", "keyed_uniform", "mix", "step_key"]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_UNIT = 2.0**-53


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def mix(x: int) -> int:
    """splitmix64's step on one integer: the same function `_mix` applies to tensors."""
    z = (x + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return _signed(z ^ (z >> 31))


def step_key(seed: int, step: int) -> int:
    """The draw key of training step `step` of run `seed` (-1: evaluation)."""
    return mix(seed_for(seed, "sampler") ^ mix(step))


def hop_key(key: int, window: int, hop: int) -> int:
    """The key of hop `hop` of snapshot window `window` under `key`."""
    return mix(key ^ mix((window << 16) + hop))


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = z + _signed(_GOLDEN)
    z = (z ^ _srl(z, 30)) * _signed(_C1)
    z = (z ^ _srl(z, 27)) * _signed(_C2)
    return z ^ _srl(z, 31)


def _time_bits(t: torch.Tensor) -> torch.Tensor:
    return (t.to(torch.float64) + 0.0).view(torch.int64)  # -0.0 and 0.0 alike


def keyed_uniform(
    key: int, roots: torch.Tensor, t_hi: torch.Tensor, t_lo: torch.Tensor | None, n: int
) -> torch.Tensor:
    """[R, n] float64 in [0, 1): slot j of root (roots[i], t_hi[i], t_lo[i]) under `key`."""
    h = _mix(roots.to(torch.int64) ^ _signed(key))
    h = _mix(h ^ _time_bits(t_hi))
    if t_lo is not None:
        h = _mix(h ^ _time_bits(t_lo))
    slots = torch.arange(1, n + 1, dtype=torch.int64, device=roots.device) * _signed(_GOLDEN)
    z = _mix(h.unsqueeze(1) ^ slots)
    return _srl(z, 11).to(torch.float64) * _UNIT
