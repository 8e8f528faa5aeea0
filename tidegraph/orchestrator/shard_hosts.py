"""Elastic shard-actor counts: P partitions dealt over between `min` and `max` shard actors.

Hosts start in slots Ray places as room appears (`elastic.policy.spare_slots`); hosts on
draining nodes and hosts beyond the wanted count leave (`elastic.policy.plan_shard_leavers`),
and partitions move so that each host holds its share (`elastic.policy.plan_parts`), each
copied and checked by event count at a step boundary.
"""

from __future__ import annotations

import contextlib
import logging
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from tidegraph.actors.shard import PartHandle
from tidegraph.elastic.policy import (
    free_bundles,
    plan_parts,
    plan_shard_leavers,
    spare_slots,
)
from tidegraph.orchestrator.placement import slot_node, slot_table

__all__ = ["ShardHosts"]

log = logging.getLogger(__name__)


class ShardHosts:
    """The number of shard actors and the partitions each holds (a `RayGroup` part)."""

    def resize_shards(self, count: int, who: str = "operator") -> None:
        """Set the wanted number of shard actors (within [min, max] shards) and change it
        as far as Ray has room now (fewer: at once; more: as their slots are placed)."""
        if not self.min_shards <= count <= self.max_shards:
            raise ValueError(f"shards must be within cluster min/max [{self.min_shards}, "
                             f"{self.max_shards}], got {count}")  # fmt: skip
        ray.get(self.coordinator.want_shards.remote(count, who))
        self.drain()
        self._resize_if_due(force=True)

    def _top_up_shards(self) -> None:
        """Keep a pending slot per shard actor the run lacks toward its target (Ray places
        them as room appears, and a host starts in each); drop those beyond it. Before the
        first actors start, the run has its minimum in the SPREAD group."""
        started = bool(getattr(self, "shards", None))
        have = len(self._shard_hosts()) if started else self.min_shards
        want = spare_slots(self.shard_target, have, len(self.shard_joiners))
        free = self._free_bundles() if started else []
        while len(self.shard_spares) < want:  # bundles of the SPREAD group no actor uses first
            slot = (
                (self.shard_pg, free.pop(0)) if free else (placement_group([self.shard_bundle]), 0)
            )
            self.shard_spares.append(slot)
        while len(self.shard_spares) > want:
            pg, _ = self.shard_spares.pop()
            if pg is not self.shard_pg:  # a bundle of the SPREAD group stays reserved
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)

    def _free_bundles(self) -> list[int]:
        """Bundles of the shards' SPREAD group that hold no shard actor, replica, spare slot
        or starting actor (an actor that left gave its bundle back to the run)."""
        taken = [*self.shard_slots, *(x for slots in self.replica_slots for x in slots),
                 *self.shard_spares, *(j[0] for j in self.shard_joiners.values())]  # fmt: skip
        return list(free_bundles(taken, self.shard_pg, self.min_shards * self.num_copies))

    def _shard_joiners_up(self, draining) -> list[tuple]:
        """Hosts started in spare shard slots that are up (to take partitions over at a
        step boundary). Starts one in each slot Ray placed; drops ones that failed."""
        for slot in list(self.shard_spares):
            table = slot_table(slot[0])
            node = table.get("bundles_to_node_id", {}).get(slot[1])
            if table.get("state") != "CREATED" or node is None or node in draining:
                continue
            self.shard_spares.remove(slot)
            actor = self._new_host([], slot, f"tidegraph-shard-host-{next(self._hosts_named)}")
            self.shard_joiners[(id(slot[0]), slot[1])] = (slot, actor, actor.parts.remote())
            log.info("starting a shard actor on node %s to take partitions over", node)
        up = []
        for key, (slot, actor, ref) in list(self.shard_joiners.items()):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                ray.get(ref)
                up.append((slot, actor))
            except ray.exceptions.RayError as exc:
                log.warning("a shard actor starting to take partitions failed (%s)", exc)
                del self.shard_joiners[key]
                self._release_host(actor, slot)
        self._top_up_shards()
        return up

    def _shard_leavers(self, draining) -> tuple[tuple[str, ...], int]:
        """Hosts that should hand their partitions over now: those on draining nodes (while
        a host elsewhere can take them), then beyond the wanted count those in slots of
        their own holding fewest partitions; and how many of them are draining
        (`elastic.policy.plan_shard_leavers`)."""
        hosts = {key: (slot_node(*slot), slot[0] is self.shard_pg, len(parts))
                 for key, (_, slot, parts) in self._shard_hosts().items()}  # fmt: skip
        return plan_shard_leavers(hosts, draining, self.shard_target)

    def _reshard(self, joining: list[tuple], leaving: list[str], reason: str, at: str) -> None:
        """Move partitions so that hosts `leaving` hold none and `joining` ones (slot, actor)
        take their share (`elastic.policy.plan_parts`), at a step boundary: each partition's
        state is copied to its new host, which must hold as many events, then trainers send
        it their requests there and the old host drops it (and goes when it holds none)."""
        t0 = time.perf_counter()
        self.drain()
        self._flush()
        hosts = self._shard_hosts()
        old_count = len(hosts)
        sizes = dict(enumerate(r["events"] for r in ray.get(
            [s.report.remote() for s in self.shards])))  # fmt: skip
        new = {actor._actor_id.hex(): (actor, slot) for slot, actor in joining}
        moves = plan_parts({k: v[2] for k, v in hosts.items()}, sizes, set(leaving), list(new))
        target = {k: (v[0], v[1]) for k, v in hosts.items()} | new
        refs = [target[dst][0].add_part.remote(q, *self._part_args(q),
                                               self.shards[q].state_dict.remote())
                for q, _, dst in moves]  # fmt: skip
        held = ray.get(refs)
        for (q, _, _), got in zip(moves, held, strict=True):
            if got["events"] != sizes[q]:
                raise RuntimeError(f"partition {q} copied to another shard actor holds "
                                   f"{got['events']} events, the shard {sizes[q]}")  # fmt: skip
        nodes = self._shard_nodes()
        old = [(self.shards[q], self.shard_slots[q]) for q, _, _ in moves]
        for q, _, dst in moves:
            self.shards[q], self.shard_slots[q] = PartHandle(target[dst][0], q), target[dst][1]
        for slot, _ in joining:
            del self.shard_joiners[(id(slot[0]), slot[1])]
        self._point_trainers([q for q, _, _ in moves])
        self._refresh(self.num_nodes, recovering=True)
        for handle, slot in old:
            self._release(handle, slot)
        for key, (actor, slot) in new.items():  # more hosts than partitions: not needed
            if not any(dst == key for _, _, dst in moves):
                self._release_host(actor, slot)
        now = self._shard_nodes()
        for q, _, _ in moves:
            self.shard_moves.append({"part": q, "from_node": nodes[q], "to_node": now[q],
                                     "events": sizes[q], "at": at, "reason": reason,
                                     "time": time.time()})  # fmt: skip
        count = len(self._shard_hosts())
        event = {"from": old_count, "to": count, "moves": len(moves), "reason": reason,
                 "at": at, "seconds": time.perf_counter() - t0, "time": time.time()}  # fmt: skip
        self.shard_resizes.append(event)
        self._trace_event("shard resize", t0, event)
        self._top_up_shards()
        self._publish()
        log.warning("shards at %s: %d -> %d actors (%s); %d partitions moved; %.2f s", at,
                    old_count, count, reason, len(moves), event["seconds"])  # fmt: skip
