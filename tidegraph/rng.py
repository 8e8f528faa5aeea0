"""Named seed streams, and restoring random generators from saved states.

`seed_for(seed, name)` gives each consumer of randomness its own stream of a run's seed, so no
component derives seeds by arithmetic of its own and adding a stream never shifts another. The
streams that existed before names did keep their values (seed + 0 ... seed + 5), so runs
recorded then reproduce; new streams get offsets from a hash of their name.


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

__all__ = ["STREAMS", "load_generator_state", "seed_for", "stream"]

log = logging.getLogger(__name__)


_STATE_BYTES = {"cpu": 5056, "cuda": 16}  # Philox (CUDA): seed and offset

# model init, sampler draws, negatives, replay choice, forgetting probes, feature rounding
STREAMS = {"model": 0, "sampler": 1, "negatives": 2, "replay": 3, "forgetting": 4, "features": 5}


def seed_for(seed: int, name: str, index: int = 0) -> int:
    """The seed of stream `name` (the `index`-th of its kind, e.g. a shard's) of run `seed`."""
    if name in STREAMS:
        base = STREAMS[name]
    else:
        base = 1 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    return int(seed) + base + (index << 32)


def stream(seed: int, name: str, index: int = 0, device: str = "cpu") -> torch.Generator:
    """A generator seeded for stream `name` of run `seed`."""
    return torch.Generator(device=device).manual_seed(seed_for(seed, name, index))


def load_generator_state(gen: torch.Generator, state: torch.Tensor, what: str) -> None:
    """Set `gen` to `state` (any device); `what` names the generator in errors and warnings."""
    if state.dtype != torch.uint8:
        raise ValueError(f"{what}: a generator state is a uint8 tensor, got {state.dtype}")
    state = state.detach().cpu()
    own = gen.get_state().numel()
    if state.numel() == own:
        gen.set_state(state)
        return
    if state.numel() not in _STATE_BYTES.values():
        raise ValueError(
            f"{what}: saved generator state has {state.numel()} bytes; this {gen.device.type} "
            f"generator's has {own} (a CPU generator's {_STATE_BYTES['cpu']}, a CUDA one's "
            f"{_STATE_BYTES['cuda']}): not a generator state"
        )
    seed = int.from_bytes(hashlib.sha256(state.numpy().tobytes()).digest()[:8], "little")
    gen.manual_seed(seed)
    log.warning(
        "%s: saved generator state (%d bytes) is from another device type than this %s "
        "generator; seeded from it instead, so its draws differ from the original run's",
        what,
        state.numel(),
        gen.device.type,
    )
