"""A whole training or evaluation pass for a group that runs one per call (Ray trainers that
exchange node-state updates among themselves): the pass's units go to the group a window of
events at a time (`continual.window_events`), so the driver never holds a block's batches at
once; a pass no larger than the window is one call. Splitting a pass changes no result: the
trainers run its steps in order either way."""

from __future__ import annotations

from collections.abc import Iterator

from tidegraph.training.progress import begin_pass, pass_bar, steps_shown
from tidegraph.training.schedule import Schedule, Unit

__all__ = ["pass_windows", "run_pass"]


def run_pass(learner, first: Unit) -> None:
    """The units of the `learner`'s pass that starts with `first` (its cursor's next unit):
    inputs (events, replay, negatives) drawn in the order the units would draw them, results
    recorded as they would record them."""
    at = learner.cursor.unit
    ps = learner.pass_state
    group = learner.group
    begin_pass(ps, learner.schedule, at, first, learner.config.progress)
    window = learner.config.continual.window_events
    for todo in pass_windows(learner.schedule, at, at + first.parts, window):
        if first.kind == "train":
            batches = [learner._train_inputs(u, ps) for u in todo]
            progress = steps_shown(lambda i, b=batches: pass_bar(ps, len(b[i][0])))
            with group.tracer.span("train pass", steps=len(batches)):
                losses = group.train_pass(batches, progress)
            for (ev, _, _, _), loss in zip(batches, losses, strict=True):
                ps["losses"].append((loss, len(ev)))
                ps["loss_events"] += len(ev)
                learner.cursor.step += 1
        else:
            batches = [learner.evaluation.inputs(u) for u in todo]
            progress = steps_shown(lambda i, b=batches: pass_bar(ps, len(b[i][0])))
            with group.tracer.span("evaluation", steps=len(batches)):
                scores = group.eval_pass(batches, True, progress)
            for u, (p, n) in zip(todo, scores, strict=True):
                learner.evaluation.scores(u, p, n, ps)
        progress(len(todo))
    learner.cursor.unit = at + first.parts


def pass_windows(schedule: Schedule, begin: int, end: int, window: int) -> Iterator[list[Unit]]:
    """Units [begin, end) of a pass, in runs of at most `window` events (at least one unit
    each)."""
    todo, size = [], 0
    for i in range(begin, end):
        u = schedule.unit(i)
        if todo and size + (u.hi - u.lo) > window:
            yield todo
            todo, size = [], 0
        todo.append(u)
        size += u.hi - u.lo
    if todo:
        yield todo
