"""Process-level settings."""

import platform
import sys

import torch

from tidegraph.runtime import tune_host_allocator


def test_host_allocator_tuning_applies_on_glibc():
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert tune_host_allocator() == glibc
    big = torch.ones(64 << 20, dtype=torch.uint8)  # served from the heap now, and freed
    assert int(big.sum()) == 64 << 20
    del big
    assert int(torch.ones(64 << 20, dtype=torch.uint8).sum()) == 64 << 20
