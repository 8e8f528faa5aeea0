"""Placing a Ray group: placement groups (slots), actor factories, the bounded wait, GCS reads.

Shards go in one SPREAD placement group (a bundle of `cluster.shard_cpus` each) or in slots of
their own; each trainer has a PACK slot of its own (`cluster.trainer_cpus`, and a GPU on CUDA),
so a resize or a replacement gives back or asks for exactly one trainer's resources. Every
bundle carries the section's custom resources too (`cluster.trainer_resources`,
`cluster.shard_resources`: which nodes may hold trainers, shards), and so does its actor. The
helpers here read what the GCS knows: where a slot's bundles are, which nodes Ray is draining,
whether an actor is alive; and turn an actor's failure in its constructor into the earliest
`ValueError` behind it. Nothing here decides anything: the other parts of `RayGroup` ask.
"""

from __future__ import annotations

import logging
import math
import re
import time

import ray
import torch
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tidegraph.actors import TrainerActor
from tidegraph.actors.shard import PartHandle, ShardHostActor
from tidegraph.training.groupcore import shard_args

__all__ = [
    "Placement",
    "value_error",
    "actor_of",
    "actor_state",
    "trainer_bounds",
    "trainer_bundle",
    "shard_bundle",
    "shard_bounds",
    "replica_count",
    "spare_count",
    "poll_s",
    "draining_nodes",
    "slot_table",
    "slot_node",
    "PlacementTimeout",
]

log = logging.getLogger(__name__)


