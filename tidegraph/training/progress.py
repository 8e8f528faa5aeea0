"""A dependency-free progress line per phase: events done, percent, events/s (to stderr)."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


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
