"""Restoring random generators from saved states, wherever the state tensor was loaded.

A checkpoint loaded with `map_location="cuda"` holds generator states as CUDA tensors, which
`Generator.set_state` refuses; and a state saved by a generator of another device type (a CPU
generator's state is 5,056 bytes, a CUDA one's 16) cannot be set at all, as happens when a run
resumes on another kind of device. `load_generator_state` takes the state to the CPU first, and
in the second case seeds the generator from a hash of the saved state, with a warning: the draws
then differ from an uninterrupted run (they differ between CPU and CUDA generators anyway), but
stay reproducible for a given checkpoint.
"""

from __future__ import annotations

import hashlib
import logging

import torch

__all__ = ["load_generator_state"]

log = logging.getLogger(__name__)


def load_generator_state(gen: torch.Generator, state: torch.Tensor, what: str) -> None:
    """Set `gen` to `state` (any device); `what` names the generator in the warning."""
    state = state.detach().to("cpu", torch.uint8)
    if state.numel() == gen.get_state().numel():
        gen.set_state(state)
        return
    seed = int.from_bytes(hashlib.sha256(state.numpy().tobytes()).digest()[:8], "little")
    gen.manual_seed(seed)
    log.warning(
        "%s: saved generator state (%d bytes) is from another device type than this %s "
        "generator; seeded from it instead, so its draws differ from the original run's",
        what,
        state.numel(),
        gen.device.type,
    )
