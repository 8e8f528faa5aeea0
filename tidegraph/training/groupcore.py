"""`GroupCore`: what a group of shards and trainers does the same way on every backend.

`LocalGroup` (one process) and `RayGroup` (actors) both derive from it, so the rules that make
their runs equal are written once:
- set-up: the partitioner, the stored-feature rounding stream, the slice balancer, where node
  state lives (`cluster.memory`, "auto" resolved by its size);
- routing an ingest to partitions (both endpoints' owners; feature rows rounded from the one
  stream, whatever P), and the balancer learning the events;
- cutting a training batch into W slices and an evaluation batch into the slices of the
  trainers that get one, with the batch's start (`sampler.history: batch`);
- a partition's `ShardCore` arguments (its seeds are the partition's, so it samples and rounds
  the same in any process);
- the state both keep (`common_state`) and the partition report.
"""

from __future__ import annotations

import time

import torch

from tidegraph.rng import load_generator_state, seed_for, stream
from tidegraph.storage.events import EventBatch
from tidegraph.storage.partition import build_partitioner, partition_report
from tidegraph.timeline import Tracer
from tidegraph.training.balance import SliceBalancer
from tidegraph.training.schedule import batch_start, train_slices
from tidegraph.training.shard import route_batch
from tidegraph.training.state_placement import (
    check_placement,
    choose_memory_placement,
    state_row_bytes,
)

__all__ = ["GroupCore", "shard_args"]


def shard_args(config, p: int, edge_dim: int, state_model=None) -> tuple[tuple, dict]:
    """(args, kwargs) of partition `p`'s `ShardCore`; `state_model` holds its node-state
    tables when node state is sharded."""
    return (p, config.cluster.shards), dict(
        edge_dim=edge_dim, feature_precision=config.data.feature_precision,
        strategy=config.sampler.strategy, seed=seed_for(config.seed, "sampler", p),
        feature_seed=seed_for(config.seed, "features", p),
        graph_device=config.graph_device, pin_memory=config.device.startswith("cuda"),
        state_model=state_model, timeline=config.timeline,
    )  # fmt: skip


class GroupCore:
    """The shared part of a group; subclasses call `_init_core` first in their constructor."""

    on_change = None  # (kind, why): the controller's hook (`orchestrator.controller`)
    # () -> the newest checkpoint's group state (its shards' states and ingests) or None, set
    # by the controller: a lost shard starts from its snapshot there and replays only later
    # ingests (groups that rebuild shards)
    snapshot_source = None
    runs_passes = False  # whether `train_pass`/`eval_pass` run whole passes per task

    def _init_core(self, config, num_nodes: int, edge_dim: int, expected_nodes: int | None) -> int:
        """Set up the shared state; returns the node-state bytes per node."""
        c = config.cluster
        self.config = config
        self.tracer = Tracer("driver", config.timeline)  # the driver's timeline spans
        self.num_shards, self.num_trainers = c.shards, c.trainers
        self.train_batch_size = config.train.batch_size
        self.partitioner = build_partitioner(c.partitioner, c.shards)
        # stochastic rounding of stored features (int8, bf16): one stream, whatever P
        self.feature_gen = stream(config.seed, "features")
        self.balancer = SliceBalancer(config.sampler.fanouts, c.rebalance_tolerance)
        row_bytes = state_row_bytes(config, edge_dim)
        expected = num_nodes if expected_nodes is None else expected_nodes
        self.memory_placement = choose_memory_placement(c, expected, row_bytes)
        self.sharded = self.memory_placement == "sharded" and row_bytes > 0
        # membership changes so far, one record each (empty where members never change)
        self.recoveries: list[dict] = []  # trainer and shard recoveries
        self.resizes: list[dict] = []  # changes of the trainer count
        self.shard_moves: list[dict] = []  # partitions moved to another shard actor
        self.shard_resizes: list[dict] = []  # changes of the shard-actor count
        return row_bytes

    # ---- routing and slicing ------------------------------------------------------------------

    def _pieces(self, events: EventBatch, gen: torch.Generator) -> list:
        """`events` routed to partitions, stored features rounded from `gen`."""
        return route_batch(self.partitioner, events, self.config.data.feature_precision, gen)

    def _route(self, events: EventBatch) -> list:
        """An ingest's pieces per partition (rounded from the run's stream); the balancer
        learns the events."""
        pieces = self._pieces(events, self.feature_gen)
        self.balancer.ingest(events)
        return pieces

    def _train_cut(self, ev, weight, neg_BQ, num_observe: int) -> list[tuple]:
        """Each trainer's arguments of one training step (`schedule.train_slices`, at the
        balancer's bounds)."""
        t0 = time.perf_counter()
        bounds = self.balancer.bounds(ev, neg_BQ, self.num_trainers)
        out = train_slices(ev, weight, neg_BQ, num_observe, self.num_trainers, bounds)
        self.tracer.record("routing", t0, time.perf_counter(), "driver", events=len(ev))
        return out

    def _trace_event(self, name: str, t0: float, event: dict) -> None:
        """A recovery, resize or move (`event`, begun at perf_counter `t0`) on the driver's
        timeline, with its plain facts as args."""
        args = {k: v for k, v in event.items() if isinstance(v, (int, float, str, list))}
        self.tracer.record(name, t0, time.perf_counter(), "driver", **args)

    def _eval_cut(self, ev: EventBatch, neg_BQ: torch.Tensor) -> tuple[list, float | None]:
        """[(rank, events, negatives)] of the trainers that get a slice of an evaluation
        batch, and the batch's start (`sampler.history: batch`: every event is new)."""
        bounds = self.balancer.bounds(ev, neg_BQ, self.num_trainers)
        start = batch_start(ev.t) if self.config.sampler.history == "batch" else None
        cut = [(w, ev.select(slice(lo, hi)), neg_BQ[lo:hi])
               for w, (lo, hi) in enumerate(bounds) if hi > lo]  # fmt: skip
        return cut, start

    # ---- state and reports ----------------------------------------------------------------------

    def _common_state(self) -> dict:
        return {
            "memory_placement": self.memory_placement,
            "partitioner": self.partitioner.state_dict(),
            "feature_gen": self.feature_gen.get_state(),
            "balancer": self.balancer.state_dict(),
        }

    def _load_common_state(self, state: dict) -> None:
        check_placement(state, self.memory_placement)
        self.partitioner.load_state_dict(state["partitioner"])
        load_generator_state(self.feature_gen, state["feature_gen"], "feature rounding")
        self.balancer.load_state_dict(state["balancer"])

    def _shard_events(self) -> list[int]:
        raise NotImplementedError

    def report(self, src: torch.Tensor, dst: torch.Tensor) -> dict:
        """Partition quality over events (src, dst), and per-shard event counts."""
        out = partition_report(src, dst, self.partitioner)
        out["shard_events"] = self._shard_events()
        return out

    def partition(self, tally) -> dict:
        """Partition quality of every event ingested (a `PartitionTally`), and per-shard
        event counts."""
        out = tally.report(self.partitioner)
        out["shard_events"] = self._shard_events()
        return out