def value_error(exc: Exception) -> str | None:
    """The message of the ValueError at the root of an actor's failure, if one is (Ray keeps
    only text: an actor that died waiting on a failed one carries that one's traceback)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.findall(r"^ValueError: (.+)$", text, re.MULTILINE)
    return found[-1] if found else None


def actor_of(handle):
    """The actor behind a handle (a shard's `PartHandle`: its host)."""
    return handle.actor if isinstance(handle, PartHandle) else handle


def actor_state(actor) -> str:
    """The GCS's state of `actor` ("ALIVE", "DEAD", ...). Ray offers it publicly only through
    the dashboard's state API (not always running), so this asks the GCS table directly."""
    from ray._private import state

    return state.actors(actor_id=actor_of(actor)._actor_id.hex())["State"]


def trainer_bounds(c) -> tuple[int, int]:
    """(min, max) trainers of a run: `cluster.trainers` as an int fixes both."""
    lo = getattr(c, "min_trainers", None) or c.trainers
    hi = getattr(c, "max_trainers", None) or c.trainers
    return lo, hi


def trainer_gpu_share(c, cluster_gpus: float) -> float:
    """GPUs per trainer on CUDA: `cluster.trainer_gpus` when set; else 1 when the cluster has
    a GPU for each trainer slot (the most trainers plus spares), else 1 / k with k trainers
    per GPU (k rounded up: 3 GPUs for 4 trainers give 2 a GPU, since Ray packs fractions on
    one GPU each). A cluster with no GPU yet gets 1 (an autoscaler may add GPU nodes; the
    placement error names what is missing)."""
    if getattr(c, "trainer_gpus", None):
        return float(c.trainer_gpus)
    slots = trainer_bounds(c)[1] + getattr(c, "spare_trainers", 0)
    gpus = int(cluster_gpus)
    if gpus < 1 or gpus >= slots:
        return 1.0
    return 1.0 / math.ceil(slots / gpus)


def trainer_bundle(c, gpus: float = 0.0) -> dict:
    """One trainer's bundle: `cluster.trainer_cpus`, its GPU share (`gpus`, on CUDA) and
    `cluster.trainer_resources`."""
    return {"CPU": c.trainer_cpus, **({"GPU": gpus} if gpus else {}), **c.trainer_resources}


def shard_bundle(c) -> dict:
    """One shard actor's bundle: `cluster.shard_cpus` and `cluster.shard_resources`."""
    return {"CPU": c.shard_cpus, **c.shard_resources}


def shard_bounds(c) -> tuple[int, int]:
    """(min, max) shard actors of a run; P = max partitions."""
    lo = getattr(c, "min_shards", None) or c.shards
    hi = getattr(c, "max_shards", None) or c.shards
    return lo, hi


def replica_count(c) -> int:
    return getattr(c, "shard_replicas", 1)


def spare_count(c) -> int:
    return getattr(c, "spare_trainers", 0)


def poll_s(c) -> float:
    return getattr(c, "elastic_poll_s", 1.0)


def draining_nodes() -> dict[str, int]:
    """{node id: deadline in ms since the epoch, 0 for none} of the nodes Ray is draining
    (`ray drain-node`, an autoscaler's preemption notice)."""
    from ray._private import state

    return state.state.get_draining_nodes()


def slot_table(pg) -> dict:
    """The GCS's record of a placement group (its state, the node of each bundle)."""
    from ray.util import placement_group_table

    return placement_group_table(pg)


def slot_node(pg, bundle: int = 0) -> str | None:
    """The node bundle `bundle` of a placement group is on (None while pending)."""
    return slot_table(pg).get("bundles_to_node_id", {}).get(bundle)


class PlacementTimeout(RuntimeError):
    """The cluster did not offer the resources a group needs within the wait."""


class Placement:
    """The actor factories and the wait for the group's first placement (a `RayGroup` part)."""

    def _new_shard(self, p: int, slot: tuple | None = None, name: str | None = None):
        """A shard actor holding partition `p` alone, in its slot (a placement group and
        bundle index; default: the partition's); its handle for `p`."""
        slot = self.shard_slots[p] if slot is None else slot
        return PartHandle(self._new_host([p], slot, name or f"tidegraph-shard-{p}"), p)

    def _new_host(self, parts: list[int], slot: tuple, name: str):
        """A shard actor holding partitions `parts` (empty ones), in `slot`."""
        pg, bundle = slot
        c = self.config.cluster
        return ShardHostActor.options(
            name=name, num_cpus=c.shard_cpus, resources=dict(c.shard_resources),
            namespace=self.namespace, lifetime=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, bundle),
        ).remote(self._runtime(min(parts, default=0)),
                 {p: self._part_args(p) for p in parts})  # fmt: skip

    def _part_args(self, p: int) -> tuple[tuple, dict]:
        """(args, kwargs) of partition `p`'s `ShardCore` (its seeds are the partition's, so
        it samples and rounds the same on any actor)."""
        edge_dim, _ = self._shard_args
        return shard_args(self.config, p, edge_dim,
                          self._state_model(edge_dim) if self.sharded else None)  # fmt: skip

    def _slot(self):
        """A placement group for one trainer (pending until Ray finds room for it)."""
        return placement_group([self.trainer_bundle], strategy="PACK")

    def _new_trainer(
        self, w: int, num_nodes: int | None = None, member: int | None = None, world=None
    ):
        """Trainer actor of rank `w` of `world` (default: the group's size), in its member's
        placement group (`member`: a new one, whose group is in `member_slots`), with tables
        for `num_nodes` nodes (default: as many as ingested)."""
        c = self.config.cluster
        raw, edge_dim = self._trainer_args
        member = self.members[w] if member is None else member
        where = PlacementGroupSchedulingStrategy(self.member_slots[member], 0)
        incarnation = self.incarnations[w] if w < len(self.incarnations) else 0
        deadline = time.monotonic() + self.name_wait_s
        while True:
            try:
                return TrainerActor.options(
                    name=f"tidegraph-trainer-{member}", num_cpus=c.trainer_cpus,
                    num_gpus=self.trainer_gpus, resources=dict(c.trainer_resources),
                    namespace=self.namespace, lifetime=None, scheduling_strategy=where,
                ).remote(
                    self._runtime(w), raw, w, self.num_trainers if world is None else world,
                    self.shards, self.num_nodes if num_nodes is None else num_nodes,
                    edge_dim, self.sharded, incarnation,
                )  # fmt: skip
            except ray.exceptions.ActorAlreadyExistsError:
                # a lost trainer's name is released once the GCS marks it dead: bounded wait
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def _runtime(self, rank: int) -> dict:
        c = self.config
        return {"seed": c.seed, "rank": rank, "deterministic": c.deterministic,
                "threads": c.threads}  # fmt: skip

    def _state_model(self, edge_dim: int):
        from tidegraph.models.config import build_model

        with torch.random.fork_rng(devices=[]):
            snaps = self.config.sampler.num_snapshots
            return build_model(self.config.model, 0, edge_dim, num_snapshots=snaps)

    def _wait_placed(self, trainer_bundle: dict) -> list:
        """Bounded wait for the shards' placement group and at least `min_trainers` trainer
        slots (then briefly for the rest); the slots placed, in order. The log and the error
        name what is missing."""
        deadline = time.monotonic() + self.placement_wait_s
        shards = self.shard_pg.ready()
        ready = {ref: pg for pg in self.slots for ref in [pg.ready()]}
        placed: list = []
        pending = [shards, *ready]
        first = True
        while time.monotonic() < deadline:
            timeout = 0.5 if shards not in pending and len(placed) >= self.min_trainers else 5
            timeout, first = (1.0 if first else timeout), False  # say soon what is missing
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=timeout)
            placed += [ready[ref] for ref in done if ref in ready]
            if shards not in pending and len(placed) >= self.min_trainers:
                return [pg for pg in self.slots if any(pg is q for q in placed)]
            log.info(
                "waiting for resources: %d of %d..%d trainers x %s placed, %d shard actors x "
                "%s %s; the cluster has %s available",
                len(placed), self.min_trainers, self.max_trainers, trainer_bundle,
                self.min_shards * self.num_copies, self.shard_bundle,
                "placed" if shards not in pending else "not placed",
                ray.available_resources(),
            )  # fmt: skip
        self.shutdown()
        raise PlacementTimeout(
            f"could not place {self.min_trainers} trainers x {trainer_bundle} and "
            f"{self.min_shards * self.num_copies} shard actors x {self.shard_bundle} "
            f"within {self.placement_wait_s:.0f} s "
            f"({len(placed)} trainers placed); available: {ray.available_resources()}"
        )
