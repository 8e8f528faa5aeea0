"""The trainer roster: members, their slots, spares and joiners, ranks, the collective group.

Trainer w is member `members[w]` (its actor's name) in placement group `member_slots[member]`;
a resize renumbers ranks, never members. Spare slots are kept pending toward the target count
(`elastic.policy.spare_slots`) and a trainer starts in each slot Ray places, while the group
trains; it joins at a step boundary by copying a replica (no checkpoint). Every change of
membership is a new generation of the trainers' collective group.
"""

from __future__ import annotations

import contextlib
import logging
import time

import ray
from ray.util.placement_group import remove_placement_group

from tidegraph.elastic.policy import (
    ResizeDecision,
    renumber,
    scaled,
    spare_slots,
    stays,
)
from tidegraph.orchestrator.placement import (
    PlacementTimeout,
    draining_nodes,
    slot_node,
    slot_table,
    spare_count,
)

__all__ = ["TrainerRoster"]

log = logging.getLogger(__name__)


class TrainerRoster:
    """Trainer membership: resize, spares, joiners, replacements, ranks (a `RayGroup` part)."""

    def _connect(self) -> None:
        """Every trainer joins the group of a new membership generation (a fresh prefix of
        the group's store)."""
        self.generation += 1
        address = self.store_address
        ray.get([t.connect.remote(address, self.generation, self.coordinator, self.progress_s)
                 for t in self.trainers])  # fmt: skip
        if self.update_log[1] or self.update_log[2]:  # rank 0 (maybe a new one) writes it
            ray.get([t.set_update_log.remote(*self.update_log) for t in self.trainers])
        self._scale()

    def _scale(self) -> None:
        """Global batch and learning rate for the group's size (`cluster.scale_rule`); new
        members copied a replica's optimizer, and every member gets the rate again."""
        c, t = self.config.cluster, self.config.train
        rule = getattr(c, "scale_rule", "keep_batch")
        self.train_batch_size, lr = scaled(rule, t.batch_size, t.lr, self.start_trainers,
                                           self.num_trainers)  # fmt: skip
        if rule != "keep_batch":
            ray.get([m.set_lr.remote(lr) for m in self.trainers])
            self.lr = lr

    def set_update_log(self, directory: str | None, every: int, replay=()) -> None:
        """Log every `every`-th training step to `directory` (`recovery.updatelog`) and
        replay the steps in `replay` from it instead of computing them."""
        self.update_log = (directory, every, tuple(replay))
        ray.get([t.set_update_log.remote(*self.update_log) for t in self.trainers])

    def replay_stats(self) -> dict:
        """Trainer 0's steps replayed from the update log (and seconds), records logged."""
        return self._robust(lambda: ray.get(self.trainers[0].replay_stats.remote()))

    def resize(self, trainers: int, who: str = "operator") -> None:
        """Set the wanted trainer count (within [min, max] trainers) and resize at once."""
        if not self.min_trainers <= trainers <= self.max_trainers:
            raise ValueError(
                f"trainers must be within cluster min/max [{self.min_trainers}, "
                f"{self.max_trainers}], got {trainers}"
            )
        ray.get(self.coordinator.want_trainers.remote(trainers, who))
        self.drain()
        self._resize_if_due(force=True)

    def _resize(self, d: ResizeDecision, at: str = "between steps") -> None:
        """Apply `d` at a step boundary: new members copy a replica (no checkpoint), members
        that leave are stopped and their slots given back, the rest are renumbered, and the
        group is rebuilt on a new generation. Slices follow the new size from the next step
        (the global batch is kept, so results do not depend on the size)."""
        t0 = time.perf_counter()
        self.drain()
        self._flush()  # node-state updates reach the current members before a copy is taken
        old, leave = self.num_trainers, set(d.leave)
        slots = self._joiners_up(draining_nodes())[: d.join]
        keep = stays(old, leave, len(slots))
        if keep is not None:  # a joiner failed meanwhile: one stays
            leave.discard(keep)
        stay = [w for w in range(old) if w not in leave]
        world = len(stay) + len(slots)
        source = self.trainers[stay[0] if stay else min(leave)]
        new = [self.joiners[id(slot)][:2] for slot in slots]
        if new:  # they started while the group trained: now they copy a replica
            state = source.replica_state.remote()
            num_nodes = ray.get(source.nodes.remote())  # its tables' size, then its state
            ray.get([actor.call.remote("grow", num_nodes) for _, actor in new])
            ray.get([actor.load_replica.remote(state, []) for _, actor in new])
        for slot in slots:
            self.spares.remove(slot)
            del self.joiners[id(slot)]
        nodes = self._member_nodes()
        left = [{"rank": w, "member": self.members[w], "node": nodes[w]} for w in sorted(leave)]
        for w in sorted(leave):
            ray.kill(self.trainers[w])
            remove_placement_group(self.member_slots.pop(self.members[w]))
        self.trainers, self.members, self.incarnations = renumber(
            stay, self.trainers, self.members, self.incarnations, new)  # fmt: skip
        self.num_trainers = world
        ray.get([t.set_rank.remote(r, world) for r, t in enumerate(self.trainers)])
        if new:
            self._refresh(self.num_nodes, [a for _, a in new], recovering=True)
        self._connect()
        self._top_up()
        event = {
            "from": old, "to": world,
            "left": left,
            "joined": [m for m, _ in new], "reason": d.reason, "at": at,
            "generation": self.generation, "seconds": time.perf_counter() - t0,
            "time": time.time(),
        }  # fmt: skip
        self.resizes.append(event)
        self._trace_event("resize", t0, event)
        self._publish()
        log.warning("resize at %s: %d -> %d trainers (%s); left %s, joined as members %s; "
                    "%.2f s", at, old, world, d.reason, event["left"], event["joined"],
                    event["seconds"])  # fmt: skip

    def _member_nodes(self) -> list:
        """Node id of each trainer's slot (from the GCS: no call to a busy trainer)."""
        return [slot_node(self.member_slots[m]) for m in self.members]

    def _joiners_up(self, draining) -> list:
        """Spare slots whose trainer is up and may join. Starts a trainer in each spare
        slot Ray has placed (a process start takes seconds; the group trains meanwhile);
        drops one that failed or whose node is draining (its slot is replaced)."""
        up = []
        for slot in list(self.spares):
            table = slot_table(slot)
            node = table.get("bundles_to_node_id", {}).get(0)
            joiner = self.joiners.get(id(slot))
            if node in draining or (joiner is None and table.get("state") != "CREATED"):
                if node in draining:
                    self._drop_spare(slot)
                continue
            if joiner is None:
                member, self.next_member = self.next_member, self.next_member + 1
                self.member_slots[member] = slot
                actor = self._new_trainer(self.num_trainers, member=member,
                                          world=self.num_trainers + 1)  # fmt: skip
                joiner = self.joiners[id(slot)] = (member, actor, actor.pid.remote())
                log.info("starting trainer (member %d) on node %s to join the group",
                         member, node)  # fmt: skip
            if ray.wait([joiner[2]], timeout=0)[0]:
                try:
                    ray.get(joiner[2])
                    up.append(slot)
                except ray.exceptions.RayError as exc:
                    log.warning("a trainer starting to join failed (%s); its slot is "
                                "replaced", exc)  # fmt: skip
                    self._drop_spare(slot)
        self._top_up()
        return up

    def _drop_spare(self, slot) -> None:
        """Give a spare slot back (and kill the trainer starting in it)."""
        joiner = self.joiners.pop(id(slot), None)
        if joiner is not None:
            ray.kill(joiner[1])
            self.member_slots.pop(joiner[0], None)
        self.spares.remove(slot)
        with contextlib.suppress(Exception):
            remove_placement_group(slot)

    def _top_up(self) -> None:
        """Keep one spare slot per trainer the group lacks toward its target (Ray places
        them as resources appear, and a trainer starts in each); drop spares beyond it."""
        want = spare_slots(self.target, self.num_trainers, spares=spare_count(self.config.cluster))
        while len(self.spares) < want:
            self.spares.append(self._slot())
        while len(self.spares) > want:
            self._drop_spare(self.spares[-1])

    def _publish(self) -> None:
        """The membership, where operators (`tidegraph.jobs.resize`) read it."""
        self.coordinator.publish.remote({
            "trainers": self.num_trainers, "min": self.min_trainers, "max": self.max_trainers,
            "shards": self.num_shards, "shard_moves": len(self.shard_moves),
            "shard_actors": len(self._shard_hosts()), "shards_min": self.min_shards,
            "shards_max": self.max_shards, "shard_target": self.shard_target,
            "target": self.target, "spares": len(self.spares), "generation": self.generation,
            "resizes": len(self.resizes),
            "last_resize": self.resizes[-1] if self.resizes else None,
        })  # fmt: skip

    def _drop_ranks(self, ranks: list[int], reason: str) -> None:
        """Take lost `ranks` out of the group (their slots are gone) and renumber the rest;
        a pending slot per missing trainer is asked for, to grow back when Ray places it."""
        old = self.num_trainers
        keep = [w for w in range(old) if w not in ranks]
        left = [{"rank": w, "member": self.members[w]} for w in ranks]
        self.trainers, self.members, self.incarnations = renumber(
            keep, self.trainers, self.members, self.incarnations)  # fmt: skip
        self.num_trainers = len(keep)
        ray.get([t.set_rank.remote(r, self.num_trainers) for r, t in enumerate(self.trainers)])
        self._top_up()
        event = {"from": old, "to": self.num_trainers, "left": left, "joined": [],
                 "reason": reason, "at": "recovery", "seconds": 0.0,
                 "time": time.time()}  # fmt: skip
        self.resizes.append(event)
        log.warning("resize in recovery: %d -> %d trainers (%s)", old, self.num_trainers, reason)

    def _probe(self) -> list[int]:
        """Ranks of trainers that are dead, or do not answer within `probe_s` (hung: in a
        collective that waits for a dead peer, say); those are killed."""
        refs = [t.pid.remote() for t in self.trainers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.probe_s)
        lost = []
        for w, ref in enumerate(refs):
            if ref not in ready:
                ray.kill(self.trainers[w])
                lost.append(w)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                lost.append(w)
        return lost

    def _replacement(self, w: int, num_nodes: int, may_shrink: bool = False) -> tuple | None:
        """A trainer for the lost rank `w`, and whether it is a spare: one already up
        (`cluster.spare_trainers`, or one starting to join) takes the rank without a process
        start; else a new one starts in a new slot (the lost one's may be on a node that
        died, whose bundles Ray moves only once it declares the node dead). None: no slot
        was placed within `replace_wait_s` and the group may shrink (above its minimum)."""
        up = self._joiners_up(draining_nodes())
        if not up:
            member = self.members[w]
            with contextlib.suppress(Exception):
                remove_placement_group(self.member_slots.pop(member))
            slot = self._slot()
            wait = self.replace_wait_s if may_shrink else self.placement_wait_s
            if not ray.wait([slot.ready()], timeout=wait)[0]:
                remove_placement_group(slot)
                if may_shrink:
                    return None
                raise PlacementTimeout(
                    f"no room for a replacement of trainer {w} x {self.trainer_bundle} within "
                    f"{wait:.0f} s (cluster min trainers {self.min_trainers}); available: "
                    f"{ray.available_resources()}"
                )
            self.member_slots[member] = slot
            return self._new_trainer(w, num_nodes=num_nodes), False
        slot = up[0]
        member, actor, _ = self.joiners.pop(id(slot))
        self.spares.remove(slot)
        with contextlib.suppress(Exception):  # the lost member's slot (maybe on a dead node)
            remove_placement_group(self.member_slots.pop(self.members[w]))
        self.members[w] = member
        ray.get([actor.set_rank.remote(w, self.num_trainers, self.incarnations[w]),
                 actor.call.remote("grow", num_nodes)])  # fmt: skip
        log.info("spare trainer (member %d) replaces rank %d", member, w)
        self._top_up()
        return actor, True
