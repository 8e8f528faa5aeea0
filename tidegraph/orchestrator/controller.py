"""The run's state machine: place the group, run the continual procedure, finish or fail.

`Orchestrator.step()` does one unit of work for the current state and returns the next:
- SCHEDULING: build the group of shards and trainers (on Ray: wait, bounded, until the
  cluster can place them) and the learner over it -> RUNNING;
- RUNNING: phase 1, then one increment per call (ingest, evaluate, retrain) -> RUNNING, and
  after the last increment the summary -> FINISHED;
- any failure -> ERRORED, with the exception kept as `error` (RECOVERING and RESIZING come with
  the recovery and elasticity work; their decisions will be pure policies).
With a `RunDir`, ingested events go to its durable event log first, a checkpoint (every piece of
state, with the log offset) is written after phase 1, every `checkpoint_every` increments and
at the end, and `resume` restores the newest one before RUNNING.
Each increment's record goes to `on_record` as it is made (the job prints it). The procedure
itself is `ContinualLearner`'s, so every backend runs exactly the single-process semantics.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable

from tidegraph.training.continual import ContinualLearner

__all__ = ["Orchestrator", "RunState"]

log = logging.getLogger(__name__)


class RunState(enum.Enum):
    SCHEDULING = "scheduling"
    RUNNING = "running"
    FINISHED = "finished"
    ERRORED = "errored"


TERMINAL = (RunState.FINISHED, RunState.ERRORED)


class Orchestrator:
    """Drives one run; `group` is a group factory (None: the configured backend's)."""

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
        """`source`: a live source (`DirectorySource`); `stream` is then phase 1's events and
        each file that arrives is one more increment, until none arrives in
        `follow_timeout` seconds."""
        self.config = config
        self.source = source
        self.follow_timeout = follow_timeout
        if source is not None and resume:
            raise ValueError("--resume of a followed directory is not supported yet")
        self.metrics = metrics  # a RunMetrics, updated after every record
        self.run_dir = run_dir
        self.resume = resume
        self.stream = stream
        self.group_factory = group
        self.on_record = on_record or (lambda record: None)
        self.state = RunState.SCHEDULING
        self.learner: ContinualLearner | None = None
        self.result: dict | None = None
        self.error: BaseException | None = None

    def step(self) -> RunState:
        if self.state in TERMINAL:
            return self.state
        try:
            self.state = self._advance()
        except Exception as exc:  # the run fails as a whole; the error is reported, not lost
            log.error("run failed in state %s: %s", self.state.value, exc)
            self.error = exc
            self.state = RunState.ERRORED
        return self.state

    def run(self) -> dict:
        """Step until FINISHED (returns the summary) or ERRORED (raises the error)."""
        while self.step() not in TERMINAL:
            pass
        self.close()
        if self.state is RunState.ERRORED:
            raise self.error
        return self.result

    def close(self) -> None:
        if self.learner is not None:
            self.learner.group.shutdown()

    def _advance(self) -> RunState:
        if self.state is RunState.SCHEDULING:
            events = None if self.run_dir is None else self.run_dir.event_log()
            live = self.source is not None
            self.learner = ContinualLearner(
                self.config, self.stream, self.group_factory, events, live=live
            )
            if self.resume:
                self._restore()
            elif self.run_dir is not None:
                self.run_dir.save_config(self.config.to_dict())
            g = self.learner.group
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
            return RunState.RUNNING
        if self.source is not None:
            got = self.source.next_events(self.follow_timeout)
            if got is not None:
                name, events = got
                if len(events):
                    learner.append(events)
                log.info("live source: %s brought %d events", name, len(events))
                return RunState.RUNNING
            log.info("live source: no new file in %.0f s; finishing", self.follow_timeout)
        self.result = learner.summary()
        return RunState.FINISHED

    def _record(self, record: dict) -> None:
        if self.metrics is not None:
            group = self.learner.group
            self.metrics.observe(self.learner, record, group.take_seconds(), group.grad_values())
        self.on_record(record)

    def _checkpoint(self, tag: str) -> None:
        if self.run_dir is None:
            return
        state = {"learner": self.learner.state_dict(), "log_offset": self.learner.ingested,
                 "config": self.config.to_dict(),
                 "source": None if self.source is None else self.source.state_dict()}  # fmt: skip
        self.run_dir.save_checkpoint(state, tag)

    def _restore(self) -> None:
        if self.run_dir.latest_name() is None:
            log.info("no checkpoint yet: the run starts again from its beginning")
            return
        state = self.run_dir.load_checkpoint()
        self.learner.load_state_dict(state["learner"])
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
