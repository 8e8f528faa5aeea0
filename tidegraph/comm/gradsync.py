"""A trainer's compressed gradient all-reduce, kept across membership generations.

The trainer group is rebuilt on every membership generation (recovery, resize), but what
compression remembers belongs to the trainer, not to one group: the bucket plan, the adaptive
bit widths (decided by rank 0, so the same on every rank), the error-feedback residuals (this
rank's own) and the running byte totals. `GradSync` holds that; the trainer keeps it (and its
`state_dict` goes into the trainer's), and each step hands it to whatever group is current.

A step's gradient travels as a `GradientStep` through `Collective.allreduce_sum_`, the one
method every wrapper of a collective already intercepts (fault injection, say), so choosing
the compressed path adds no second entry point.

State across ranks: `load_state_dict` of another rank's state (a replacement trainer seeded
from a survivor) keeps the shared part (bits, decision step, totals) and drops the residuals,
which were the survivor's own: the replacement restarts its error feedback from zero. Without
error feedback nothing is lost, since rounding draws from per-(rank, step) streams.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tidegraph.comm.buckets import EXACT_BITS, CommStats
from tidegraph.comm.config import CommConfig
from tidegraph.comm.loopback import allreduce_in_process_
from tidegraph.comm.overlap import OverlapRound
from tidegraph.comm.reducer import QuantizedAllReduce

__all__ = ["GradSync", "GradientStep", "comm_record", "compressing", "reduce_in_process_"]

log = logging.getLogger(__name__)


def compressing(config: CommConfig | None, world: int) -> bool:
    """Whether gradients of a group of `world` go through `QuantizedAllReduce` (a group of
    one sends nothing, so it never does)."""
    return config is not None and config.compression != "none" and world > 1


@dataclass
class GradientStep:
    """A flat gradient with what compressing it needs: the global step (warm-up, adaptive
    decisions, per-step rounding streams), the tensor sizes (bucket boundaries), and the
    trainer's `GradSync` (None before its first compressed step, or the state_dict a
    checkpoint loaded; the collective puts the live object here)."""

    flat: torch.Tensor
    step: int
    sizes: Sequence[int] | None = None
    sync: GradSync | dict | None = None
    round: OverlapRound | None = None  # sending since `Collective.begin_gradient`


class GradSync:
    """Rank `rank`'s compressed all-reduce state; `allreduce_(flat, step, sizes, group, world)`
    over a torch.distributed group (`group`) or, with `ops`, in one process."""

    def __init__(self, config: CommConfig, seed: int, rank: int) -> None:
        self.config, self.rank = config, rank
        self.reducer = QuantizedAllReduce(config, None, rank, 1, seed=seed)
        self.calls = 0  # all-reduces done (the step of in-process groups, see LocalGroup)
        self.compressed_steps = 0  # ... with at least one bucket compressed
        self.bytes_sent = 0  # by this rank
        self.bytes_fp32 = 0  # what fp32 ring all-reduces of the same tensors send
        self.last_bits: tuple[int, ...] = ()
        self.sent_early = 0  # buckets that left during backward (`comm.overlap`)
        self.last_stats: CommStats | None = None
        if config.overlap and (config.error_feedback or config.compression == "topk"):
            log.warning("comm.overlap: %s needs the whole gradient first, so buckets are "
                        "sent after backward", "top-k" if config.compression == "topk"
                        else "error feedback")  # fmt: skip

    @classmethod
    def restore(cls, config: CommConfig, seed: int, rank: int, state) -> GradSync:
        """`state` if it is one already, else a new one loaded from `state` (a dict or None)."""
        if isinstance(state, GradSync):
            return state
        sync = cls(config, seed, rank)
        if state is not None:
            sync.load_state_dict(state)
        return sync

    def prepare(self, sizes: Sequence[int] | None, group, world: int) -> QuantizedAllReduce:
        """The reducer, bound to this step's group and tensor sizes (new sizes: new plan)."""
        red = self.reducer
        red.group, red.world = group, world
        red.set_sizes(sizes)
        return red

    def record(self, stats: CommStats) -> CommStats:
        self.calls += 1
        self.compressed_steps += any(b != EXACT_BITS for b in stats.bits)
        self.bytes_sent += stats.bytes_sent
        self.bytes_fp32 += stats.bytes_fp32
        self.last_bits = tuple(stats.bits)
        self.sent_early += stats.early
        self.last_stats = stats  # the timeline reads the step's bytes and bits
        return stats

    def allreduce_(self, flat: torch.Tensor, step: int, sizes, group, world: int) -> CommStats:
        return self.record(self.prepare(sizes, group, world).allreduce_(flat, step))

    def begin(self, flat: torch.Tensor, step: int, sizes, group, world: int) -> OverlapRound:
        """`allreduce_` sent bucket by bucket while `flat` is computed (see
        `QuantizedAllReduce.begin`); `finish` completes it."""
        return self.prepare(sizes, group, world).begin(flat, step)

    def finish(self, round_: OverlapRound) -> CommStats:
        return self.record(round_.finish())

    def totals(self) -> dict:
        return {
            "steps": self.calls,
            "compressed_steps": self.compressed_steps,
            "bytes_sent": self.bytes_sent,
            "bytes_fp32": self.bytes_fp32,
            "ratio": self.bytes_sent / self.bytes_fp32 if self.bytes_fp32 else 1.0,
            "last_bits": list(self.last_bits),
            "buckets_sent_in_backward": self.sent_early,
        }

    def state_dict(self) -> dict:
        return {
            "rank": self.rank,
            "sizes": self.reducer.sizes,  # before the reducer's state: its plan follows them
            "totals": self.totals(),
            "reducer": self.reducer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        reducer = dict(state["reducer"])
        if state["rank"] != self.rank:
            log.info("comm: state of rank %d loaded by rank %d: its error-feedback residuals "
                     "are dropped", state["rank"], self.rank)  # fmt: skip
            empty = {"residual": None}
            reducer.update(worker_feedback=empty, owner_feedback=empty)
        self.reducer.sizes = state["sizes"]
        self.reducer.load_state_dict(reducer)
        t = state["totals"]
        self.calls, self.compressed_steps = t["steps"], t["compressed_steps"]
        self.bytes_sent, self.bytes_fp32 = t["bytes_sent"], t["bytes_fp32"]
        self.last_bits = tuple(t["last_bits"])
        self.sent_early = t.get("buckets_sent_in_backward", 0)  # absent before overlap existed


def reduce_in_process_(
    config: CommConfig, seed: int, syncs: Sequence, flats: Sequence[torch.Tensor], sizes
) -> list[GradSync]:
    """Sum W in-process trainers' `flats` (rank order; every rank's, zeros for an empty
    slice) as W trainer processes would with `config`: same codes, same sums, every flat
    replaced by the result. `syncs`: each rank's `GradSync`, state dict or None; returns
    the live ones. The step is the all-reduces done so far (rank 0's count), which is the
    trainers' step count when every step was compressed from the first."""
    live = [GradSync.restore(config, seed, r, s) for r, s in enumerate(syncs)]
    step = live[0].calls
    reducers = [s.prepare(sizes, None, len(live)) for s in live]
    stats = allreduce_in_process_(reducers, list(flats), step)
    for sync, st in zip(live, stats, strict=True):
        sync.record(st)
    return live


def comm_record(config: CommConfig, state: dict | None) -> dict:
    """What summary.json says about gradient compression: the resolved settings and, from one
    trainer's `GradSync` state (bytes are per rank), the totals and the last bits per bucket
    (32: sent exact, 0: top-k)."""
    out = {"config": dataclasses.asdict(config)}
    out["config"]["adaptive_bits"] = list(config.adaptive_bits)
    if state is None:
        out.update(
            steps=None,
            bytes_sent=None,
            bytes_fp32=None,
            ratio=1.0,
            last_bits=[],
            buckets_sent_in_backward=None,
        )
    else:
        out.update(state["totals"])
        out.setdefault("buckets_sent_in_backward", 0)  # a checkpoint from before overlap
    return out
