"""Process-level settings."""

import platform
import sys

import pytest
import torch

from tidegraph.runtime import release_free_memory, tune_host_allocator


def test_host_allocator_tuning_applies_on_glibc():
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert tune_host_allocator() == glibc
    big = torch.ones(64 << 20, dtype=torch.uint8)  # served from the heap now, and freed
    assert int(big.sum()) == 64 << 20
    del big
    assert int(torch.ones(64 << 20, dtype=torch.uint8).sum()) == 64 << 20


def _anon_bytes() -> int:
    for line in open("/proc/self/status").read().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_free_heap_goes_back_to_the_os_between_increments():
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    if not glibc:
        assert release_free_memory() is False
        return
    assert tune_host_allocator()  # freed memory up to 1 GiB stays in the process...
    big = torch.ones(96 << 20, dtype=torch.uint8)
    assert int(big.sum()) == 96 << 20
    del big
    kept = _anon_bytes()
    assert release_free_memory()  # ...until the driver gives it back
    assert kept - _anon_bytes() >= 64 << 20


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


def test_a_trainer_process_never_imports_the_compiler_stack():
    """`set_determinism`, the trainer's modules and a few `FlatAdam` steps, checkpointed and
    loaded, in a fresh process: deterministic mode is on, and neither dynamo nor inductor was
    imported (each costs a process start about as much CPU as importing torch). A compiled
    codec kernel then still gets the deterministic switch into inductor's config."""
    import subprocess

    code = """
import sys, torch
from tidegraph.runtime import set_determinism, inductor_determinism
import tidegraph.actors.trainer, tidegraph.actors.shard, tidegraph.actors.coordinator
from tidegraph.training.optim import FlatAdam
set_determinism(3, threads=1)
net = torch.nn.Linear(4, 2)
opt = FlatAdam(net.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad()
    net(torch.ones(3, 4)).sum().backward()
    opt.step()
opt.load_state_dict(opt.state_dict())
loaded = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
print(torch.are_deterministic_algorithms_enabled(), loaded)
inductor_determinism()
import torch._inductor.config as config
print(config.deterministic)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True []", "True"], out.stdout
