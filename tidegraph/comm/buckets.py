"""The buckets of a flat gradient: where they lie, at how many bits each goes, what a round sent.

Pure functions of tensor sizes, a link model and per-bucket statistics, with no collective in
them: `QuantizedAllReduce` (reducer.py) and `OverlapRound` (overlap.py) both cut their tensor
by these plans and report in `CommStats`, and the plans are tested by tables of cases.

Per step, the flat tensor is cut into buckets (`plan_buckets`: a fixed size, or sized by a link
cost model, MG-WFBP style: small tensors merged until a message's latency alpha is a small
fraction of its transfer time bytes * beta, and merged further while the link would still be
busy when the next gradient is ready).

Adaptive bit width (AdaQP's objective): bucket k at b bits adds quantization variance
V_k(b) = sum over its values of range^2 / (2^b - 1)^2 (range of the value's chunk) and costs
bytes B_k(b). Every `adaptive_every` steps the ranks sum their V_k and |g|^2 (one small
all-reduce) and pick, per bucket, b minimising V_k(b) / |g|^2 + lambda * B_k(b) / B_fp32. The
objective is a sum of per-bucket terms, so trying each bit width per bucket solves it exactly
(no solver); rank 0's choice is broadcast so ranks can never disagree on message sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tidegraph.comm.config import CommConfig

__all__ = [
    "EXACT_BITS",
    "TOPK_BITS",
    "CommStats",
    "ring_bytes",
    "choose_bits",
    "ddp_bucket_cap_mb",
    "plan_buckets",
]

EXACT_BITS = 32  # a bucket's entry in `CommStats.bits` when it went uncompressed
TOPK_BITS = 0  # ... when it was sparsified by top-k


@dataclass
class CommStats:
    """What one all-reduce did: bytes this rank sent, and each bucket's bit width."""

    step: int
    compression: str  # the configured one; "none" during warm-up too, see `bits`
    bytes_sent: int  # by this rank (ring all-reduce / all-to-all + ring all-gather)
    bytes_fp32: int  # what an fp32 ring all-reduce of the same tensor sends
    bits: tuple[int, ...] = field(default_factory=tuple)  # 32 exact, 8/4/2, 0 top-k
    decided: bool = False  # adaptive bits were re-decided this step
    early: int = 0  # messages (buckets) that left before the tensor was complete (overlap)
    # with overlap, per bucket (sent, done as perf_counter seconds, bytes sent, bits): the
    # timeline's bucket spans
    buckets: tuple = ()

    @property
    def ratio(self) -> float:
        return self.bytes_sent / self.bytes_fp32 if self.bytes_fp32 else 1.0


def _link_target_bytes(config: CommConfig) -> float:
    """Smallest message whose latency is at most `latency_fraction` of its whole time."""
    beta = 8.0 / (config.link_bandwidth_gbps * 1e9)  # seconds per byte
    f = config.latency_fraction
    return config.link_latency_s * (1 - f) / (f * beta)


def ddp_bucket_cap_mb(config: CommConfig) -> float:
    """DDP's `bucket_cap_mb` for `config` (fixed size, or the cost model's target)."""
    size = config.bucket_bytes if config.bucketing == "fixed" else _link_target_bytes(config)
    return size / 2**20


