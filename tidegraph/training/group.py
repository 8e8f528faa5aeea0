"""`LocalGroup`: P graph shards and W data-parallel trainers in one process.

The in-process backend of the distributed semantics (DESIGN.md, "Distributed semantics"); the
Ray backend drives the same cores through actors. Per global step of B events:
- the batch is cut into W contiguous slices (even, or at equal estimated sampled edges when
  even ones are skewed: `SliceBalancer`); negatives were drawn for the whole batch by the
  caller, so they do not depend on W;
- every trainer trains its slice against node state S(s-1) and returns its gradient (its share
  of the global-batch mean) and its node-state updates;
- the gradients are summed (the in-process all-reduce; one trainer's is used as it is, so
  W = 1 is bitwise the single-replica step), every trainer steps its optimizer with the sum and
  applies the updates of all slices in slice order (per node the latest event wins), so all of
  step s lands before any read of step s + 1 and the replicas stay identical.
Events are routed to shards by the partitioner: each event at the owner of its source and,
reversed, at the owner of its destination; feature rows at shard eid mod P.
"""

from __future__ import annotations

import logging
import time

import torch

from tidegraph.comm.gradsync import compressing, reduce_in_process_
from tidegraph.models.config import build_model
from tidegraph.rng import stream
from tidegraph.sampling.multihop import MultiHopSampler
from tidegraph.storage.events import EventBatch
from tidegraph.training.fetch import ShardedFeatureStore
from tidegraph.training.groupcore import GroupCore, shard_args
from tidegraph.training.shard import ShardCore
from tidegraph.training.state import ShardedStateSource
from tidegraph.training.state_placement import (
    check_placement,
    choose_memory_placement,
    state_row_bytes,
)
from tidegraph.training.trainer import TrainerCore

__all__ = [
    "LocalGroup",
    "build_trainer",
    "check_placement",
    "choose_memory_placement",
    "state_row_bytes",
]

log = logging.getLogger(__name__)


