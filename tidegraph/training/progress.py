"""A dependency-free progress line per phase: events done, percent, events/s (to stderr).

Also the learner's use of it for a pass (continual.py): the pass's bar lives in the pass state
(made at its first unit, never checkpointed), and a group that runs a whole pass in one call
reports its finished steps through a callback (`steps_shown`).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidegraph.training.schedule import Unit

__all__ = ["Progress", "close_pass_bar", "pass_bar", "steps_shown"]


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool = True, min_interval: float = 0.5):
        self.total = total
        self.desc = desc
        self.enabled = enabled
        self.min_interval = min_interval
        self.done = 0
        self.start = time.perf_counter()
        self._shown = 0.0

    @property
    def rate(self) -> float:
        elapsed = time.perf_counter() - self.start
        return self.done / elapsed if elapsed > 0 else 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._shown >= self.min_interval or self.done >= self.total):
            self._shown = now
            pct = 100.0 * self.done / self.total if self.total else 100.0
            sys.stderr.write(
                f"\r{self.desc}: {self.done:,}/{self.total:,} events {pct:5.1f}% "
                f"{self.rate:,.0f} ev/s"
            )
            sys.stderr.flush()

    def close(self) -> float:
        """Finish the line; returns the mean events/s."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
        return self.rate


def pass_bar(ps: dict, u: Unit, n: int, enabled: bool) -> None:
    """`n` more events of unit `u`'s pass, on the bar in the pass state `ps` (made for the
    pass's first unit shown)."""
    if "bar" not in ps:
        what = "phase1" if u.increment < 0 else f"increment {u.increment + 1}"
        total = (u.hi - u.lo) * u.parts  # approximate: batches of equal size
        ps["bar"] = Progress(total, f"{what} {u.kind} {max(u.epoch, 0) + 1}", enabled)
    ps["bar"].update(n)


def close_pass_bar(ps: dict, n: int) -> float:
    """Close the pass's bar in `ps`; returns `n` events over the seconds since `ps["t_pass"]`
    (the pass's events/s)."""
    bar = ps.pop("bar", None)
    if bar is not None:
        bar.close()
    return n / max(time.perf_counter() - ps.pop("t_pass", time.perf_counter()), 1e-9)


def steps_shown(show):
    """A progress callback for a group's pass: given the steps finished so far, calls
    `show(i)` once for every step i not shown yet."""
    shown = 0

    def progress(steps: int) -> None:
        nonlocal shown
        for i in range(shown, steps):
            show(i)
        shown = max(shown, steps)

    return progress
