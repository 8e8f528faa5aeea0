"""Time order for the event loaders: the check, the bounded reorder window, and the full sort.

Internal to `tidegraph.storage.ingest`. Rows arrive in file order (their arrival index counts
valid rows only). With a reorder window of W rows, row i is *late* when its time is earlier than
the latest time among rows 0..i-W-1, i.e. an event may arrive up to W rows after events with a
later time. W = 0 means time must never decrease. Late rows are returned to the caller, which
raises or quarantines them; the others come out sorted by (time, arrival), a stable sort.

Why the result does not depend on chunk sizes: after reading rows up to index L, no later
non-late row can have a time below T = M[L-W] (M is the running maximum of time), so
the buffered rows with time <= T are final and are emitted; ties keep arrival order. The buffer
then holds at most W rows plus one chunk.
"""

from __future__ import annotations

import numpy as np

from tidegraph.storage.ingest.parse import Rows


class Reorderer:
    """Emits rows in time order within a reorder window of `window` rows (0 = check only)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._seen = 0  # valid rows pushed so far
        self._history = np.empty(0, dtype=np.float64)  # running max of the last `window` rows
        self._running_max = -np.inf
        self._buffer: Rows | None = None  # pending rows, sorted by (time, arrival)

    def push(self, rows: Rows) -> tuple[Rows, np.ndarray, np.ndarray]:
        """Add rows; returns (rows ready to emit, indices of late rows in `rows`, their bounds)."""
        n = len(rows)
        running = np.maximum.accumulate(np.concatenate([[self._running_max], rows.t]))[1:]
        lagged = self._lagged_max(running, n)
        late = np.flatnonzero(rows.t < lagged)
        ok = np.ones(n, dtype=bool)
        ok[late] = False
        self._advance(running, n)
        return self._emit(rows.take(np.flatnonzero(ok))), late, lagged[late]

    def finish(self) -> Rows | None:
        """The rows still buffered, sorted."""
        out, self._buffer = self._buffer, None
        return out

    def _lagged_max(self, running: np.ndarray, n: int) -> np.ndarray:
        """For each new row i: M[i-W-1], the latest time among rows 0..i-W-1."""
        lag = self.window + 1
        hist = self._history[-lag:]
        past = np.concatenate([np.full(lag - len(hist), -np.inf), hist, running])
        return past[:n]

    def _advance(self, running: np.ndarray, n: int) -> None:
        self._history = np.concatenate([self._history, running])[-(self.window + 1) :]
        self._seen += n
        if n:
            self._running_max = float(running[-1])

    def _threshold(self) -> float:
        """T = M[L-W] (L = last row seen): no later non-late row has a time below it."""
        if self._seen < self.window + 1:
            return -np.inf
        return float(self._history[-(self.window + 1)])

    def _emit(self, rows: Rows) -> Rows:
        empty = self._buffer is None or len(self._buffer) == 0
        merged = rows if empty else Rows.cat([self._buffer, rows])
        if not bool(np.all(merged.t[1:] >= merged.t[:-1])):  # sorted input skips the sort
            merged = merged.take(np.argsort(merged.t, kind="stable"))
        cut = int(np.searchsorted(merged.t, self._threshold(), side="right"))
        self._buffer = merged.take(slice(cut, None))
        return merged.take(slice(0, cut))


class FullSorter:
    """Collects every row, then sorts them all by (time, arrival) at the end."""

    def __init__(self) -> None:
        self._parts: list[Rows] = []

    def push(self, rows: Rows) -> tuple[Rows, np.ndarray, np.ndarray]:
        self._parts.append(rows)
        empty = np.empty(0, dtype=np.int64)
        return rows.take(empty), empty, np.empty(0)

    def finish(self) -> Rows | None:
        if not self._parts:
            return None
        rows = Rows.cat(self._parts)
        self._parts = []
        return rows.take(np.argsort(rows.t, kind="stable"))
