"""The shard table: which actor holds each partition, its replicas, and moves between nodes.

Partition p is held by the actor behind `shards[p]` (a `PartHandle`), in slot `shard_slots[p]`;
its read-only replicas (`cluster.shard_replicas`) take every write it takes. A partition whose
node is draining, or that an operator asked to move, gets a successor (`elastic.policy.
partitions_to_move`), which copies its state at a step boundary, must hold as many events, and
takes its place; trainers are then pointed at the new handle and the old host goes when it
holds nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from tidegraph.actors.shard import PartHandle
from tidegraph.elastic.policy import partitions_to_move
from tidegraph.orchestrator.placement import PlacementTimeout, actor_of, slot_node

__all__ = ["ShardTable"]

log = logging.getLogger(__name__)


class ShardTable:
    """Partitions, their holders and replicas, and moves (a `RayGroup` part)."""

    def _copies(self, p: int) -> list:
        """Partition `p`'s shard and its replicas (every write goes to all of them)."""
        return [self.shards[p], *self.replicas[p]]

    def _all_copies(self) -> list:
        return [s for p in range(self.num_shards) for s in self._copies(p)]

    def _shard_nodes(self) -> list:
        """Node id of each partition's shard (from its slot, in the GCS)."""
        return [slot_node(pg, i) for pg, i in self.shard_slots]

    def _shard_hosts(self) -> dict[str, tuple]:
        """{host actor id: (actor, slot, its partitions)} of the partitions' shards."""
        hosts: dict[str, tuple] = {}
        for p, handle in enumerate(self.shards):
            key = handle.actor._actor_id.hex()
            hosts.setdefault(key, (handle.actor, self.shard_slots[p], []))[2].append(p)
        return hosts

    def _point_trainers(self, parts: list[int], trainers: list | None = None) -> None:
        """Trainers (all, or these; joiners too) send partitions `parts`' requests to the
        shards' handles now."""
        members = self.trainers if trainers is None else trainers
        ray.get([t.replace_shard.remote(p, self.shards[p]) for t in members for p in parts])
        if trainers is None:
            for _, actor, _ in self.joiners.values():  # queued behind their constructors
                for p in parts:
                    actor.replace_shard.remote(p, self.shards[p])

    def _release(self, old: PartHandle, slot: tuple) -> None:
        """Partition `old.part` left host `old.actor`: a host left with none goes, and its
        slot with it (a bundle of the shards' SPREAD group stays reserved)."""
        try:
            left = ray.get(old.actor.drop_part.remote(old.part))
        except ray.exceptions.RayActorError:
            left = []
        if not left:
            self._release_host(old.actor, slot)

    def _release_host(self, actor, slot: tuple) -> None:
        ray.kill(actor)
        if slot[0] is not self.shard_pg:
            with contextlib.suppress(Exception):
                remove_placement_group(slot[0])

    def _probe_replicas(self) -> list[tuple[int, int]]:
        """Replicas (partition, index) that are dead or do not answer within `probe_s`;
        they are dropped, and a successor for each starts in the background."""
        refs = [(p, i, r.ping.remote()) for p, reps in enumerate(self.replicas)
                for i, r in enumerate(reps)]  # fmt: skip
        ready, _ = ray.wait([x[2] for x in refs], num_returns=len(refs), timeout=self.probe_s)
        lost = []
        for p, i, ref in refs:
            try:
                if ref not in ready:
                    raise TimeoutError
                ray.get(ref)
            except (ray.exceptions.RayActorError, TimeoutError):
                lost.append((p, i))
        for p, i in sorted(lost, reverse=True):
            ray.kill(actor_of(self.replicas[p].pop(i)))
            self.replica_slots[p].pop(i)
        for p in sorted({p for p, _ in lost}):
            self._start_replicas(p)
        return lost

    def _start_replicas(self, p: int) -> None:
        """Start successors so that partition `p` gets back to `shard_replicas` copies; each
        copies the shard at a step boundary once it is up (`_add_replicas`)."""
        wanted = self.num_copies - 1 - len(self.replicas[p])
        starting = self.replica_successors.setdefault(p, [])
        while len(starting) < wanted:
            slot = placement_group([self.shard_bundle])
            serial = len(self.shard_moves) + sum(map(len, self.replica_successors.values()))
            name = f"tidegraph-shard-{p}-r{self.recoveries_left}-{serial}"
            actor = self._new_shard(p, (slot, 0), name=name)
            starting.append((slot, actor, actor.ping.remote()))
            log.info("shard %d: starting a replica to get back to %d copies", p,
                     self.num_copies)  # fmt: skip

    def _replicas_up(self) -> list[int]:
        """Partitions with a replica successor up (to be added at a step boundary)."""
        up = []
        for p, starting in self.replica_successors.items():
            refs = [x[2] for x in starting]
            if refs and ray.wait(refs, num_returns=1, timeout=0)[0]:
                up.append(p)
        return up

    def _add_replicas(self, p: int) -> None:
        """Replica successors of `p` that are up copy the shard (at a step boundary) and
        take writes from now on; one that failed to start is dropped and started again."""
        self.drain()
        self._flush()
        starting, keep = self.replica_successors.get(p, []), []
        for slot, actor, ref in starting:
            if not ray.wait([ref], timeout=0)[0]:
                keep.append((slot, actor, ref))
                continue
            try:
                ray.get(ref)
                ray.get(actor.load_state_dict.remote(self.shards[p].state_dict.remote()))
                held, had = ray.get([actor.report.remote(), self.shards[p].report.remote()])
                if held["events"] != had["events"]:
                    raise RuntimeError(f"replica of shard {p} holds {held['events']} events, "
                                       f"the shard {had['events']}")  # fmt: skip
            except ray.exceptions.RayActorError as exc:
                log.warning("a replica of shard %d failed to start (%s)", p, exc)
                ray.kill(actor_of(actor))
                with contextlib.suppress(Exception):
                    remove_placement_group(slot)
                continue
            self.replicas[p].append(actor)
            self.replica_slots[p].append((slot, 0))
            log.info("shard %d: replica added (%d events); %d copies", p, held["events"],
                     1 + len(self.replicas[p]))  # fmt: skip
        self.replica_successors[p] = keep
        self._start_replicas(p)

    def move_shard(self, p: int, wait_s: float = 120.0) -> None:
        """Move partition `p` to a new shard actor wherever Ray has room (an operator's
        move; a draining node's shards move by themselves): its successor starts, copies
        the shard's state at a step boundary and takes its place."""
        self._wanted_moves.add(p)
        deadline = time.monotonic() + wait_s
        while p in self._wanted_moves:
            self.drain()
            self._resize_if_due(force=True, at="an operator's shard move")
            if time.monotonic() > deadline:
                raise PlacementTimeout(f"shard {p}: no successor up within {wait_s:.0f} s")
            time.sleep(0.01)

    def _successors_up(self, draining) -> list[int]:
        """Partitions whose successor shard is up. Starts a successor (in a slot of its own,
        which Ray places off draining nodes) for each partition on a draining node or asked
        to move; a successor that failed is dropped (and started again at the next look)."""
        up = []
        nodes = self._shard_nodes()
        for p in partitions_to_move(nodes, draining, self._wanted_moves):
            node = nodes[p]
            successor = self.shard_successors.get(p)
            if successor is None:
                slot = placement_group([self.shard_bundle])
                serial = len(self.shard_moves) + len(self.shard_successors) + 1
                actor = self._new_shard(p, (slot, 0), name=f"tidegraph-shard-{p}-{serial}")
                self.shard_successors[p] = (slot, actor, actor.ping.remote())
                log.info("shard %d on node %s: starting its successor to move to", p, node)
                continue
            if ray.wait([successor[2]], timeout=0)[0]:
                try:
                    ray.get(successor[2])
                    up.append(p)
                except ray.exceptions.RayError as exc:
                    log.warning("shard %d's successor failed to start (%s)", p, exc)
                    self._drop_successor(p)
        return up

    def _drop_successor(self, p: int) -> None:
        slot, actor, _ = self.shard_successors.pop(p)
        ray.kill(actor_of(actor))
        with contextlib.suppress(Exception):
            remove_placement_group(slot)

    def _move_shard(self, p: int, at: str) -> None:
        """Partition `p` to its successor, at a step boundary: the successor copies the
        shard's state (events, features, sampler, node state it owns) and must hold as many
        events; trainers then send it their requests, and the old shard goes."""
        t0 = time.perf_counter()
        self.drain()
        self._flush()
        slot, new, _ = self.shard_successors[p]
        old = self.shards[p]
        ray.get(new.load_state_dict.remote(old.state_dict.remote()))
        held, had = ray.get([new.report.remote(), old.report.remote()])
        if held["events"] != had["events"]:
            self._drop_successor(p)
            raise RuntimeError(f"shard {p}'s successor holds {held['events']} events, the "
                               f"shard {had['events']}")  # fmt: skip
        del self.shard_successors[p]
        nodes = self._shard_nodes()
        old_slot, self.shard_slots[p] = self.shard_slots[p], (slot, 0)
        self.shards[p] = new
        self._point_trainers([p])
        self._refresh(self.num_nodes, recovering=True)
        self._release(old, old_slot)
        self._wanted_moves.discard(p)
        event = {"part": p, "from_node": nodes[p], "to_node": self._shard_nodes()[p],
                 "events": held["events"], "at": at, "seconds": time.perf_counter() - t0,
                 "time": time.time()}  # fmt: skip
        self.shard_moves.append(event)
        self._trace_event("partition move", t0, event)
        self._publish()
        log.warning("shard %d moved at %s from node %s to %s (%d events); %.2f s", p, at,
                    str(event["from_node"])[:12], str(event["to_node"])[:12], held["events"],
                    event["seconds"])  # fmt: skip
