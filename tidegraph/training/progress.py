"""A dependency-free progress line per pass: events done of the pass's total, percent, events/s
over a sliding window, an ETA, and a closing line with the pass's mean rate (to stderr).

On a terminal the line is redrawn in place (`\\r`) every `tty_interval` seconds; elsewhere (a
file, `ray job logs`) a complete line is written at most every `line_interval` seconds, and
no `\\r`. A bar's total is every event its pass processes (replayed ones included), so it ends
at exactly 100%; a bar whose count goes past its total (a total that was wrong) stops showing
a percentage and says the total is unknown instead.

Also the learner's use of it for a pass (continual.py): the pass's bar lives in the pass state
(opened before the pass's first batch, never checkpointed), and a group that runs a whole pass
in one call reports its finished steps through a callback (`steps_shown`).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from tidegraph.training.schedule import Schedule, Unit

__all__ = ["Progress", "begin_pass", "close_pass_bar", "pass_bar", "steps_shown"]


class Progress:
    """Events done of `total` (None: not known ahead) under the name `desc`. `enabled`: write
    lines (the rates are kept either way); `done`: events already done when the bar opens (a
    pass resumed midway); `stream`: where lines go (stderr), redrawn in place when it is a
    terminal (`tty`, default: whether it says it is one); `clock`: seconds (tests fake it)."""

    tty_interval = 0.5  # seconds between redraws on a terminal
    line_interval = 10.0  # seconds between lines elsewhere (files, `ray job logs`)
    window = 10.0  # the rate is taken over the updates of the last this many seconds
    min_span = 1.0  # no rate is shown before the updates span this long

    def __init__(
        self,
        total: int | None,
        desc: str,
        enabled: bool = True,
        *,
        done: int = 0,
        stream: TextIO | None = None,
        tty: bool | None = None,
        clock=time.perf_counter,
    ) -> None:
        self.total, self.desc, self.enabled = total, desc, enabled
        self.stream = sys.stderr if stream is None else stream
        self.tty = _is_tty(self.stream) if tty is None else tty
        self.clock = clock
        self.done = self.initial = done
        self.start = self._shown = clock()
        self._width = 0  # of the line drawn last (a terminal's, padded over when redrawn)
        # (time, done) of updates: the window's and the newest before it (not the opening:
        # what a pass does before its first update, such as starting tasks, is no rate)
        self._samples: deque[tuple[float, int]] = deque()

    @property
    def rate(self) -> float:
        """Mean events/s since the bar opened."""
        elapsed = self.clock() - self.start
        return (self.done - self.initial) / elapsed if elapsed > 0 else 0.0

    def window_rate(self, now: float | None = None) -> float | None:
        """Events/s over the updates of the last `window` seconds (from the newest update at
        or before the window's start); None while they span less than `min_span`."""
        if not self._samples:
            return None
        now = self.clock() if now is None else now
        t0, d0 = self._samples[0]
        return (self.done - d0) / (now - t0) if now - t0 >= self.min_span else None

    def update(self, n: int) -> None:
        self.done += n
        now = self.clock()
        if self.total is not None and self.done > self.total:
            self.total = None  # a wrong total: no percentage rather than a wrong one
        self._sample(now)
        interval = self.tty_interval if self.tty else self.line_interval
        if self.enabled and now - self._shown >= interval:
            self._shown = now
            self._write(self._line(now))

    def close(self) -> float:
        """Write the closing line (the pass's mean rate); returns the mean events/s."""
        rate = self.rate
        if self.enabled:
            elapsed = self.clock() - self.start
            took = f"{elapsed:.2f} s" if elapsed < 60 else _clock_time(elapsed)
            self._write(f"{self._count()} in {took}, mean {rate:,.0f} ev/s", end="\n")
        return rate

    def _sample(self, now: float) -> None:
        """Keep the updates of the window and the newest one before it (a sample every
        1/64 window at most: the newest replaces one made sooner than that after the one
        before it)."""
        s = self._samples
        if len(s) > 1 and now - s[-2][0] < self.window / 64:
            s[-1] = (now, self.done)
        else:
            s.append((now, self.done))
        while len(s) > 1 and s[1][0] <= now - self.window:
            s.popleft()

    def _count(self) -> str:
        if self.total is None:
            return f"{self.desc}: {self.done:,} events (total unknown)"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return f"{self.desc}: {self.done:,}/{self.total:,} events {pct:5.1f}%"

    def _line(self, now: float) -> str:
        rate = self.window_rate(now)
        if rate is None:
            return self._count()
        line = f"{self._count()} {rate:,.0f} ev/s"
        if self.total is not None and rate > 0:
            line += f" ETA {_clock_time((self.total - self.done) / rate)}"
        return line

    def _write(self, line: str, end: str = "") -> None:
        if self.tty:  # redrawn in place: pad over what the last line drew further right
            line, self._width = "\r" + line.ljust(self._width), len(line)
        self.stream.write(line + (end if self.tty else "\n"))
        self.stream.flush()


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _clock_time(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def begin_pass(ps: dict, schedule: Schedule, at: int, u: Unit, enabled: bool) -> None:
    """Before unit `u` (the run's unit `at`, a training or evaluation batch): at a pass's first
    batch, its accumulators in the pass state `ps` start empty and its clock starts; the pass's
    bar opens unless it is open (at a later batch: a run resumed midway)."""
    if u.part == 0:
        acc = ({"losses": [], "loss_events": 0} if u.kind == "train"
               else {"pos": [], "neg": [], "rank": []})  # fmt: skip
        ps.update(acc, t_pass=time.perf_counter())
    if "bar" not in ps:
        ps["bar"] = _pass_bar(ps, schedule, at, u, enabled)


def _pass_bar(ps: dict, schedule: Schedule, at: int, u: Unit, enabled: bool) -> Progress:
    """The bar of unit `u`'s pass. Its total is every event the pass processes: its batches'
    (the bounds of the unit closing the pass) and, when retraining, the epoch's replayed
    events (`ps["replayed"]`, split over its batches); what the pass did before `u` is done."""
    end = schedule.unit(at - u.part + u.parts)  # train_end or eval_end: the pass's bounds
    total, done = end.hi - end.lo, u.lo - end.lo
    if u.kind == "train":
        total, done = total + ps.get("replayed", 0), ps["loss_events"]
    what = "phase1" if u.increment < 0 else f"increment {u.increment + 1}"
    return Progress(total, f"{what} {u.kind} {max(u.epoch, 0) + 1}", enabled, done=done)


def pass_bar(ps: dict, n: int) -> None:
    """`n` more events done on the pass's bar in the pass state `ps`."""
    if "bar" in ps:
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
