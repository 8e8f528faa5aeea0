"""`GraphShardActor`: a `ShardCore` in its own process; `RemoteShard`: its proxy for trainers."""

from __future__ import annotations

import os

import ray

from tidegraph.actors.segments import SegmentPublisher
from tidegraph.runtime import set_determinism
from tidegraph.training.shard import ShardCore

__all__ = ["GraphShardActor", "RemoteShard"]


class _Shard(ShardCore):
    """The core, after the process-wide switches of this actor's process."""

    def __init__(self, runtime: dict, *args, **kwargs) -> None:
        set_determinism(**runtime)
        super().__init__(*args, **kwargs)
        self._publisher = SegmentPublisher()

    def segment_refs(self) -> list:
        """Object-store refs of this shard's segments (published once each, zero-copy)."""
        return self._publisher.refs(self.graph.segments)

    def ping(self) -> int:
        return self.part

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def apply_state_of(self, *updates) -> None:
        """`apply_state` with each slice's updates as an argument (object refs resolve)."""
        self.apply_state(list(updates))


GraphShardActor = ray.remote(_Shard)


class RemoteShard:
    """The hop-sampler / feature / node-state interface of a shard actor, answering with
    object refs (a `MultiHopSampler`, `ShardedFeatureStore` or `ShardedStateSource` built with
    `gather=ray.get` waits for all shards' answers of a request at once)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def sample_hop(self, roots, t_hi, k, t_lo=None):
        return self.handle.sample_hop.remote(roots, t_hi, k, t_lo)

    def fetch(self, eids, int8: bool = False):
        return self.handle.fetch.remote(eids, int8)

    def read_state(self, ids, names=None):
        return self.handle.read_state.remote(ids, names)
