"""The elastic loop of a Ray group: one look at the cluster, one plan, acted on at a step boundary.

Every `cluster.elastic_poll_s` (or now, when forced) the group reads operators' requests from
the coordinator (a wanted trainer count, shard moves, a wanted shard-actor count), which nodes
Ray is draining and which new members, successors and replicas are up, and makes a plan with
the pure rules of `elastic.policy`; `_resize_if_due` then adds replicas, moves shards, deals
partitions over shard actors and resizes the trainers, telling the controller it is resizing.
"""

from __future__ import annotations

import logging
import time

import ray

from tidegraph.elastic.policy import plan_resize
from tidegraph.orchestrator.placement import draining_nodes, poll_s

__all__ = ["Resizing"]

log = logging.getLogger(__name__)


class Resizing:
    """When and how the group's membership changes (a `RayGroup` part)."""

    def _plan(self, force: bool = False) -> tuple:
        """What the group should change now, looked at every `cluster.elastic_poll_s` (or
        now, `force`): the trainers' resize (`elastic.policy`: an operator's wanted count,
        trainers on draining nodes, spare slots Ray placed) and the partitions whose shard
        should move to the successor started for it (its node is draining, or an operator
        asked), once that successor is up, and the partitions with a new replica up; and the
        shard actors' change: (hosts up to join, hosts to leave, why) or None."""
        now = time.monotonic()
        if not force and now < self._next_check:
            return None, [], [], None
        self._next_check = now + poll_s(self.config.cluster)
        wanted, moves, shards = ray.get([self.coordinator.take_wanted.remote(),
                                         self.coordinator.take_moves.remote(),
                                         self.coordinator.take_wanted_shards.remote()])  # fmt: skip
        if shards is not None and shards[0] != self.shard_target:
            log.info("%s wants %d shard actors (now %d)", shards[1], shards[0],
                     len(self._shard_hosts()))  # fmt: skip
            self.shard_target = shards[0]
            self._top_up_shards()
        bad = [p for p in moves if not 0 <= p < self.num_shards]
        if bad:
            log.warning("asked to move shards %s: there are shards 0..%d only", bad,
                        self.num_shards - 1)  # fmt: skip
        self._wanted_moves.update(p for p in moves if 0 <= p < self.num_shards)
        if wanted is not None and wanted[0] != self.target:
            log.info("%s wants %d trainers (now %d)", wanted[1], wanted[0], self.num_trainers)
            self.target = wanted[0]
            self._top_up()
        draining = draining_nodes()
        ranks = {w: n for w, n in enumerate(self._member_nodes()) if n in draining}
        leaving, drained = self._shard_leavers(draining)
        joining = self._shard_joiners_up(draining)
        moves = self._successors_up(draining)
        decision = plan_resize(self.num_trainers, self.target, len(self._joiners_up(draining)),
                               ranks)  # fmt: skip
        reshard = None
        if leaving or joining:
            why = [f"{len(joining)} shard actor{'s' if len(joining) > 1 else ''} up"] if joining \
                else []  # fmt: skip
            if drained:
                why.append(f"{drained} on draining nodes")
            if len(leaving) > drained:
                why.append(f"target {self.shard_target} shard actors")
            reshard = (joining, leaving, "; ".join(why))
        return decision, moves, self._replicas_up(), reshard

    def _resize_if_due(self, force: bool = False, at: str = "between steps") -> None:
        """Resize and move shards now if the group should (at a step boundary, `at`:
        nothing is under way)."""
        decision, moves, adds, reshard = self._plan(force or self._stop_asked)
        self._stop_asked = False
        what = [f"replicas of shards {adds}"] * bool(adds) + [f"shards {moves} move"] * bool(moves)
        what += [f"shard actors: {reshard[2]}"] if reshard is not None else []
        what += [f"trainers: {decision.reason}"] if decision is not None else []
        if not what:
            return
        self._tell("resizing", "; ".join(what))
        try:
            for p in adds:
                self._add_replicas(p)
            for p in moves:
                self._move_shard(p, at)
            if reshard is not None:
                self._reshard(*reshard, at)
            if decision is not None:
                self._resize(decision, at)
        except ray.exceptions.RayError as exc:  # a member lost meanwhile: recover instead
            self.recover(exc)
        self._tell("settled", "resized")
