"""The step pipeline: ingests, training steps submitted ahead and settled, evaluation steps.

With node state replicated on trainers, the driver submits up to `pipeline_depth` training
steps ahead (a task per step per trainer), each carrying the node-state updates of the step
before (numbered, applied once each); a step is settled when its loss is read. A trainer lost
meanwhile is recovered (`recovering`) and the steps of the window the group does not hold are
sent again in order (`recovery.steps.plan_redo`): the results are bitwise the fault-free
run's. With node state on the shards, a step is one round: train, then every slice's updates
to every shard copy, waited for. Ingests wait for the steps under way (they read the shards).
"""

from __future__ import annotations

import contextlib
import logging

import ray
import torch
import torch.distributed as dist

from tidegraph.actors.trainer import ALL_SLICES
from tidegraph.recovery.policy import NoReplicaLeft
from tidegraph.recovery.steps import plan_redo
from tidegraph.storage.events import EventBatch

__all__ = ["StepPipeline", "owned", "group_failure", "PendingLoss"]

log = logging.getLogger(__name__)


def owned(x):
    """`x` with every tensor in it copied to its own storage: a view pickles its whole base
    (a batch sliced from the stream would ship the stream with every task)."""
    if torch.is_tensor(x):
        return x.clone()
    if isinstance(x, EventBatch):
        return EventBatch(*(None if v is None else v.clone() for v in (
            x.src, x.dst, x.t, x.eid, x.edge_feat, x.label)))  # fmt: skip
    if isinstance(x, tuple | list):
        return type(x)(owned(v) for v in x)
    return x


