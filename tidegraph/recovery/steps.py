"""Steps after a trainer recovery: the decisions, as pure functions.

With a task per step, the driver keeps a window of steps it submitted and does not yet know
finished. After a recovery the group stands at some step count (`recovery.policy`): a step
of the window below it is held by the group, and any member that finished it answers for
it (each returns every slice's node-state updates); a step at or above it is sent again, in
order, carrying the updates of the step before it as the window now has them (`plan_redo`).

With a task per pass, a pass goes on after each recovery from the survivors' last whole
step; when recoveries keep coming without the pass getting further, it gives up
(`pass_stall`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["STALL_LIMIT", "Redo", "pass_stall", "plan_redo", "stall_message"]

STALL_LIMIT = 3  # recoveries in a row without progress after which a pass gives up


@dataclass(frozen=True)
class Redo:
    """One step of the window after a recovery."""

    held: bool  # the group holds it: a member that finished it answers for it
    # sent again: the window position of the step whose `after` (its node-state updates,
    # as answered or sent again) it carries as its `before`; None: it keeps its own
    before: int | None = None


def plan_redo(indices: Sequence[int], done: int) -> tuple[Redo, ...]:
    """What becomes of each step of a window of step `indices` (in window order) when the
    group holds `done` steps."""
    plan = []
    for index in indices:
        if index < done:
            plan.append(Redo(True))
            continue
        previous = next((i for i, other in enumerate(indices) if other == index - 1), None)
        plan.append(Redo(False, previous))
    return tuple(plan)


def pass_stall(stalled: int, done: int, now: int) -> tuple[int, bool]:
    """(recoveries in a row after which the pass got no further, whether it gives up) after
    a recovery that took a pass from `done` results to `now`; `stalled`: the count before."""
    stalled = stalled + 1 if now == done else 0
    return stalled, stalled >= STALL_LIMIT


def stall_message(method: str, done: int, total: int, stalled: int, last_lost) -> str:
    """Why a pass (`method` of `total` steps) gave up at step `done`."""
    return (
        f"trainers keep failing at step {done} of a {method} of {total} steps ({stalled} "
        f"recoveries without progress); last lost: {last_lost}"
    )
