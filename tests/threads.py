"""Background threads of tests (a resize, a kill, a node removed while a run trains): what
such a thread raises fails the test that started it, instead of dying with the thread.

`Watched(target, *args)` is a daemon thread that keeps the exception its target raised;
`join(timeout)` raises it in the joining thread (the test), and fails the test when the
thread is still running after `timeout` (its loops are bounded, so a thread that outlives
them is a test that did not do what it meant to)."""

from __future__ import annotations

import threading

__all__ = ["Watched"]


class Watched(threading.Thread):
    def __init__(self, target, *args, name: str | None = None) -> None:
        super().__init__(name=name or getattr(target, "__name__", None), daemon=True)
        self._call = (target, args)
        self.error: BaseException | None = None

    def run(self) -> None:
        target, args = self._call
        try:
            target(*args)
        except BaseException as exc:  # kept for join(), in the test's thread
            self.error = exc

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread; raise what it raised, or fail if it is still running."""
        super().join(timeout)
        if self.is_alive():
            raise AssertionError(f"background thread {self.name!r} still runs after {timeout} s")
        if self.error is not None:
            error, self.error = self.error, None  # raised once
            raise error
