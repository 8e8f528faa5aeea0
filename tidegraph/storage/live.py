"""Live sources: event files arriving in a directory, or lines appended to a growing file.

Both hand out increments with `next_events(timeout)` -> `(name, EventBatch)` or None (they poll,
bounded by `timeout`), read with the loaders (any text format they detect, bad rows rejected or
quarantined as for a dataset, each increment sorted by time), and keep their position in
`state_dict()`: the orchestrator checkpoints it with the run, so a resumed run continues right
after the last increment it ingested. `open_source(path)` picks one by what `path` is.
Ids: any int64 value, negative ones too (except in JODIE lines, whose item ids are shifted);
the learner's id map makes them dense (`ContinualLearner.append`). String ids cannot be
followed: an increment's events carry int64 ids.

`DirectorySource(path)` hands out the files that appear in `path`, each once, in name order, a
file per increment. A writer makes a file appear whole: it writes under a hidden name (`.name`)
or a temporary suffix (`.tmp`, `.part`) and renames it when done; such names are never read.
State: the names consumed.

`GrowingFileSource(path, lines=N)` tails one text file (CSV, JODIE or SNAP lines; Parquet cannot
grow in place) that a writer appends complete lines to:
- Increments. The first call takes every complete line the file holds (phase 1; it waits for
  one). Later calls take, with `lines=0`, every complete line there at the poll; with `lines=N`
  exactly the next N complete non-blank lines once all of them are there -- or, when `timeout`
  passes with fewer, those (the file went quiet). N > 0 makes increments a function of the
  file's content alone, not of when its lines were written. A last line without its newline is
  left for a later call: no line is read twice, none skipped.
- Parsing. The comment and header lines (the prefix, read once) and the new lines go to
  `load_events` as one small file, so formats, column names, validation and quarantine are the
  loaders' own; line numbers in errors and in the quarantine file are those of the whole file
  (as a load of the whole file numbers them: blank lines not counted), and the quarantine file
  gathers the rejects of every increment. JODIE: item ids are shifted by the user count found
  in phase 1's lines (kept in the state, so ids stay consistent); a later user id at or past it
  is rejected as out of range.
- State: the byte offset after the last line consumed, the prefix, the rows consumed, the
  resolved format, the JODIE user count, the increment rule, and the last bytes before the
  offset (to recognise the file again).
- Errors. A file that shrinks below the offset (truncated), is another file (inode changed:
  replaced or rotated) or whose bytes before the offset changed (rewritten) raises ValueError
  naming it; the source never starts reading it again from the top.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from tidegraph.storage.events import EventBatch
from tidegraph.storage.ingest import LoaderConfig, LoaderError, load_events
from tidegraph.storage.ingest.sources import detect_format
from tidegraph.storage.ingest.text import Peek, jodie_source

__all__ = ["DirectorySource", "GrowingFileSource", "open_source"]

log = logging.getLogger(__name__)

_PARTIAL = (".tmp", ".part")
_COMPRESSED = (".gz", ".bz2", ".zst", ".xz", ".lz4", ".zip")
_HEADER_FORMATS = ("csv", "jodie")
_TAIL = 64  # bytes before the offset kept to recognise the file after a restart
_BLOCK = 1 << 23  # bytes read at a time while looking for N lines
_PEEK = 1 << 20  # bytes of the first lines enough to detect the format and the comments
# GrowingFileSource's position (see the module docstring)
_STATE = ("format", "lines", "opened", "offset", "prefix", "prefix_lines", "rows", "num_users",
          "tail")  # fmt: skip


def open_source(
    path: str,
    format: str = "auto",
    quarantine: str | None = None,
    lines: int = 0,
    string_ids: bool = False,
) -> DirectorySource | GrowingFileSource:
    """The live source `--follow PATH` names: a directory of arriving files or a growing file."""
    if string_ids:
        raise ValueError("--follow: string ids (--string-ids, data.string_ids) cannot be "
                         "followed; a live source's ids must be integers")  # fmt: skip
    if Path(path).is_dir():
        return DirectorySource(path, format, quarantine)
    if Path(path).is_file():
        return GrowingFileSource(path, format, quarantine, lines)
    raise ValueError(f"--follow: {path} is neither a directory nor a file")


class DirectorySource:
    poll_interval = 0.5  # seconds between looks at the directory (tests lower it)
    waiting_for = "event file"

    def __init__(self, path: str, format: str = "auto", quarantine: str | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"--follow: {path} is not a directory")
        self.format, self.quarantine = format, quarantine
        self.consumed: list[str] = []

    def _ready(self) -> list[Path]:
        done = set(self.consumed)
        files = [
            p for p in self.path.iterdir()
            if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_PARTIAL)
            and p.name not in done
        ]  # fmt: skip
        return sorted(files)

    def next_events(self, timeout: float) -> tuple[str, EventBatch] | None:
        """The next new file's events (sorted by time), or None when none came in time."""
        deadline = time.monotonic() + timeout
        while True:
            ready = self._ready()
            if ready:
                path = ready[0]
                events = load_events(path, self.format, sort="full", quarantine=self.quarantine,
                                     negative_ids=True)  # fmt: skip
                self.consumed.append(path.name)
                return path.name, events
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_interval)

    def state_dict(self) -> dict:
        return {"kind": "directory", "path": str(self.path), "consumed": list(self.consumed)}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "directory", self.path)
        self.consumed = list(state["consumed"])


