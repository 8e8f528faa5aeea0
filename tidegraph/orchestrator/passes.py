"""Whole passes: every step of a training or evaluation pass in one task per trainer.

With replicated node state the trainers exchange each step's updates among themselves, so the
driver sends a pass's slices once (packed: a few tensors per trainer, `PackedSteps`) and reads
the steps' progress from the coordinator while it runs. A trainer lost midway is recovered and
the pass goes on from the survivors' last whole step; a resize asked for meanwhile stops the
trainers after a step, and the rest of the pass is cut anew for the new group. Recoveries that
make no progress end the pass (`recovery.steps.pass_stall`).
"""

from __future__ import annotations

import logging

import ray

from tidegraph.recovery.steps import pass_stall, stall_message
from tidegraph.training.packed import PackedSteps

__all__ = ["Passes"]

log = logging.getLogger(__name__)


class Passes:
    """A pass per task per trainer, recovered and resized mid-pass (a `RayGroup` part)."""

    @property
    def runs_passes(self) -> bool:
        """Whole passes per task: with replicated node state, trainers exchange each step's
        updates among themselves (sharded state goes through the shards, step by step)."""
        return self.config.cluster.whole_passes and not self.sharded

    def train_pass(self, batches: list, progress=None) -> list[float]:
        """Every step of a training pass in one task per trainer; the steps' losses.
        `batches`: (events, weights, negatives, new events) per step; `progress(steps)` is
        called with the steps finished while the pass runs. A trainer lost midway is
        replaced from a survivor and the pass goes on from the survivors' last whole step
        (`recover`)."""

        def cut(batches: list) -> list:  # each trainer's slices of these batches
            per_trainer = [[] for _ in self.trainers]
            for ev, weight, neg, num_observe in batches:
                for w, args in enumerate(self._train_cut(ev, weight, neg, num_observe)):
                    per_trainer[w].append(args)
            return [PackedSteps(steps) for steps in per_trainer]

        return self._pass("train_pass", batches, cut, (), progress)

    def eval_pass(self, batches: list, observe: bool, progress=None) -> list:
        """Scores of every batch of an evaluation pass, one task per trainer."""

        def cut(batches: list) -> list:
            per_trainer = [[] for _ in self.trainers]
            for ev, neg in batches:
                for w, (lo, hi) in enumerate(self.balancer.bounds(ev, neg, self.num_trainers)):
                    per_trainer[w].append((ev.select(slice(lo, hi)), neg[lo:hi]))
            return [PackedSteps(steps) for steps in per_trainer]

        return self._pass("eval_pass", batches, cut, (observe,), progress)

    def _pass(self, method: str, batches: list, cut, args: tuple, progress) -> list:
        """Run a pass (`method` of every trainer, with its slices of every batch, as
        `cut(batches)` gives them); rank 0's results, recovering from lost trainers as often
        as it takes, and resizing the group when asked to (the trainers stop after a step,
        and the rest of the pass is cut anew for the new group)."""
        self.drain()
        if not batches:
            return []
        self._resize_if_due(force=True, at=f"before a {method} of {len(batches)} steps")
        before = self._take_pending()
        results: list = []
        stalled = 0  # recoveries in a row after which the pass got no further
        while len(results) < len(batches):
            done = len(results)
            ray.get([self.coordinator.report.remote(0),
                     self.coordinator.request_stop.remote(False)])  # fmt: skip
            self._stop_asked = False
            per_trainer = cut(batches[done:])
            refs = [getattr(t, method).remote(s, *args, *before)
                    for t, s in zip(self.trainers, per_trainer, strict=True)]  # fmt: skip
            before = []  # applied by every survivor; a replacement copies one
            # trainer 0 reports without waiting, so a report of the task before a recovery can
            # reach the coordinator after this reset: never past the pass's last step
            shifted = None if progress is None else (
                lambda n, d=done: progress(min(d + n, len(batches))))  # fmt: skip
            try:
                results += self._wait_pass(refs, shifted)[0]
            except ray.exceptions.RayError as exc:
                results += self.recover(exc)
                stalled, stuck = pass_stall(stalled, done, len(results))
                if stuck:
                    last_lost = self.recoveries[-1]["lost"]
                    raise RuntimeError(
                        stall_message(method, done, len(batches), stalled, last_lost)
                    ) from exc
                continue
            if len(results) < len(batches):  # stopped early: resize, then go on
                self._resize_if_due(True, f"{method} step {len(results)} of {len(batches)}")
        return results

    def _wait_pass(self, refs: list, progress) -> list:
        """The trainers' results of a pass; meanwhile `progress` gets the steps trainer 0
        reported, a trainer that failed raises at once (not after the others), and when the
        group should change size the trainers are asked to stop after a step."""
        checked: set = set()
        while True:
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.progress_s)
            ray.get([r for r in ready if r not in checked])  # raises the first failure
            checked.update(ready)
            if not pending:
                return ray.get(refs)
            if progress is not None:
                progress(ray.get(self.coordinator.progress.remote()))
            if not self._stop_asked and any(self._plan()):
                self._stop_asked = True
                self.coordinator.request_stop.remote(True)