def plan_buckets(
    sizes: Sequence[int],
    config: CommConfig,
    ready_s: Sequence[float] | None = None,
    itemsize: int = 4,
) -> list[tuple[int, int]]:
    """Element ranges [lo, hi) of a flat buffer holding tensors of `sizes`, in order.

    "fixed": tensors in order fill a bucket up to `bucket_bytes`; a tensor larger than that is
    split into equal pieces. "cost_model": tensors taken in backward order (last first, as
    their gradients become ready, at `ready_s` seconds if known) merge until the bucket reaches
    the link's target size, and keep merging while the link would still be busy sending
    earlier buckets when the next gradient is ready (MG-WFBP's rule: waiting is free then,
    a separate message costs alpha). Tensors are never split in that mode.
    """
    if any(int(n) < 0 for n in sizes):
        raise ValueError(f"plan_buckets: sizes must be >= 0, got {list(sizes)}")
    if config.bucketing == "fixed":
        return _fixed_buckets([int(n) for n in sizes], max(1, config.bucket_bytes // itemsize))
    return _cost_model_buckets([int(n) for n in sizes], config, ready_s, itemsize)


def _fixed_buckets(sizes: list[int], cap: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    lo = at = 0
    for n in sizes:
        if at > lo and at - lo + n > cap:
            out.append((lo, at))
            lo = at
        if n > cap:
            pieces = -(-n // cap)
            cuts = [at + (n * i) // pieces for i in range(pieces + 1)]
            out.extend(zip(cuts[:-1], cuts[1:], strict=True))
            lo = at + n
        at += n
    if at > lo:
        out.append((lo, at))
    return out


def _cost_model_buckets(
    sizes: list[int], config: CommConfig, ready_s: Sequence[float] | None, itemsize: int
) -> list[tuple[int, int]]:
    if ready_s is not None and len(ready_s) != len(sizes):
        raise ValueError(f"plan_buckets: {len(ready_s)} ready times for {len(sizes)} tensors")
    target = _link_target_bytes(config)
    alpha, beta = config.link_latency_s, 8.0 / (config.link_bandwidth_gbps * 1e9)
    ends = list(_cumsum(sizes))
    cuts: list[int] = []  # flat offsets where a bucket starts, found in backward order
    link_free, cur_bytes, cur_ready = 0.0, 0, 0.0
    for i in reversed(range(len(sizes))):
        ready = 0.0 if ready_s is None else float(ready_s[i])
        if cur_bytes >= target:
            start = max(cur_ready, link_free)
            if ready_s is None or ready >= start:  # link idle by then: send the bucket now
                cuts.append(ends[i])
                link_free = start + alpha + beta * cur_bytes
                cur_bytes = 0
        cur_bytes += sizes[i] * itemsize
        cur_ready = ready
    bounds = [0, *sorted(set(cuts)), ends[-1] if ends else 0]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _cumsum(sizes: list[int]):
    at = 0
    for n in sizes:
        at += n
        yield at


def _starts(lengths: list[int]) -> list[int]:
    return [0, *_cumsum(lengths)][:-1]


def choose_bits(
    range_sq: torch.Tensor,
    numel: torch.Tensor,
    energy: float,
    candidates: Sequence[int],
    lam: float,
    chunk_size: int,
) -> list[int]:
    """Per bucket, the bit width minimising V(b) / energy + lam * bytes(b) / fp32 bytes.

    `range_sq[k]` is the sum over bucket k's values of their chunk's range squared (so
    V_k(b) = range_sq[k] / (2^b - 1)^2), `numel[k]` its values, `energy` |g|^2 over all
    compressed buckets. Exact (the objective is separable); ties go to fewer bits.
    """
    cand = torch.tensor(sorted(candidates), dtype=torch.float64)
    range_sq = range_sq.to(torch.float64).reshape(-1, 1)
    numel = numel.to(torch.float64).reshape(-1, 1)
    variance = range_sq / (2.0**cand - 1.0) ** 2
    nbytes = numel * cand / 8 + 8.0 * torch.ceil(numel / chunk_size)
    fp32_bytes = max(4.0 * float(numel.sum()), 1.0)
    cost = variance / max(float(energy), 1e-30) + lam * nbytes / fp32_bytes
    return [int(b) for b in cand[cost.argmin(dim=1)].tolist()]


def _check_flat(flat: torch.Tensor) -> None:
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("QuantizedAllReduce: expected a contiguous 1-D tensor")


def _scatter_back(flat: torch.Tensor, ranges: list[tuple[int, int]], buf: torch.Tensor) -> None:
    at = 0
    for lo, hi in ranges:
        flat[lo:hi].copy_(buf[at : at + hi - lo])
        at += hi - lo


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `nbytes`."""
    return -(-2 * (world - 1) * nbytes // world)
