"""The durable event log: every ingested batch, as a Parquet file under a storage URI.

Events are appended here before any shard sees them, so a run never acknowledges an event that
is not durable, and a shard rebuilt from a snapshot replays exactly the events after it (the log
offset is part of every checkpoint). `EventLog(uri)` takes a local path or any URI pyarrow.fs
reads (`s3://`, `gs://`, `file://`). Each batch of events [start, end) of the stream is one file
`events/{start:012d}-{end:012d}.parquet` (columns src, dst, t, eid, and feature columns
`f0..f{F-1}` when the stream has edge features), written to a temporary name and then moved
into place, so a reader never sees half a file; writing the same batch again (a resumed run
re-ingesting after its last checkpoint) replaces the file with the same rows.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from tidegraph.storage.events import EventBatch

__all__ = ["EventLog", "open_fs"]

_NAME = re.compile(r"^(\d{12})-(\d{12})\.parquet$")


def open_fs(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) of a local path or a URI pyarrow understands."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    import os

    return pafs.LocalFileSystem(), os.path.abspath(uri)


class EventLog:
    def __init__(self, uri: str, create: bool = True) -> None:
        """`create` False: a reader's view, which writes nothing (not even the directory)."""
        self.fs, root = open_fs(uri)
        self.dir = f"{root.rstrip('/')}/events"
        if create:
            self.fs.create_dir(self.dir, recursive=True)

    def append(self, events: EventBatch, start: int, end: int) -> None:
        """Make events [start, end) durable (they are `events`, in stream order)."""
        if end - start != len(events):
            raise ValueError(f"EventLog.append: [{start}, {end}) but {len(events)} events")
        cols = {
            "src": events.src.numpy(), "dst": events.dst.numpy(),
            "t": events.t.double().numpy(), "eid": events.eid.numpy(),
        }  # fmt: skip
        if events.edge_feat is not None:
            feat = events.edge_feat.float().numpy()
            cols.update({f"f{i}": feat[:, i] for i in range(feat.shape[1])})
        name = f"{self.dir}/{start:012d}-{end:012d}.parquet"
        tmp = f"{name}.tmp"
        with self.fs.open_output_stream(tmp) as out:
            pq.write_table(pa.table(cols), out)
        self.fs.move(tmp, name)

    def files(self) -> list[tuple[int, int, str]]:
        """(start, end, path) of every log file, by start."""
        return [(lo, hi, path) for lo, hi, path, _ in self.listing()]

    def listing(self) -> list[tuple[int, int, str, float | None]]:
        """(start, end, path, when it was written: seconds since the epoch, None where the
        file system does not say) of every log file, by start; one listing of the log."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.dir, allow_not_found=True))
        out = []
        for info in infos:
            m = _NAME.match(info.base_name)
            if m:
                when = None if info.mtime is None else info.mtime.timestamp()
                out.append((int(m.group(1)), int(m.group(2)), info.path, when))
        return sorted(out)

    @property
    def offset(self) -> int:
        """One past the last event the log holds without a gap from 0."""
        at = 0
        for start, end, _ in self.files():
            if start > at:
                break
            at = max(at, end)
        return at

    def read(self, start: int = 0, end: int | None = None) -> EventBatch:
        """Events [start, end) from the log (end None: up to its offset)."""
        end = self.offset if end is None else end
        parts = []
        for lo, hi, path in self.files():
            if hi <= start or lo >= end:
                continue
            with self.fs.open_input_file(path) as f:
                table = pq.read_table(f)
            keep = slice(max(start, lo) - lo, min(end, hi) - lo)
            parts.append(table.slice(keep.start, keep.stop - keep.start))
        if not parts:
            empty = torch.empty(0, dtype=torch.int64)
            return EventBatch(empty, empty, empty.double(), empty)
        table = pa.concat_tables(parts)
        got = table.num_rows
        if got != end - start:
            raise ValueError(f"EventLog.read: [{start}, {end}) has {got} events in the log")
        # a column of one chunk comes zero-copy and read-only (Arrow's memory): copied then,
        # so that the tensors handed out own writable memory
        col = lambda name: torch.from_numpy(  # noqa: E731
            np.require(table.column(name).to_numpy(), requirements=["C", "W"])
        )
        feats = [n for n in table.column_names if re.fullmatch(r"f\d+", n)]
        feat = None
        if feats:
            feat = torch.stack([col(n) for n in sorted(feats, key=lambda n: int(n[1:]))], 1)
        return EventBatch(col("src"), col("dst"), col("t"), col("eid"), feat)
