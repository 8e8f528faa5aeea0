"""`TrainerActor`: a `TrainerCore` in its own process, wired to shard actors and to its group."""

from __future__ import annotations

import time

import ray

from tidegraph.actors.segments import SegmentView
from tidegraph.actors.shard import RemoteShard
from tidegraph.comm.collective import Collective
from tidegraph.rng import seed_for
from tidegraph.runtime import set_determinism
from tidegraph.storage.partition import build_partitioner
from tidegraph.training.config import RunConfig
from tidegraph.training.group import build_trainer

__all__ = ["TrainerActor"]


class _Trainer:
    def __init__(
        self, runtime: dict, config: dict, rank: int, world: int, shards: list,
        num_nodes: int, edge_dim: int, sharded: bool,
    ) -> None:  # fmt: skip
        set_determinism(**runtime)
        self.config = RunConfig.from_dict(config)
        c = self.config.cluster
        self.rank, self.world = rank, world
        self.partitioner = build_partitioner(c.partitioner, c.shards)
        proxies = [RemoteShard(h) for h in shards]
        # shards on this node are sampled here, over their segments in the object store
        here = ray.get_runtime_context().get_node_id()
        nodes = ray.get([h.node_id.remote() for h in shards])
        self.views = {
            p: SegmentView(self.config.sampler.strategy, seed_for(self.config.seed, "sampler", p))
            for p, node in enumerate(nodes) if node == here and c.local_sampling
        }  # fmt: skip
        hop_samplers = [self.views.get(p, proxy) for p, proxy in enumerate(proxies)]
        self.core = build_trainer(
            self.config, rank, proxies, self.partitioner.owner, num_nodes, edge_dim, sharded,
            gather=_gather, hop_samplers=hop_samplers,
        )  # fmt: skip
        self.collective = None
        self.coordinator = None

    def connect(
        self, address: tuple[str, int], generation: int, coordinator=None, every_s: float = 0.5
    ) -> int:
        """Join the trainer group of `generation` (all ranks call this together);
        `coordinator`: where rank 0 reports a pass's progress, every `every_s` seconds."""
        self.report_s = every_s
        timeout = self.config.cluster.collective_timeout_s
        self.collective = Collective(address, generation, self.rank, self.world, timeout)
        self.coordinator = coordinator if self.rank == 0 else None
        return self.rank

    def _progress(self, steps: int, last: float) -> float:
        """Report `steps` finished to the coordinator if the last report is old enough."""
        now = time.monotonic()
        if self.coordinator is None or now - last < self.report_s:
            return last
        self.coordinator.report.remote(steps)
        return now

    def ingested(
        self, num_nodes: int, num_rows: int, partition: dict | None, segments: list | None = None
    ) -> None:
        """After shards ingested a batch: grow node tables, know the new feature rows, for a
        stateful partitioner the new node placements, and same-node shards' segments."""
        for p, view in self.views.items():
            if segments is not None:
                view.update(segments[p])
        if partition is not None:
            self.partitioner.load_state_dict(partition)
        if self.core.edge_cache is not None:
            self.core.edge_cache.store.set_num_rows(num_rows)
        self.core.grow(num_nodes)

    def train_and_step(self, ev, weight, neg, num_observe: int, global_size: int, *before):
        """`before`: the previous step's node-state updates of every slice, applied first
        (one task per step instead of two)."""
        if before:
            self.core.apply_updates(list(before))
        return self.core.train_and_step(ev, weight, neg, num_observe, global_size,
                                        self.collective)  # fmt: skip

    def train_pass(self, slices: list, *before) -> list[float]:
        """Every step of a training pass: per step this trainer's slice, the all-reduce, the
        optimizer step, then the node-state updates of all slices, gathered from the group
        in rank (= slice) order. Returns this trainer's slice losses."""
        if before:
            self.core.apply_updates(list(before))
        losses, reported = [], time.monotonic()
        gather = self.world > 1
        for ev, weight, neg, num_observe, global_size in slices:
            loss, updates = self.core.train_and_step(
                ev, weight, neg, num_observe, global_size, self.collective, gather
            )
            self.core.apply_updates(updates if gather else [updates])
            losses.append(loss)
            reported = self._progress(len(losses), reported)
        return losses

    def eval_pass(self, slices: list, observe: bool, *before) -> list:
        """Every batch of an evaluation pass: (pos, neg) of this trainer's slices; with
        `observe` the group's node-state updates after each batch, gathered in slice order."""
        if before:
            self.core.apply_updates(list(before))
        out, reported = [], time.monotonic()
        for ev, neg in slices:
            if len(ev):
                pos, negl, updates = self.core.eval_slice(ev, neg, observe)
            else:
                pos, negl, updates = None, None, None
            if observe:
                self.core.apply_updates(self._gather(updates))
            out.append((pos, negl))
            reported = self._progress(len(out), reported)
        return out

    def _gather(self, updates) -> list:
        """Every trainer's updates of this step, in rank order (a collective)."""
        if self.world == 1:
            return [updates]
        return self.collective.all_gather_tensors(updates, self.core.device)

    def eval_slice(self, ev, neg, observe: bool, *before):
        if before:
            self.core.apply_updates(list(before))
        return self.core.eval_slice(ev, neg, observe)

    def apply_updates(self, *updates) -> None:
        self.core.apply_updates(list(updates))

    def call(self, method: str, *args):
        """Any other `TrainerCore` method (state, node state, optimizer, cache)."""
        return getattr(self.core, method)(*args)

    def local_shards(self) -> list[int]:
        """Shards this trainer samples in place (same node)."""
        return sorted(self.views)

    def grad_values(self) -> int:
        return self.core.optimizer.flat.numel()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def cache_stats(self) -> dict | None:
        cache = self.core.edge_cache
        return None if cache is None else cache.stats()

    def model_state(self) -> dict:
        return self.core.model_state()


def _gather(answers: list) -> list:
    """Wait for the object refs among `answers` at once; local answers pass through."""
    refs = [a for a in answers if isinstance(a, ray.ObjectRef)]
    got = iter(ray.get(refs)) if refs else iter(())
    return [next(got) if isinstance(a, ray.ObjectRef) else a for a in answers]


TrainerActor = ray.remote(_Trainer)