def group_failure(exc: Exception) -> bool:
    """Whether `exc` is a trainer's collective or rendezvous failing (torch.distributed's
    errors, and the RuntimeError gloo raises when a peer's connection breaks)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, dist.DistError):
        return True
    return isinstance(cause, RuntimeError) and "gloo" in str(cause)


class PendingLoss:
    """The loss of a submitted step; `value()` waits for it (`settle`, if given, first: it
    recovers the group and runs the step again when a trainer was lost, and points `refs`
    at the new answers)."""

    def __init__(self, refs: list, settle=None) -> None:
        self._refs, self._value, self._settle = refs, None, settle

    def value(self) -> float:
        if self._value is None:
            if self._settle is not None:
                self._settle(self)
            self._value = float(sum(ray.get(self._refs)))
        return self._value


class StepPipeline:
    """Ingest, train and evaluate through the actors, step by step (a `RayGroup` part)."""

    def ingest(self, events: EventBatch, num_nodes: int, span: tuple | None = None) -> None:
        """Route `events` to the shards. `span`: their [lo, hi) positions in the stream, kept
        (with the feature-rounding stream's state) so that a lost shard can be rebuilt by
        routing the same batches again (`replay_source` reads them back)."""
        self.drain()  # steps under way read the shards: they finish before shards change
        if span is not None:
            self.ingests.append((int(span[0]), int(span[1]), self.feature_gen.get_state()))
            self._note("ingest", len(self.ingests) - 1)
        pieces = self._route(events)
        try:
            ray.get([s.ingest.remote(x) for p, x in enumerate(pieces) for s in self._copies(p)])
        except ray.exceptions.RayActorError as exc:  # survivors have it; rebuilt ones too
            self.recover(exc)
        if len(events):
            self.num_rows = max(self.num_rows, int(events.eid.max()) + 1)
        self.num_nodes = max(self.num_nodes, num_nodes)
        self._refresh(num_nodes)

    def _refresh(
        self, num_nodes: int, trainers: list | None = None, recovering: bool = False
    ) -> None:
        """Tell trainers (all, or these) what shards now hold: node count, feature rows,
        placements, and the segments same-node trainers sample in place. `recovering`: called
        by a recovery, so a failure here goes back to it (never a recovery inside one)."""
        part = None if self.partitioner.kind == "hash" else self.partitioner.state_dict()

        def tell() -> None:  # again after a recovery: growing tables twice changes nothing
            segments = ray.get([s.segment_refs.remote() for s in self.shards])
            ray.get([t.ingested.remote(num_nodes, self.num_rows, part, segments)
                     for t in (self.trainers if trainers is None else trainers)])  # fmt: skip

        if recovering:
            tell()
        else:
            self._robust(tell)

    def train_step(
        self, ev: EventBatch, weight: torch.Tensor | None, neg_BQ: torch.Tensor, num_observe: int
    ) -> float:
        self._resize_if_due()
        if self.sharded:
            return self._sharded_step(ev, weight, neg_BQ, num_observe)
        if not self._inflight:  # where the trainers stand (after any change of the group)
            self._next_step = self._steps()
        step = {"args": (ev, weight, neg_BQ, num_observe), "before": self._take_pending(),
                "index": self._next_step}  # fmt: skip
        self._next_step += 1
        pending = PendingLoss([], self._settle)
        step["pending"] = pending
        self._submit(step)
        self._inflight.append(pending)
        self._window.append(step)
        while len(self._inflight) > self.pipeline_depth:  # bounded lookahead
            self._inflight.popleft().value()
        return pending

    def _submit(self, step: dict) -> None:
        """Send one training step (replicated node state, a task per step) to every trainer:
        its slices, and the node-state updates of the step before (`step["before"]`); its
        own updates become pending, for the next call."""
        ev, weight, neg_BQ, num_observe = step["args"]
        cut = step.get("cut")
        if cut is None or len(cut) != self.num_trainers:  # a new size after a recovery
            cut = step["cut"] = [owned(args) for args in self._train_cut(ev, weight, neg_BQ,
                                                                        num_observe)]  # fmt: skip
        # every trainer answers (the batch's loss, every slice's updates): rank 0's go on
        step["outs"] = [t.train_and_step.options(num_returns=2).remote(*args, *step["before"])
                        for t, args in zip(self.trainers, cut, strict=True)]  # fmt: skip
        self._settled_with(step, *step["outs"][0], self._seq)
        self._flush()
        self._pending = list(step["after"])
        self._seq += 1

    def _settled_with(self, step: dict, loss, updates, seq: int) -> None:
        """The step's loss and the updates the next step carries are these refs'."""
        step["pending"]._refs = [loss]
        step["after"] = [seq, ALL_SLICES, updates]  # the next step's `before`

    def _settle(self, pending: PendingLoss) -> None:
        """Wait for the steps submitted up to `pending`. When a trainer was lost, the group
        recovers (survivors' most advanced replica copied forward, `recover`) and every step
        in the window that the trainers do not hold is sent again, in order, each with the
        updates of the step before: trainers apply a batch of updates once (numbered), so a
        survivor that applied them already skips them. The steps' results are bitwise the
        fault-free run's. A step the group holds is answered for by any member that finished
        it (each returns every slice's updates); with none left that answers, it cannot be
        completed (`NoReplicaLeft`: the orchestrator restarts from the newest checkpoint)."""
        for _ in self.recovery_budget.tries():
            upto = next((i for i, s in enumerate(self._window) if s["pending"] is pending), None)
            if upto is None:
                return
            refs = [r for s in list(self._window)[: upto + 1] for o in s["outs"] for r in o]
            try:
                ray.get(refs)
            except ray.exceptions.RayError as exc:
                if not isinstance(exc, ray.exceptions.RayActorError) and not group_failure(exc):
                    raise
                self._redo(exc)
                continue
            for _ in range(upto + 1):  # done: their updates went with the steps after
                self._window.popleft()
            return
        raise self.recovery_budget.error("trainer")

    def _redo(self, cause: Exception) -> None:
        """Recover after `cause` and send again the steps of the window the group does not
        hold (see `_settle`)."""
        with contextlib.suppress(type(cause)):  # another call met the loss and recovered
            self.recover(cause)
        done = self._steps()
        window = list(self._window)
        plan = plan_redo([s["index"] for s in window], done)
        for step, redo in zip(window, plan, strict=True):
            if redo.held:  # the group holds it: any member's answer is all of it
                for loss, updates in step["outs"]:
                    with contextlib.suppress(ray.exceptions.RayError):
                        ray.get([loss, updates])
                        self._settled_with(step, loss, updates, step["after"][0])
                        step["outs"] = [(loss, updates)]  # the lost member's are not waited for
                        break
                else:
                    raise NoReplicaLeft("no trainer that finished a step answered for it")
                continue
            if redo.before is not None:  # the step before is in the window, too
                step["before"] = window[redo.before]["after"]
            self._pending = []  # each step carries the updates before it
            self._submit(step)
        log.warning("step recovery: %d steps of the window sent again from step %d",
                    sum(not r.held for r in plan), done)  # fmt: skip

    def _sharded_step(self, ev, weight, neg_BQ, num_observe: int) -> PendingLoss:
        """A training step with node state on the shards (a task per step), recovered when
        a trainer or shard is lost: trainers change nothing until every collective of the
        step finished, so after a recovery the group either holds the step (a member was
        lost after the all-reduce: survivors stepped and replacements copy one) or not (it
        is run again); a shard copy lost while applying the step's updates is replaced by
        a replica, which applied them too (`cluster.shard_replicas`)."""
        for _ in self.recovery_budget.tries():
            steps = self._steps()
            slices = self._train_cut(ev, weight, neg_BQ, num_observe)
            outs = [t.train_and_step.options(num_returns=2).remote(*owned(args))
                    for t, args in zip(self.trainers, slices, strict=True)]  # fmt: skip
            try:
                ray.get([o[0] for o in outs])
            except ray.exceptions.RayError as exc:
                self.recover(exc)
                if self._steps() == steps:
                    continue  # nobody stepped: run the step again on the rebuilt group
                raise NoReplicaLeft(  # the orchestrator restarts from the newest checkpoint
                    "a trainer was lost after its group's all-reduce, with its slice's "
                    "node-state updates for the shards: the step cannot be completed"
                ) from exc
            try:
                self._apply_state([o[1] for o in outs])
            except ray.exceptions.RayError as exc:
                self.recover(exc)  # every copy was sent the updates; a replica takes over
            pending = PendingLoss([o[0] for o in outs])
            pending.value()
            return pending
        raise self.recovery_budget.error("trainer")

    def _steps(self) -> int:
        return self._robust(lambda: ray.get(self.trainers[0].call.remote("__getattribute__",
                                                                         "steps")))  # fmt: skip

    def eval_step(
        self, ev: EventBatch, neg_BQ: torch.Tensor, observe: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._resize_if_due()
        self.drain()  # training steps sent before (and recovered, if need be)
        outs = []
        before = self._take_pending()
        cut, start = self._eval_cut(ev, neg_BQ)
        if before and len(cut) < self.num_trainers:
            self._pending = before  # a trainer without a slice gets them on their own
            self._flush()
            before = []
        for w, part, part_neg in cut:
            args = owned((part, part_neg))
            outs.append(self.trainers[w].eval_slice.options(num_returns=3).remote(
                *args, observe, start, *before
            ))  # fmt: skip
        if observe and not self.sharded:
            self._apply_state([o[2] for o in outs])
        try:
            pos = ray.get([o[0] for o in outs])
            neg = ray.get([o[1] for o in outs])
        except ray.exceptions.RayActorError as exc:
            # survivors applied `before` (their task's first act) and replacements copy one;
            # the step itself changed nothing yet (shards get its updates only below): run
            # it again
            self._pending = []
            self.recover(exc)
            return self.eval_step(ev, neg_BQ, observe)
        if observe and self.sharded:
            try:
                self._apply_state([o[2] for o in outs])
            except ray.exceptions.RayError as exc:
                self.recover(exc)  # every copy was sent the updates; a replica takes over
        return torch.cat(pos), torch.cat(neg)

    def drain(self) -> None:
        """Wait for every training step submitted so far."""
        while self._inflight:
            self._inflight.popleft().value()

    def _apply_state(self, updates: list) -> None:
        """Every slice's node-state updates: to every trainer with its next call (pending
        until then, in order before anything the trainer does next), or to every shard
        (waited for: trainers read shards next)."""
        if self.sharded:
            if self._journaling:  # copies on the driver's node: a trainer's node may go
                self._note("apply", ray.put(ray.get(list(updates))))
            ray.get([s.apply_state_of.remote(*updates) for s in self._all_copies()])
            return
        self._flush()
        self._pending = [self._seq, *updates]
        self._seq += 1

    def _take_pending(self) -> list:
        pending, self._pending = self._pending, []
        return pending

    def _flush(self) -> None:
        """Send pending node-state updates on their own (before a call that carries none)."""
        pending = self._take_pending()
        if pending:
            for trainer in self.trainers:
                trainer.apply_updates.remote(*pending)
