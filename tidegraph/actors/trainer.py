"""`TrainerActor`: a `TrainerCore` in its own process, wired to shard actors and to its group."""

from __future__ import annotations

import ray

from tidegraph.actors.shard import RemoteShard
from tidegraph.comm.collective import Collective
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
        self.core = build_trainer(
            self.config, rank, proxies, self.partitioner.owner, num_nodes, edge_dim, sharded,
            gather=ray.get,
        )  # fmt: skip
        self.collective = None

    def connect(self, address: tuple[str, int], generation: int) -> int:
        """Join the trainer group of `generation` (all ranks call this together)."""
        timeout = self.config.cluster.collective_timeout_s
        self.collective = Collective(address, generation, self.rank, self.world, timeout)
        return self.rank

    def ingested(self, num_nodes: int, num_rows: int, partition: dict | None) -> None:
        """After shards ingested a batch: grow node tables, know the new feature rows and,
        for a stateful partitioner, the new node placements."""
        if partition is not None:
            self.partitioner.load_state_dict(partition)
        if self.core.edge_cache is not None:
            self.core.edge_cache.store.set_num_rows(num_rows)
        self.core.grow(num_nodes)

    def train_and_step(self, ev, weight, neg, num_observe: int, global_size: int):
        return self.core.train_and_step(ev, weight, neg, num_observe, global_size,
                                        self.collective)  # fmt: skip

    def eval_slice(self, ev, neg, observe: bool):
        return self.core.eval_slice(ev, neg, observe)

    def apply_updates(self, *updates) -> None:
        self.core.apply_updates(list(updates))

    def call(self, method: str, *args):
        """Any other `TrainerCore` method (state, node state, optimizer, cache)."""
        return getattr(self.core, method)(*args)

    def grad_values(self) -> int:
        return self.core.optimizer.flat.numel()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def cache_stats(self) -> dict | None:
        cache = self.core.edge_cache
        return None if cache is None else cache.stats()

    def model_state(self) -> dict:
        return self.core.model_state()


TrainerActor = ray.remote(_Trainer)
