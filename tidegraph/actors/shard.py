"""Shard actors and their handles.

- `GraphShardActor`: one `ShardCore` in its own process.
- `ShardHostActor`: the partitions one shard actor holds, each a `ShardCore`. With elastic
  shard counts (`cluster.shards: {min, max}`) a run has P = max partitions, and as actors
  come and go partitions move between them whole (`add_part` with a copied state, then
  `drop_part` at the old one) at step boundaries, so the partition function, and so every
  sampled neighbour and stored row, never changes.
- `PartHandle`: partition p on a host, used like a shard actor's handle
  (`handle.sample_hop.remote(...)` calls partition p's `sample_hop` there). A request for a
  partition the host does not hold (any more) fails naming both, never answers for another.
- `RemoteShard`: the hop-sampler / feature / node-state interface trainers use, over either.
"""

from __future__ import annotations

import os

import ray

from tidegraph.actors.segments import SegmentPublisher
from tidegraph.runtime import set_determinism
from tidegraph.timeline import wall_us
from tidegraph.training.shard import ShardCore

__all__ = ["GraphShardActor", "PartHandle", "RemoteShard", "ShardHostActor"]


class _Shard(ShardCore):
    """The core, after the process-wide switches of this actor's process."""

    def __init__(self, runtime: dict, *args, **kwargs) -> None:
        set_determinism(**runtime)
        super().__init__(*args, **kwargs)
        self._publisher = SegmentPublisher()

    def segment_refs(self) -> list:
        """Object-store refs of this shard's segments (published once each, zero-copy)."""
        return self._publisher.refs(self.graph)

    def ping(self) -> int:
        return self.part

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def wall_us(self) -> float:
        return wall_us()

    def apply_state_of(self, *updates) -> None:
        """`apply_state` with each slice's updates as an argument (object refs resolve)."""
        self.apply_state(list(updates))


GraphShardActor = ray.remote(_Shard)


class _Part(_Shard):
    """One partition on a host (the process-wide switches are the host's)."""

    def __init__(self, *args, **kwargs) -> None:
        ShardCore.__init__(self, *args, **kwargs)
        self._publisher = SegmentPublisher()


class _Host:
    """The partitions of one shard actor: {p: a `ShardCore` of partition p}."""

    def __init__(self, runtime: dict, parts: dict) -> None:
        """`parts`: {p: (args, kwargs) of partition p's `ShardCore`}."""
        set_determinism(**runtime)
        self.cores: dict[int, _Part] = {}
        for p, (args, kwargs) in parts.items():
            self.add_part(p, args, kwargs)

    def add_part(
        self, p: int, args: tuple, kwargs: dict, state: dict | None = None,
        store: str | None = None,
    ) -> dict:  # fmt: skip
        """Hold partition `p` from now on, with `state` (a copy of its shard's, taken at a
        step boundary; with refs to the checkpoint store at `store`, read from there) or
        empty; its report."""
        core = _Part(*args, **kwargs)
        if state is not None and store is not None:
            core.load_chunks(state, store)
        elif state is not None:
            core.load_state_dict(state)
        self.cores[p] = core
        return core.report()

    def drop_part(self, p: int) -> list[int]:
        """Stop holding partition `p`; the partitions left."""
        self.cores.pop(p, None)
        return sorted(self.cores)

    def call(self, p: int, method: str, *args, **kwargs):
        """Partition `p`'s `method`."""
        core = self.cores.get(p)
        if core is None:
            raise LookupError(
                f"shard actor on node {self.node_id()[:12]} does not hold partition {p} "
                f"(it holds {sorted(self.cores)})"
            )
        return getattr(core, method)(*args, **kwargs)

    def parts(self) -> list[int]:
        return sorted(self.cores)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()


ShardHostActor = ray.remote(_Host)


class _PartMethod:
    __slots__ = ("actor", "method", "part")

    def __init__(self, actor, part: int, method: str) -> None:
        self.actor, self.part, self.method = actor, part, method

    def remote(self, *args, **kwargs):
        return self.actor.call.remote(self.part, self.method, *args, **kwargs)


class PartHandle:
    """Partition `part` on shard host `actor`, with an actor handle's calling convention."""

    def __init__(self, actor, part: int) -> None:
        self.actor, self.part = actor, part

    def __getattr__(self, method: str) -> _PartMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _PartMethod(self.actor, self.part, method)

    def __repr__(self) -> str:
        return f"PartHandle({self.part} on {self.actor._actor_id.hex()[:8]})"


class RemoteShard:
    """The hop-sampler / feature / node-state interface of a shard actor, answering with
    object refs (a `MultiHopSampler`, `ShardedFeatureStore` or `ShardedStateSource` built with
    `gather=ray.get` waits for all shards' answers of a request at once)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def sample_hop(self, roots, t_hi, k, t_lo=None, key=None):
        return self.handle.sample_hop.remote(roots, t_hi, k, t_lo, key)

    def fetch(self, eids, int8: bool = False):
        return self.handle.fetch.remote(eids, int8)

    def read_state(self, ids, names=None, int8: bool = False):
        return self.handle.read_state.remote(ids, names, int8)