class GrowingFileSource:
    poll_interval = 0.5  # seconds between looks at the file (tests lower it)
    waiting_for = "complete event line"

    def __init__(
        self, path: str, format: str = "auto", quarantine: str | None = None, lines: int = 0
    ) -> None:
        """`lines`: the increment rule (0: all complete lines at each poll; N: N lines each)."""
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"--follow: {path} is not a file")
        if self.path.suffix.lower() in _COMPRESSED or format in ("parquet", "tgl"):
            raise ValueError(
                f"--follow: {path}: a growing file must be uncompressed text (CSV, JODIE or "
                "SNAP lines); follow a directory for Parquet files"
            )
        if isinstance(lines, bool) or not isinstance(lines, int) or lines < 0:
            raise ValueError(f"--follow-lines must be an integer >= 0, got {lines!r}")
        self.format, self.quarantine, self.lines = format, quarantine, lines
        self.opened = False  # format and prefix fixed (by the first complete lines)
        self.offset = 0  # bytes consumed: the prefix, then whole lines
        self.prefix = b""  # comment and header lines, put before every increment's lines
        self.prefix_lines = 0  # their line count, as the loaders number lines
        self.rows = 0  # non-blank lines consumed after the prefix
        self.num_users: int | None = None  # JODIE: the item id shift, fixed by phase 1
        self.tail = b""  # the last bytes before the offset
        self.inode = self.path.stat().st_ino

    # ---- polling ------------------------------------------------------------------------------

    def next_events(self, timeout: float) -> tuple[str, EventBatch] | None:
        """The next increment's events (sorted by time), or None when none came in time."""
        deadline = time.monotonic() + timeout
        while True:
            late = time.monotonic() >= deadline
            data = self._new_lines()
            if not self.opened:
                data = self._read_prefix(data)
            end = self._cut(data, late) if data is not None else 0
            if end:
                return self.path.name, self._take(data[:end])
            if late:
                return None
            time.sleep(self.poll_interval)

    def _new_lines(self) -> bytes:
        """The complete lines after the offset (with N > 0, at least N of them when there),
        checking that the file is still the one consumed so far."""
        with self.path.open("rb") as f:
            st = os.fstat(f.fileno())
            self._check_same(st.st_ino, st.st_size)
            f.seek(self.offset - len(self.tail))
            if f.read(len(self.tail)) != self.tail:
                raise self._changed("its bytes before the consumed offset changed (rewritten)")
            parts, left = [], st.st_size - self.offset
            while left > 0:
                block = f.read(min(left, _BLOCK))
                if not block:
                    break
                parts.append(block)
                left -= len(block)
                if self.lines and self.rows and _nonblank(b"".join(parts)) >= self.lines:
                    break
        data = b"".join(parts)
        return data[: data.rfind(b"\n") + 1]

    def _check_same(self, inode: int, size: int) -> None:
        if inode != self.inode:
            raise self._changed("it is another file now (replaced or rotated)")
        if size < self.offset:
            raise self._changed(f"it shrank to {size} bytes, below the {self.offset} consumed "
                                "(truncated)")  # fmt: skip

    def _changed(self, what: str) -> ValueError:
        return ValueError(
            f"--follow: {self.path}: {what}; a followed file may only grow by appended lines"
        )

    def _read_prefix(self, data: bytes) -> bytes | None:
        """The first complete lines: fix the format and the prefix (comment lines, then the
        header for formats that have one); the rest of `data`, or None until both are there."""
        ends, nonblank = _line_ends(data)
        with tempfile.TemporaryDirectory(prefix="tidegraph-follow-") as tmp:
            part = Path(tmp) / self.path.name  # its first lines: the loaders look no further
            part.write_bytes(data[: data.rfind(b"\n", 0, _PEEK) + 1] or data)
            comments = Peek(part).comments
            later = np.flatnonzero(nonblank[comments:])
            if later.size == 0:  # no line after the comments yet
                return None
            fmt = self.format if self.format != "auto" else detect_format(part)
        if fmt in ("parquet", "tgl"):
            raise ValueError(f"--follow: {self.path}: format {fmt} cannot grow line by line")
        n = comments + int(later[0]) + 1 if fmt in _HEADER_FORMATS else comments
        self.format, self.opened = fmt, True
        self.prefix = data[: ends[n - 1]] if n else b""
        self.prefix_lines = int(nonblank[:n].sum())
        self.offset = len(self.prefix)
        self.tail = self.prefix[-_TAIL:]
        return data[len(self.prefix) :]

    def _cut(self, data: bytes, late: bool) -> int:
        """Bytes of `data` the next increment takes (0: none yet), by the increment rule."""
        ends, nonblank = _line_ends(data)
        count = int(nonblank.sum())
        if count == 0:
            return 0
        if self.rows == 0 or not self.lines or (late and count < self.lines):
            return len(data)  # phase 1, "what arrived", or the short last increment
        if count < self.lines:
            return 0
        return int(ends[np.flatnonzero(nonblank)[self.lines - 1]])

    # ---- parsing ------------------------------------------------------------------------------

    def _take(self, data: bytes) -> EventBatch:
        """Events of the complete lines `data` (right after the offset), then move past them."""
        first = self.prefix_lines + self.rows + 1
        with tempfile.TemporaryDirectory(prefix="tidegraph-follow-") as tmp:
            part = Path(tmp) / self.path.name  # the loaders' own messages then name it
            part.write_bytes(self.prefix + data)
            rejects = None if self.quarantine is None else Path(tmp) / "rejects.csv"
            try:
                events = load_events(part, self.format, sort="full", quarantine=rejects,
                                     negative_ids=True, **self._options(part))  # fmt: skip
            except LoaderError as err:  # the same error, of the followed file and its line
                raise LoaderError(self.path, self._whole_line(err.line), err.reason) from None
            if rejects is not None and rejects.exists():
                self._keep_rejects(rejects, fresh=self.rows == 0)
        rows = _nonblank(data)
        self.offset += len(data)
        self.rows += rows
        self.tail = (self.tail + data)[-_TAIL:]
        log.info("%s: lines %d-%d brought %d events", self.path, first, first + rows - 1,
                 len(events))  # fmt: skip
        return events

    def _options(self, part: Path) -> dict:
        """Loader options that keep increments consistent: JODIE's item id shift, which
        phase 1's lines fix for good."""
        if self.format != "jodie":
            return {}
        if self.num_users is None:
            self.num_users = jodie_source(part, LoaderConfig(format="jodie"))[1].dst_offset
        return {"num_users": self.num_users}

    def _whole_line(self, line: int | None) -> int | None:
        """A line number of the increment's small file as a line number of the followed file."""
        if line is None or line <= self.prefix_lines:
            return line
        return line + self.rows

    def _keep_rejects(self, rejects: Path, fresh: bool) -> None:
        """Append an increment's rejected rows, renumbered, to the quarantine file (a fresh
        source starts it anew, as a load of the whole file would)."""
        table = _read_rejects(rejects)
        lines = table.column("line").to_numpy()
        shifted = np.where(lines > self.prefix_lines, lines + self.rows, lines)
        table = table.set_column(0, "line", pa.array(shifted, pa.int64()))
        if table.num_rows:
            log.warning("%s: %d rejected rows, the first at line %d, written to %s", self.path,
                        table.num_rows, int(shifted.min()), self.quarantine)  # fmt: skip
        dest = Path(self.quarantine)
        dest.parent.mkdir(parents=True, exist_ok=True)
        header = fresh or not dest.exists() or dest.stat().st_size == 0
        out = pa.BufferOutputStream()
        pacsv.write_csv(table, out, pacsv.WriteOptions(include_header=header))
        with dest.open("wb" if fresh else "ab") as f:
            f.write(out.getvalue().to_pybytes())

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"kind": "file", "path": str(self.path)} | {k: getattr(self, k) for k in _STATE}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the state's last line: the file must still hold the bytes consumed
        (same prefix, same bytes before the offset); rejects of later lines, written before a
        restart, leave the quarantine file (those lines are read again)."""
        _check_kind(state, "file", self.path)
        if state["lines"] != self.lines:
            log.warning("--follow-lines %d ignored: the run takes increments of %d lines as "
                        "before", self.lines, state["lines"])  # fmt: skip
        for key in _STATE:
            setattr(self, key, state[key])
        with self.path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(len(self.prefix))
            f.seek(max(self.offset - len(self.tail), 0))
            tail = f.read(len(self.tail))
        if size < self.offset or head != self.prefix or tail != self.tail:
            raise self._changed("it no longer holds the lines this run consumed")
        self.inode = self.path.stat().st_ino
        if self.quarantine is not None and Path(self.quarantine).exists():
            self._trim_rejects(self.prefix_lines + self.rows)

    def _trim_rejects(self, last: int) -> None:
        dest = Path(self.quarantine)
        table = _read_rejects(dest)
        keep = table.filter(pa.array(table.column("line").to_numpy() <= last))
        if keep.num_rows == table.num_rows:
            return
        tmp = dest.with_name(dest.name + ".tmp")
        pacsv.write_csv(keep, str(tmp))
        tmp.replace(dest)


def _check_kind(state: dict, kind: str, path: Path) -> None:
    found = state.get("kind", "directory")  # states before growing files were directories
    if found != kind:
        raise ValueError(
            f"--follow {path}: the run followed a {found} ({state.get('path')}), not a {kind}"
        )
    if state.get("path") not in (None, str(path)):
        log.warning("following %s where the run followed %s", path, state["path"])


def _line_ends(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """One past each newline of `data`, and which lines are not blank (the loaders skip empty
    lines, a lone carriage return included, without counting them)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(buf == 10)
    if newlines.size == 0:
        return newlines, np.zeros(0, dtype=bool)
    starts = np.concatenate([[0], newlines[:-1] + 1]).astype(np.int64)
    length = newlines - starts
    lone_cr = (length == 1) & (buf[starts] == 13)
    return newlines + 1, ~((length == 0) | lone_cr)


def _nonblank(data: bytes) -> int:
    return int(_line_ends(data)[1].sum())


def _read_rejects(path: Path) -> pa.Table:
    types = {"line": pa.int64(), "reason": pa.string(), "text": pa.string()}
    return pacsv.read_csv(str(path), convert_options=pacsv.ConvertOptions(column_types=types))