class LocalGroup(GroupCore):
    """Shards and trainers of one run, all in this process (it neither loses members nor
    changes them: its membership lists stay empty)."""

    supports_update_log = False  # the update log is written by trainer actors

    def __init__(
        self, config, num_nodes: int, edge_dim: int, expected_nodes: int | None = None
    ) -> None:
        self._init_core(config, num_nodes, edge_dim, expected_nodes)
        c = config.cluster
        sharded = self.sharded
        states = [None] * c.shards
        if sharded:  # each shard's node-state tables, held by a model instance of its own
            snaps = config.sampler.num_snapshots
            with torch.random.fork_rng(devices=[]):
                states = [build_model(config.model, 0, edge_dim, num_snapshots=snaps)
                          for _ in range(c.shards)]  # fmt: skip
        self.shards = []
        for p in range(c.shards):
            args, kwargs = shard_args(config, p, edge_dim, states[p])
            self.shards.append(ShardCore(*args, **kwargs))
        self.state_shards = self.shards if sharded else None
        self.trainers = [
            build_trainer(config, w, self.shards, self._owner, num_nodes, edge_dim, sharded)
            for w in range(c.trainers)
        ]
        # in one process, the timeline tells the members apart by thread id
        for i, member in enumerate([*self.trainers, *self.shards]):
            member.tracer.tid, member.tracer.process = 1 + i, "driver"

    def _owner(self, ids: torch.Tensor) -> torch.Tensor:
        return self.partitioner.owner(ids)

    # ---- ingest -----------------------------------------------------------------------------

    def ingest(self, events: EventBatch, num_nodes: int, span: tuple | None = None) -> None:
        """Route events to their shards (both endpoints' owners), grow trainers' node tables.
        (`span`, the events' positions in the stream, matters to groups that can lose a
        shard; in one process none is lost.)"""
        pieces = self._route(events)
        for shard, piece in zip(self.shards, pieces, strict=True):
            shard.ingest(piece)
        top = int(events.eid.max()) + 1 if len(events) else 0
        for trainer in self.trainers:
            if trainer.edge_cache is not None:
                trainer.edge_cache.store.set_num_rows(top)
            trainer.grow(num_nodes)

    # ---- steps ------------------------------------------------------------------------------

    def train_step(
        self, ev: EventBatch, weight: torch.Tensor | None, neg_BQ: torch.Tensor, num_observe: int
    ) -> float:
        """One global step over `ev` (its first `num_observe` events are recorded); returns
        the batch's mean loss."""
        results = []
        slices = self._train_cut(ev, weight, neg_BQ, num_observe)
        for trainer, args in zip(self.trainers, slices, strict=True):
            if len(args[0]):
                results.append(trainer.train_slice(*args))
        t0 = time.perf_counter()
        if compressing(self.config.comm, self.num_trainers):
            grad = self._compressed_sum(slices)
        elif len(results) == 1:
            grad = results[0]["grad"]
        else:
            grad = torch.stack([r["grad"] for r in results]).sum(0)
        self.tracer.record("allreduce", t0, time.perf_counter(), "driver", in_process=True)
        updates = [r["updates"] for r in results]
        for trainer in self.trainers:
            trainer.apply(grad, updates)
        if self.state_shards is not None:
            self._apply_state(updates)
        return sum(r["loss"] for r in results)

    def _compressed_sum(self, slices: list) -> torch.Tensor:
        """The step's gradient as W trainer processes compute it with `comm` compression:
        every trainer takes part (an empty slice with zeros), each keeps its `GradSync`."""
        for trainer, args in zip(self.trainers, slices, strict=True):
            if not len(args[0]):
                trainer.optimizer.zero_grad()
        flats = [t.optimizer.flat_grad for t in self.trainers]
        syncs = [getattr(t, "grad_sync", None) for t in self.trainers]
        sizes = self.trainers[0].optimizer.sizes
        live = reduce_in_process_(self.config.comm, self.config.seed, syncs, flats, sizes)
        for trainer, sync in zip(self.trainers, live, strict=True):
            trainer.grad_sync = sync
        return flats[0]

    def eval_step(
        self, ev: EventBatch, neg_BQ: torch.Tensor, observe: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of every slice, concatenated; with `observe`, records `ev` in node state."""
        pos, neg, updates = [], [], []
        cut, start = self._eval_cut(ev, neg_BQ)
        for w, part, part_neg in cut:
            p, n, u = self.trainers[w].eval_slice(part, part_neg, observe, start)
            pos.append(p)
            neg.append(n)
            updates.append(u)
        if observe:
            self._apply_state(updates)
        return torch.cat(pos), torch.cat(neg)

    def train_pass(self, batches: list, progress=None) -> list:
        """The steps of a pass, one at a time (`runs_passes` is False: the learner steps)."""
        out = []
        for i, batch in enumerate(batches):
            out.append(self.train_step(*batch))
            if progress is not None:
                progress(i + 1)
        return out

    def eval_pass(self, batches: list, observe: bool, progress=None) -> list:
        out = []
        for i, (ev, neg) in enumerate(batches):
            out.append(self.eval_step(ev, neg, observe))
            if progress is not None:
                progress(i + 1)
        return out

    def set_update_log(self, directory: str | None, every: int, replay=()) -> None:
        raise ValueError("the update log (cluster.update_log_every) is written by trainer "
                         "actors: it needs cluster.backend 'ray'")  # fmt: skip

    def _apply_state(self, updates: list) -> None:
        """All of a step's node-state updates, on every replica or at every shard."""
        if self.state_shards is not None:
            for shard in self.state_shards:
                shard.apply_state(updates)
            return
        for trainer in self.trainers:
            trainer.apply_updates(updates)

    # ---- node state and rounds ----------------------------------------------------------------

    def reset_state(self) -> None:
        for trainer in self.trainers:
            trainer.reset_state()
        for shard in self.state_shards or ():
            shard.reset_state()

    def node_state(self) -> dict:
        """A copy of the node state (replica 0's, or every shard's)."""
        if self.state_shards is not None:
            return {"shards": [s.node_state_dict() for s in self.state_shards]}
        return self.trainers[0].node_state()

    def shard_states(self) -> list[dict]:
        """Every partition's `ShardCore.state_dict()`, by partition (read only: for checks
        of what each partition holds)."""
        return [s.state_dict() for s in self.shards]

    def load_node_state(self, state: dict) -> None:
        if self.state_shards is not None:
            for shard, part in zip(self.state_shards, state["shards"], strict=True):
                shard.load_node_state_dict(part)
            return
        for trainer in self.trainers:
            trainer.load_node_state(state)

    def new_optimizers(self) -> None:
        for trainer in self.trainers:
            trainer.new_optimizer()

    def restore_caches(self, eids: torch.Tensor) -> None:
        for trainer in self.trainers:
            trainer.restore_cache(eids)

    def sampler_states(self) -> list:
        return [s.sampler_state() for s in self.shards]

    def load_sampler_states(self, states: list) -> None:
        for shard, state in zip(self.shards, states, strict=True):
            shard.load_sampler_state(state)

    def grad_values(self) -> int:
        """Values in the flat gradient each step all-reduces."""
        return self.trainers[0].optimizer.flat.numel()

    def comm_totals(self) -> dict | None:
        """Trainer 0's gradient-compression totals (bytes per rank), None without it."""
        sync = getattr(self.trainers[0], "grad_sync", None)
        return sync.totals() if hasattr(sync, "totals") else None

    def comm_state(self) -> dict | None:
        """Trainer 0's gradient-compression state (its `TrainerCore.state_dict()["comm"]`:
        bits, residuals, totals), None before any compressed step."""
        return self.trainers[0].state_dict().get("comm")

    def take_seconds(self) -> list[dict]:
        """Each trainer's seconds per step phase since the last call."""
        return [t.take_seconds() for t in self.trainers]

    def take_trace(self) -> list[dict]:
        """The driver's, trainers' and shards' timeline spans since the last call (one
        process, one clock)."""
        members = [self, *self.trainers, *self.shards]
        return [e for m in members for e in m.tracer.take()]

    def alive(self) -> tuple[int, int]:
        """(trainers, shards) alive: in one process, all of them."""
        return len(self.trainers), len(self.shards)

    def take_step_edges(self) -> list[list[int]]:
        """Each trainer's sampled edges per training slice since the last call."""
        return [t.take_step_edges() for t in self.trainers]

    def model_state(self) -> dict:
        """Replica 0's model state (parameters, and node state when replicated)."""
        return self.trainers[0].model_state()

    def cache_stats(self) -> dict | None:
        """Replica 0's edge-feature cache figures (None without edge features)."""
        cache = self.trainers[0].edge_cache
        return None if cache is None else cache.stats()

    def shutdown(self) -> None:
        """Nothing to release in one process."""

    def _shard_events(self) -> list[int]:
        return [s.num_events for s in self.shards]

    @property
    def shard_actors(self) -> int:
        """Shard holders: one per partition in one process."""
        return self.num_shards

    # ---- state --------------------------------------------------------------------------------

    def on_driver_node(self) -> bool:
        """Every piece is in this process."""
        return True

    def checkpointed(self) -> None:
        """The state last taken is durable (nothing here is kept only for a rebuild)."""

    def state_dict(self, store: str | None = None, saved_to: str | None = None) -> dict:
        """Every piece's state; `store` (a checkpoint store's URI): each piece writes its
        large tensors there and gives refs, as the actors of a Ray group do (the graph as
        pieces written once: `ShardCore.state_chunks`). `saved_to`: unused (every piece
        here reaches the store the state is saved to)."""
        method, args = ("state_dict", ()) if store is None else ("state_chunks", (store,))
        return {
            **self._common_state(),
            "shards": [getattr(s, method)(*args) for s in self.shards],
            "trainers": [getattr(t, method)(*args) for t in self.trainers],
        }

    def load_state_dict(self, state: dict, store: str | None = None) -> None:
        """`store`: the shards' and trainers' states may hold refs to the checkpoint store
        there, read by each piece as it loads."""
        self._load_common_state(state)
        method, args = ("load_state_dict", ()) if store is None else ("load_chunks", (store,))
        for shard, s in zip(self.shards, state["shards"], strict=True):
            getattr(shard, method)(s, *args)
        for trainer, s in zip(self.trainers, state["trainers"], strict=True):
            getattr(trainer, method)(s, *args)


def build_trainer(
    config,
    rank: int,
    shards: list,
    owner,
    num_nodes: int,
    edge_dim: int,
    sharded: bool,
    gather=None,
    hop_samplers: list | None = None,
) -> TrainerCore:
    """Trainer `rank` wired to `shards` (cores, or proxies of remote ones whose answers
    `gather` waits for): sampler (over `hop_samplers`, default the shards themselves),
    edge-feature store and, when sharded, node-state source."""
    s = config.sampler
    snaps = s.num_snapshots
    window = s.snapshot_window if snaps > 1 else 0.0
    hops = shards if hop_samplers is None else hop_samplers
    sampler = MultiHopSampler(hops, owner, s.fanouts, snaps, window, s.dedup, gather)
    features = None
    if edge_dim:
        precision = config.data.feature_precision
        features = ShardedFeatureStore(shards, edge_dim, precision, gather,
                                       rows_int8=config.comm.rows_int8)  # fmt: skip
    source = ShardedStateSource(shards, owner, gather, config.comm.rows_int8) if sharded else None
    init = stream(config.seed, "model")  # every replica draws the same initial parameters
    return TrainerCore(config, num_nodes, edge_dim, sampler, features, rank, init, source)
