"""Trainer recovery without rollback: lost trainers replaced from a live replica.

After a failure the group probes its trainers and shards, decides what to do
(`recovery.policy.triage_recovery`: a real error, no replica left, or recover), rebuilds lost
shards first (`shard_recovery`), replaces each lost trainer (a spare, or a new actor in a new
slot; above the minimum the group may shrink instead), brings every trainer behind the most
advanced survivor to it (`recovery.policy.plan_trainer_recovery`) and rebuilds the collective
group. No checkpoint is read and no finished step is repeated. Each recovery spends the budget
(`recovery.budget.RecoveryBudget`); a failure during one is recovered again (`retrying`).
"""

from __future__ import annotations

import logging
import time

import ray

from tidegraph.orchestrator.pipeline import group_failure
from tidegraph.recovery.policy import NoReplicaLeft, plan_trainer_recovery, triage_recovery

__all__ = ["TrainerRecovery", "retrying"]

log = logging.getLogger(__name__)


def retrying(recover, cause: Exception):
    """`recover(cause)`, and again with the new failure when another actor fails during it
    (bounded: recovery spends `cluster.max_recoveries`); `cause` itself raised means there
    was nothing to recover."""
    while True:
        try:
            return recover(cause)
        except ray.exceptions.RayError as exc:
            if exc is cause:
                raise
            log.warning("another failure during recovery (%s): recovering again", exc)
            cause = exc


class TrainerRecovery:
    """Recovery of lost trainers, and driver calls that survive one (a `RayGroup` part)."""

    @property
    def recoveries_left(self) -> int:
        """Recoveries the run may still make (`recovery.budget`; below 0 once spent)."""
        return self.recovery_budget.left

    def recover(self, cause: Exception) -> list:
        """`_recover` after `cause`, again as often as a further failure interrupts it
        (within the recovery budget)."""
        self._tell("recovering", f"after {type(cause).__name__}")
        out = retrying(self._recover, cause)
        self._tell("settled", "recovered")
        return out

    def _tell(self, kind: str, why: str) -> None:
        """Tell the controller (`on_change`) that the group starts recovering or resizing,
        or has settled."""
        if self.on_change is not None:
            self.on_change(kind, why)

    def _recover(self, cause: Exception) -> list:
        """Bring the group back after `cause` (a failed pass): rebuild lost shards, replace
        every lost trainer by a copy of the survivor that finished the most steps of the
        pass and bring survivors that finished fewer to it (`recovery.policy`), rebuild the
        trainer group on a new generation. No checkpoint is read and no finished step is
        repeated. Returns the source's results of the pass so far; raises `cause` when
        nothing was lost and it is no failure of the trainers' group (a collective or its
        rendezvous, say because a member was lost and replaced meanwhile: the group is
        then just rebuilt), `NoReplicaLeft` when no trainer survived."""
        t0 = time.perf_counter()
        # a trainer that was to copy a replica when recovery was interrupted is lost too
        lost = sorted(set(self._probe()) | self._stale)
        lost_shards = self._probe_shards()
        lost_replicas = self._probe_replicas()  # dropped; successors start in the background
        triage = triage_recovery(lost, lost_shards, lost_replicas, group_failure(cause),
                                 len(self.trainers), self.min_trainers)  # fmt: skip
        if triage.action == "raise":
            raise cause  # not a lost member: a real error
        if triage.rebuild_shards:
            self._recover_shards(cause, lost_shards, tuple(lost))
        if triage.action == "no_replica":
            raise NoReplicaLeft(triage.reason) from cause
        self.recovery_budget.spend("trainer", cause)
        for w in lost:  # frees the name of one that died (a SIGKILLed actor keeps it)
            ray.kill(self.trainers[w])
        alive = [w for w in range(len(self.trainers)) if w not in lost]
        reports = dict(zip(alive, ray.get([self.trainers[w].recovery_report.remote()
                                           for w in alive]), strict=True))  # fmt: skip
        # where each stands: steps of the pass under way, or (a task per step) all its steps
        key = "done" if self.runs_passes else "steps"
        plan = plan_trainer_recovery(len(self.trainers), lost,
                                     {w: r[key] for w, r in reports.items()})  # fmt: skip
        source, done, behind = plan.source, plan.steps_done, list(plan.copy_to)
        state = self.trainers[source].replica_state.remote()
        results = ray.put(reports[source]["results"])
        # replacements start with the source's tables (an ingest may have failed before
        # every trainer grew them), load its state, then all grow to what shards hold
        num_nodes = ray.get(self.trainers[source].nodes.remote())
        self._stale = set(behind)
        spared, dropped = [], []
        for w in plan.replace:
            self.incarnations[w] += 1
            got = self._replacement(w, num_nodes, triage.may_shrink(len(dropped)))
            if got is None:  # no room for a replacement in time: the group shrinks
                dropped.append(w)
                continue
            self.trainers[w], spare = got
            spared += [w] if spare else []
        copies = [self.trainers[w] for w in behind if w not in dropped]
        if dropped:
            self._drop_ranks(dropped, f"trainer {dropped} lost and no slot free for a "
                             f"replacement within {self.replace_wait_s:.0f} s")  # fmt: skip
            self._stale = {w for w, t in enumerate(self.trainers) if any(t is c for c in copies)}
        ray.get([actor.load_replica.remote(state, results) for actor in copies])
        self._refresh(self.num_nodes, recovering=True)
        self._stale = set()
        self._connect()
        event = {
            "lost": lost, "lost_shards": lost_shards, "source": source, "steps_done": done,
            "lost_replicas": [list(x) for x in lost_replicas],
            "copied_to": sorted(behind), "spares_used": spared, "dropped": dropped,
            "generation": self.generation, "seconds": time.perf_counter() - t0,
            "cause": type(cause).__name__,
        }  # fmt: skip
        self.recoveries.append(event)
        self._trace_event("recovery", t0, event)
        log.warning(
            "trainer recovery: lost %s; %d steps of the pass done; trainer %d copied to %s; "
            "group generation %d; %.2f s", lost, done, source, sorted(behind), self.generation,
            event["seconds"],
        )  # fmt: skip
        return reports[source]["results"]

    def _robust(self, call):
        """`call()` (driver calls that read actors); when an actor is found lost, the group
        recovers (`recover`) and the call is made again, on the new actors."""
        for _ in self.recovery_budget.tries():
            try:
                return call()
            except ray.exceptions.RayActorError as exc:
                self.recover(exc)
        return call()
