"""How trainers compress what they send: the `comm:` section of a run's configuration.

`compression` picks the gradient codec (none, q8/q4/q2 fixed bits, adaptive bits per bucket,
top-k); the other fields tune it. Defaults keep fp32 semantics (`none`), so a run changes only
when asked. Checked in `__post_init__` with a message naming the field to fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidegraph.comm.kernels import CODECS
from tidegraph.comm.quantize import BITS
from tidegraph.config_check import check_fields, unknown_keys

__all__ = ["BUCKETINGS", "COMPRESSIONS", "CommConfig"]

COMPRESSIONS = ("none", "q8", "q4", "q2", "adaptive", "topk")
BUCKETINGS = ("fixed", "cost_model")


@dataclass(kw_only=True)
class CommConfig:
    compression: str = "none"
    chunk_size: int = 256  # values per (min, scale) pair; a multiple of 4
    warmup_steps: int = 10  # exact all-reduce for the first steps (large early gradients)
    min_bucket_bytes: int = 64 * 1024  # smaller buckets go exact: codec costs more than it saves
    error_feedback: bool = False  # carry what quantization/top-k dropped into the next step
    # adaptive: per bucket, bits minimising variance / |g|^2 + lambda * bytes / fp32 bytes
    adaptive_bits: tuple[int, ...] = BITS
    adaptive_lambda: float = 1.0
    adaptive_every: int = 50  # steps between decisions
    topk_ratio: float = 0.01  # fraction of a bucket's values sent by top-k
    # buckets: a fixed size, or from a link cost model (latency alpha + bytes / bandwidth)
    bucketing: str = "fixed"
    bucket_bytes: int = 4 << 20
    link_latency_s: float = 50e-6
    link_bandwidth_gbps: float = 10.0
    latency_fraction: float = 0.1  # cost model: a bucket's latency at most this of its time
    rows_int8: bool = False  # feature and memory rows from remote shards travel int8
    # the codec's kernels: compiled by inductor (C++), eager torch, or auto (compiled on CPU
    # when a C++ compiler is there, compiling aside and eager until ready); same codes
    codec: str = "auto"
    # a compressed exchange is cut into at most this many messages of whole buckets, so that
    # encoding and decoding overlap the transfer (1: one message, no overlap)
    pipeline_stages: int = 8
    # send each bucket during backward as soon as its gradients are final (DDP-style), not
    # after backward: compressed buckets bitwise the same; exact (fp32) ones too at W = 2, at
    # W >= 3 up to gloo's order of addition per bucket. Adaptive decision steps, top-k and
    # error feedback need the whole gradient first and send after backward.
    overlap: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "comm")
        _one_of("compression", self.compression, COMPRESSIONS)
        _one_of("bucketing", self.bucketing, BUCKETINGS)
        _one_of("codec", self.codec, CODECS)
        if self.chunk_size < 4 or self.chunk_size % 4:
            _bad("chunk_size", self.chunk_size, "a positive multiple of 4")
        _at_least("warmup_steps", self.warmup_steps, 0)
        _at_least("min_bucket_bytes", self.min_bucket_bytes, 0)
        _at_least("adaptive_every", self.adaptive_every, 1)
        _at_least("bucket_bytes", self.bucket_bytes, 4)
        _at_least("pipeline_stages", self.pipeline_stages, 1)
        if not self.adaptive_bits or any(b not in BITS for b in self.adaptive_bits):
            _bad("adaptive_bits", self.adaptive_bits, f"a non-empty subset of {BITS}")
        if not self.adaptive_lambda >= 0:
            _bad("adaptive_lambda", self.adaptive_lambda, ">= 0")
        if not 0 < self.topk_ratio <= 1:
            _bad("topk_ratio", self.topk_ratio, "in (0, 1]")
        if not self.link_latency_s >= 0:
            _bad("link_latency_s", self.link_latency_s, ">= 0")
        if not self.link_bandwidth_gbps > 0:
            _bad("link_bandwidth_gbps", self.link_bandwidth_gbps, "> 0")
        if not 0 < self.latency_fraction < 1:
            _bad("latency_fraction", self.latency_fraction, "in (0, 1)")

    @property
    def fixed_bits(self) -> int | None:
        """8, 4 or 2 for q8/q4/q2, else None."""
        return int(self.compression[1:]) if self.compression in ("q8", "q4", "q2") else None

    @classmethod
    def from_dict(cls, d: dict) -> CommConfig:
        unknown_keys(d, cls.__dataclass_fields__, "comm")
        return cls(**d)


def _bad(name: str, value, want: str):
    raise ValueError(f"comm.{name} must be {want}, got {value!r}")


def _one_of(name: str, value, choices: tuple) -> None:
    if value not in choices:
        _bad(name, value, f"one of {choices}")


def _at_least(name: str, value, low: int) -> None:
    if value < low:
        _bad(name, value, f"an integer >= {low}")
