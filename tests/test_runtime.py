"""Process-level settings."""

import platform
import sys

import pytest
import torch

from tidegraph.runtime import tune_host_allocator


def test_host_allocator_tuning_applies_on_glibc():
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert tune_host_allocator() == glibc
    big = torch.ones(64 << 20, dtype=torch.uint8)  # served from the heap now, and freed
    assert int(big.sum()) == 64 << 20
    del big
    assert int(torch.ones(64 << 20, dtype=torch.uint8).sum()) == 64 << 20


def test_generator_state_restores_exactly_or_reseeds_from_another_device(caplog):
    from tidegraph.rng import load_generator_state

    gen = torch.Generator().manual_seed(7)
    state = gen.get_state()
    expected = torch.rand(5, generator=gen)
    load_generator_state(gen, state, "test")
    assert torch.equal(torch.rand(5, generator=gen), expected)
    # a CUDA generator's state is 16 bytes: a CPU generator is seeded from it, reproducibly
    foreign = torch.arange(16, dtype=torch.uint8)
    draws = []
    for _ in range(2):
        with caplog.at_level("WARNING", logger="tidegraph.rng"):
            load_generator_state(gen, foreign, "test")
        draws.append(torch.rand(5, generator=gen))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], expected)
    assert "test: saved generator state (16 bytes) is from another device type" in caplog.text
    with pytest.raises(ValueError, match="test: saved generator state has 100 bytes"):
        load_generator_state(gen, torch.zeros(100, dtype=torch.uint8), "test")
    with pytest.raises(ValueError, match="uint8"):
        load_generator_state(gen, state.long(), "test")
