"""The run's state machine: place the group, run the continual procedure, finish or fail.

`Orchestrator.step()` does one unit of work for the current state and returns the next:
- SCHEDULING: build the group of shards and trainers (on Ray: wait, bounded, until the
  cluster can place them) and the learner over it -> RUNNING;
- RUNNING: phase 1, then one increment per call (ingest, evaluate, retrain) -> RUNNING, and
  after the last increment the summary -> FINISHED;
- RECOVERING, RESIZING: entered while the group brings lost members back or changes its
  membership (trainers resized, shards moved or their actors resized, replicas added). The
  group acts at a step boundary inside RUNNING's unit of work (no finished step is repeated,
  so the work goes on where it was) and tells the controller through its `on_change` hook;
  the state is back to RUNNING when the group has settled;
- RESTARTING: no trainer replica is left (`NoReplicaLeft`): the next step releases the
  group and goes back to SCHEDULING from the newest checkpoint (within the restart budget);
- any other failure -> ERRORED, with the exception kept as `error`.
Every change of state is logged ("controller: running -> recovering (why)"), kept in
`transitions` and, with metrics, shown as the Prometheus state set `tidegraph_controller_state`.
With a `RunDir`, ingested events go to its durable event log first, a checkpoint (every piece of
state, with the log offset) is written after phase 1, every `checkpoint_every` increments and
at the end (the newest `keep_checkpoints` are kept), and `resume` restores the newest one
before RUNNING.
A followed run (a live `source`, `tidegraph.storage.live`) also checkpoints the source's
position and the stream's layout (its name, phase 1's end, each increment's bounds). At every
checkpoint all the source has handed out is ingested, so resuming rebuilds the stream from the
event log (the same increments, so the same schedule), puts the source back at that position
and takes what it has not handed out yet: nothing is ingested twice, nothing skipped. Log files
written after the checkpoint are set aside (renamed `*.superseded`, not erased): their events
are ingested again, perhaps cut into other increments.
Each increment's record goes to `on_record` as it is made (the job prints it). The procedure
itself is `ContinualLearner`'s, so every backend runs exactly the single-process semantics.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import time
from collections.abc import Callable

from tidegraph.orchestrator.backend import make_group
from tidegraph.recovery.policy import NoReplicaLeft
from tidegraph.recovery.updatelog import drop_steps_before, logged_steps
from tidegraph.runtime import release_free_memory
from tidegraph.storage.events import EventBatch
from tidegraph.storage.idmap import IdMap
from tidegraph.timeline import keep_overlapping, timeline_meta
from tidegraph.training.continual import ContinualLearner
from tidegraph.training.data import Stream, stream_of

__all__ = ["Orchestrator", "RunState"]

log = logging.getLogger(__name__)


class RunState(enum.Enum):
    SCHEDULING = "scheduling"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    RESTARTING = "restarting"
    FINISHED = "finished"
    ERRORED = "errored"


TERMINAL = (RunState.FINISHED, RunState.ERRORED)
# what a group's `on_change(kind, why)` reports -> the state the controller enters
GROUP_CHANGES = {"recovering": RunState.RECOVERING, "resizing": RunState.RESIZING,
                 "settled": RunState.RUNNING}  # fmt: skip

# why the controller moved, when the move itself says it
WHY = {
    (RunState.SCHEDULING, RunState.RUNNING): "the group is placed",
    (RunState.RECOVERING, RunState.RUNNING): "the group has settled",
    (RunState.RESIZING, RunState.RUNNING): "the group has settled",
    (RunState.RUNNING, RunState.FINISHED): "the last increment is done",
}


class Orchestrator:
    """Drives one run; `group` is a group factory (None: `make_group`, the configured
    backend's)."""

    def __init__(
        self,
        config,
        stream=None,
        group=None,
        on_record: Callable[[dict], None] | None = None,
        run_dir=None,
        resume: bool = False,
        metrics=None,
        source=None,
        follow_timeout: float = 60.0,
    ) -> None:
        """`source`: a live source (`tidegraph.storage.live`); phase 1 is `stream` when given,
        else the source's first increment, and each later increment comes from the source,
        until none arrives in `follow_timeout` seconds."""
        self.config = config
        self.source = source
        self.follow_timeout = follow_timeout
        self._saved: dict | None = None  # the checkpoint a resumed run continues from
        self.metrics = metrics  # a RunMetrics, updated after every record
        if metrics is not None:
            metrics.controller_state(RunState.SCHEDULING.value)
        self.run_dir = run_dir
        self.resume = resume
        self.stream = stream
        self.group_factory = group or make_group
        self.on_record = on_record or (lambda record: None)
        self.state = RunState.SCHEDULING
        self.transitions: list[tuple] = []  # (from, to, why, unix time) of every change
        self.learner: ContinualLearner | None = None
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.restarts = 0  # from a checkpoint, after every trainer was lost
        self.replay_plan: list[int] = []  # logged steps the last group start replays

    def step(self) -> RunState:
        if self.state in TERMINAL:
            return self.state
        try:
            if self.state is RunState.RESTARTING:
                self._enter(self._restart(), "the new group starts from the newest checkpoint")
            else:
                self._enter(self._advance())
        except NoReplicaLeft as exc:
            if self._may_restart():
                self._enter(RunState.RESTARTING, str(exc))
            else:
                self._fail(exc)
        except Exception as exc:  # the run fails as a whole; the error is reported, not lost
            self._fail(exc)
        return self.state

    def _fail(self, exc: BaseException) -> None:
        log.error("run failed in state %s: %s", self.state.value, exc)
        self.error = exc
        self._enter(RunState.ERRORED, f"{type(exc).__name__}: {exc}")

    def _enter(self, state: RunState, why: str = "") -> None:
        """Make `state` the current state; a change is logged, kept and published."""
        old, self.state = self.state, state
        if state is old:
            return
        why = why or WHY.get((old, state), "")
        self.transitions.append((old, state, why, time.time()))
        log.info("controller: %s -> %s%s", old.value, state.value, f" ({why})" if why else "")
        if self.metrics is not None:
            self.metrics.controller_state(state.value)

    def _group_changed(self, kind: str, why: str) -> None:
        """The group's `on_change` hook: it starts recovering or resizing, or has settled."""
        state = GROUP_CHANGES[kind]
        if state is RunState.RUNNING and self.state not in (RunState.RECOVERING,
                                                           RunState.RESIZING):  # fmt: skip
            return  # settled from a change this controller did not see start
        self._enter(state, why)

    def run(self) -> dict:
        """Step until FINISHED (returns the summary) or ERRORED (raises the error)."""
        while self.step() not in TERMINAL:
            pass
        self.close()
        if self.state is RunState.ERRORED:
            raise self.error
        return self.result

    def _may_restart(self) -> bool:
        """Whether a run that lost every trainer replica restarts from a checkpoint: with a
        run directory, within the restart budget (`cluster.max_recoveries`)."""
        return self.run_dir is not None and self.restarts < self.config.cluster.max_recoveries

    def _restart(self) -> RunState:
        """No trainer replica is left: start a new group from the newest checkpoint (or
        from the beginning before the first; the steps since it are computed again), as a
        resubmitted job would."""
        self.restarts += 1
        log.warning(
            "restarting from checkpoint %s (restart %d); the steps since it run again",
            self.run_dir.latest_name() or "(none yet: the beginning)", self.restarts,
        )  # fmt: skip
        self.close()
        self.learner, self.resume = None, True
        if self.config.cluster.faults:
            log.warning("injected faults (cluster.faults) apply to the first group only")
            self.config.cluster.faults = []
        return RunState.SCHEDULING

    def close(self) -> None:
        if self.learner is not None:
            self._write_timeline()
            self.learner.group.shutdown()

    def _write_timeline(self) -> None:
        """The spans the group recorded since the last write, as the run directory's next
        timeline file (`--timeline K`, K > 1: the shards' requests of recorded steps only)."""
        k = self.config.timeline
        if not k or self.run_dir is None or self.learner is None:
            return
        try:
            events = self.learner.group.take_trace()
        except Exception as exc:  # a lost member's spans are lost; the run goes on
            log.warning("timeline: could not collect the spans (%s)", exc)
            return
        if k > 1:
            events = keep_overlapping(events, "shard")
        if any(e["ph"] == "X" for e in events):
            self.run_dir.write_timeline(events, timeline_meta(self.config, self.learner.group))

    def _advance(self) -> RunState:
        if self.state is RunState.SCHEDULING:
            events = None if self.run_dir is None else self.run_dir.event_log()
            if self.resume:
                self._saved = self._load_checkpoint()
            live = self.source is not None
            stream = self._live_stream(events) if live else self.stream
            self.learner = ContinualLearner(
                self.config, stream, self.group_factory, events, live=live
            )
            if self.resume:
                self._restore(events)
            elif self.run_dir is not None:
                self.run_dir.save_config(self.config.to_dict())
            self._open_update_log()
            g = self.learner.group
            g.on_change = self._group_changed
            if self.run_dir is not None:
                g.snapshot_source = self._group_snapshot
            log.info(
                "placed %d shards and %d trainers (%s backend, node state %s)",
                g.num_shards, g.num_trainers, self.config.cluster.backend,
                g.memory_placement,
            )  # fmt: skip
            return RunState.RUNNING
        learner = self.learner
        if not learner.phase1_done:
            self._record(learner.run_phase1())
            self._checkpoint("phase1")
            return RunState.RUNNING
        if not learner.done:
            self._record(learner.step())
            k = learner.cursor.increment
            if k % self.config.checkpoint_every == 0 or learner.done:
                self._checkpoint(f"increment-{k:05d}")
            release_free_memory()  # what the increment freed leaves the head node
            return RunState.RUNNING
        if self.source is not None:
            got = self.source.next_events(self.follow_timeout)
            if got is not None:
                name, events = got
                if len(events):
                    if learner.events.label is None:  # a stream rebuilt from the log has none
                        events.label = None
                    learner.append(events)
                log.info("live source: %s brought %d events", name, len(events))
                return RunState.RUNNING
            log.info("live source: no new file in %.0f s; finishing", self.follow_timeout)
        self.result = learner.summary()
        return RunState.FINISHED

    def _group_snapshot(self) -> dict | None:
        """The group state of the newest checkpoint (a lost shard's snapshot), or None."""
        if self.run_dir.latest_name() is None:
            return None
        store = self._actor_store()  # the actors read their partitions' state themselves
        snap = self.run_dir.load_checkpoint(resolve=store is None)["learner"]["group"]
        return {**snap, "store": store}

    def _open_update_log(self) -> None:
        """With `cluster.update_log_every`, trainer 0 logs training steps to the run
        directory's updates/; a restarted or resumed run replays the steps logged since its
        checkpoint instead of computing them (`recovery.updatelog`)."""
        every = self.config.cluster.update_log_every
        group = self.learner.group
        if self.run_dir is None or not self.run_dir.local or not group.supports_update_log:
            if every:
                log.warning("cluster.update_log_every: the update log needs the ray backend and "
                            "a run directory on a file system; not logging")  # fmt: skip
            return
        directory = f"{self.run_dir.path}/updates"
        replay = logged_steps(directory, since=self.learner.cursor.step) if self.resume else []
        self.replay_plan = replay
        if every or replay:
            group.set_update_log(directory, every, replay)
        if replay:
            log.warning("replaying %d logged training steps (of steps %d..%d) instead of "
                        "computing them", len(replay), replay[0], replay[-1])  # fmt: skip

    def _record(self, record: dict) -> None:
        self._write_timeline()
        if self.metrics is not None:
            group = self.learner.group
            self.metrics.observe(self.learner, record, group.take_seconds(), group.grad_values(),
                                 group.comm_totals())  # fmt: skip
        self.on_record(record)

    def _checkpoint(self, tag: str) -> None:
        if self.run_dir is None:
            return
        learner = self.learner
        # the shards and trainers write their bulk themselves where they reach the storage
        own = self.run_dir.checkpoint_uri  # the driver's part: here, the reservoir's base once
        state = {"learner": learner.state_dict(self._actor_store(), own),
                 "log_offset": learner.ingested,
                 "config": self.config.to_dict(),
                 "source": None if self.source is None else self.source.state_dict()}  # fmt: skip
        if self.source is not None:  # the stream's layout, to rebuild it from the event log
            state["live"] = {"name": learner.stream.name, "phase1_end": learner.phase1_end,
                             "increments": [tuple(b) for b in learner.bounds]}  # fmt: skip
        meta = {"step": learner.cursor.step, "log_offset": learner.ingested}
        with learner.group.tracer.span("checkpoint", tag=tag):
            self.run_dir.save_checkpoint(state, tag, self.config.keep_checkpoints, meta)
        learner.group.checkpointed()  # saved: what only an older rebuild needed can go
        kept = self.run_dir.checkpoints.kept_meta()
        if self.run_dir.local:  # the update log's steps before every kept checkpoint go
            oldest = min(m.get("step", 0) for m in kept)
            drop_steps_before(f"{self.run_dir.path}/updates", oldest)
        spool = learner.stream.spool
        if spool is not None:  # events every kept checkpoint has ingested: in the event log
            spool.drop_before(min(m.get("log_offset", 0) for m in kept))

    def _actor_store(self) -> str | None:
        """The checkpoint store's URI when every actor reaches it (remote storage, or a local
        one with every actor on this node), else None (the driver moves the state)."""
        reach = not self.run_dir.local or self.learner.group.on_driver_node()
        return self.run_dir.checkpoint_uri if reach else None

    def _load_checkpoint(self) -> dict | None:
        """The newest checkpoint of the run being resumed (None: it has none yet); a followed
        run resumes only with a source, and a run that followed none only without one."""
        if self.run_dir.latest_name() is None:
            return None
        # all but the group's bulk (its shards' and trainers' states), which stays as refs
        # for the actors to read where they can (`_restore`)
        state = self.run_dir.load_checkpoint(resolve=False)
        group = state["learner"]["group"]
        bulk = {k: group.pop(k) for k in ("shards", "trainers")}
        state = self.run_dir.checkpoints.resolve(state)
        state["learner"]["group"].update(bulk)
        followed = state.get("source")
        if followed is not None and self.source is None:
            where = followed.get("path", "a live source")
            raise ValueError(f"--resume: run {self.run_dir.run_name} followed {where}; "
                             f"pass --follow {where} to resume it")  # fmt: skip
        if followed is not None and "live" not in state:
            raise ValueError(f"--resume: run {self.run_dir.run_name}'s checkpoint predates "
                             "resumable followed runs; start a new run")  # fmt: skip
        if followed is None and self.source is not None:
            raise ValueError(f"--follow: run {self.run_dir.run_name} followed no live source; "
                             "resume it without --follow")  # fmt: skip
        return state

    def _live_stream(self, event_log) -> Stream:
        """Phase 1 of a followed run: rebuilt from the event log when resuming a checkpoint
        (the source goes back to its position then), else `stream` or the source's first
        increment."""
        saved = self._saved
        if self.resume:  # log files past the checkpoint are ingested again
            _supersede(event_log, 0 if saved is None else saved["log_offset"])
        if saved is not None:
            self.source.load_state_dict(saved["source"])
            live = saved["live"]
            return stream_of(_owned(event_log.read(0, live["phase1_end"])), live["name"])
        if self.stream is not None:
            return self.stream
        got = self.source.next_events(self.follow_timeout)
        if got is None:
            raise ValueError(f"--follow: no {self.source.waiting_for} arrived in "
                             f"{self.source.path} within {self.follow_timeout:.0f} s")  # fmt: skip
        name, events = got
        if not len(events):
            raise ValueError(f"--follow: {name}: the first increment holds no valid events")
        return stream_of(events, name)

    def _restore(self, event_log) -> None:
        state = self._saved
        if state is None:
            log.info("no checkpoint yet: the run starts again from its beginning")
            return
        if self.source is not None:  # the increments after phase 1, as they were cut
            bounds = state["live"]["increments"]
            orchestrator = state["learner"]["orchestrator"]
            # learned ones by their bounds alone; any later one read from the log (through the
            # checkpoint's id map: the ids of the increments learned are in it)
            if "idmap" in orchestrator:
                self.learner.stream.idmap = IdMap.from_state(orchestrator["idmap"])
            learned = orchestrator["cursor"]["increment"]
            for k, (lo, hi) in enumerate(bounds):
                if k < learned:
                    self.learner.append_learned(lo, hi)
                else:
                    self.learner.append(_owned(event_log.read(lo, hi)))
            if self.learner.end != state["log_offset"]:
                raise ValueError(f"--resume: the checkpoint's increments end at "
                                 f"{self.learner.end}, its log offset is "
                                 f"{state['log_offset']}")  # fmt: skip
        store = self._actor_store()  # None: the actors do not reach it, the driver reads
        if store is None:
            group = state["learner"]["group"]
            bulk = {k: group[k] for k in ("shards", "trainers")}
            group.update(self.run_dir.checkpoints.resolve(bulk))
        self.learner.load_state_dict(state["learner"], store)
        history = self.learner.history
        out = self.config.out_dir
        if out:  # the metrics of increments after the checkpoint are made again
            from pathlib import Path

            path = Path(out) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in history))
        log.info(
            "resumed after %d increments at log offset %d", self.learner.cursor.increment,
            state["log_offset"],
        )  # fmt: skip


def _supersede(event_log, offset: int) -> None:
    """Set aside (rename, never erase) the log files of events from `offset` on: a resumed
    run ingests those events again and logs them anew, perhaps in other batches."""
    for start, _, path in event_log.files():
        if start >= offset:
            event_log.fs.move(path, f"{path}.superseded")
            log.info("event log: %s set aside (after the checkpoint; ingested again)", path)


def _owned(events: EventBatch) -> EventBatch:
    """Events read from the log in tensors of their own (the log's are read-only Arrow
    buffers, and the run's stream is the learner's to change)."""
    values = {f.name: getattr(events, f.name) for f in dataclasses.fields(events)}
    return EventBatch(**{k: None if v is None else v.clone() for k, v in values.items()})
