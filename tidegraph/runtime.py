"""Process-level settings for the processes that train (the job's driver and its actors).

`set_determinism(seed, rank)` is the one place that sets process-wide switches: deterministic
kernels, torch's global seed and the thread count. Entry points (the job, each actor) call it;
constructors never do. Kernels: the backward of row gathers and `index_add` accumulate in
parallel (CPU threads or CUDA atomics) in a nondeterministic order, so deterministic mode calls
`torch.use_deterministic_algorithms(True, warn_only=True)` (without its NaN fill of new tensors,
`torch.utils.deterministic.fill_uninitialized_memory`: nothing here reads memory it did not
write, and the fill is an extra pass over each allocation). The switch is set on ATen directly:
torch's own function also imports inductor to copy the switch into inductor's config, which
costs every actor a run starts about as much CPU as importing torch (benchmarks/RESULTS.md);
inductor gets the switch before anything is compiled (`inductor_determinism`). On CPU two runs
with the same seed and thread count are then bitwise identical; on CUDA that also needs
`CUBLAS_WORKSPACE_CONFIG=:4096:8`, and ops without a deterministic kernel only warn.

`tune_host_allocator` keeps freed host memory for reuse. glibc serves every allocation above its
mmap threshold (128 KiB at start, adapting upwards only as such blocks are freed) with a fresh
`mmap` and returns free memory at the top of its heap to the OS eagerly, so a training step,
which allocates and frees many tensors of 0.1-10 MB, faults the same pages in again batch after
batch, in kernel time (measured in benchmarks/RESULTS.md). Freed memory up to
`trim_threshold` stays in the process.

`release_free_memory` gives it back: the driver calls it between increments, so what an
increment allocated and freed (its window, its passes' slices and results, a checkpoint's
state) does not stay in the head node's memory for the rest of a run that may last weeks.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

__all__ = [
    "inductor_determinism",
    "release_free_memory",
    "set_determinism",
    "tune_host_allocator",
]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
_M_MMAP_THRESHOLD = -3


def _libc():
    """glibc, or None (another platform, or another C library: musl has no mallopt)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS (glibc's `malloc_trim(0)`, which ignores the
    trim threshold and releases free pages inside the heap too); whether it could (glibc)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def tune_host_allocator(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds; returns whether they were set (glibc only)."""
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    log.debug("host allocator thresholds %s", "raised" if ok else "unchanged")
    return ok


def set_determinism(
    seed: int,
    rank: int = 0,
    deterministic: bool = True,
    threads: int | None = None,
    default_dtype: str | None = None,
) -> None:
    """Deterministic kernels (or not), torch's global seed for this rank, CPU threads, and
    (`default_dtype`, e.g. "float64": tests that compare runs beyond float32 noise) the
    default dtype that models are built in."""
    if default_dtype is not None:
        torch.set_default_dtype(getattr(torch, default_dtype))
    torch._C._set_deterministic_algorithms(deterministic, warn_only=True)
    if "torch._inductor.config" in sys.modules:  # already imported: keep it in step
        inductor_determinism()
    if deterministic:
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.manual_seed(int(seed) + int(rank))
    if threads:
        torch.set_num_threads(threads)
    log.debug("determinism %s, seed %d rank %d, threads %s", deterministic, seed, rank, threads)


def inductor_determinism() -> None:
    """Copy ATen's deterministic switch into inductor's config, as
    `torch.use_deterministic_algorithms` does; call before `torch.compile`."""
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = torch.are_deterministic_algorithms_enabled()
