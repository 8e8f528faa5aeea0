"""A run's stream on disk, so the driver never holds a file's events: `EventSpool`.

A run from a file (or a bundled dataset) reads it once, a chunk at a time, through the loaders
(validation, time order, id map, quarantine), and writes the events, in stream order and with
dense ids, as Parquet parts under `{run}/stream/` (through `pyarrow.fs`: a local path or a
storage URI). The driver then holds only what the stream's description needs (its length,
node count, feature width, id map) and reads the events of the block under way back from the
spool. Old events come from the durable event log, as for every run with one.

Layout: `part-{lo:012d}-{hi:012d}.parquet` per `part_events` events (row groups of
`ROW_GROUP` rows, so a range reads only the groups it touches), columns `src`, `dst`, `t`,
`label` when the stream has labels, and `feat` (a fixed-size list) when it has edge features;
eids are the positions. `idmap.pt` holds the stream's id map, and `manifest.json`, written last,
makes the spool complete: a spool without one (a load that was killed) is written again.
Parts wholly before an offset every kept checkpoint has passed can be dropped
(`drop_before`): those events are in the event log. The time-window increment ends, the only
layout computed from the stream's times, are kept in the manifest once computed, so a resumed
run whose first parts were dropped cuts the same increments.
"""

from __future__ import annotations

import bisect
import io
import json
import logging
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from tidegraph.storage.checkpoint import read_file, write_file
from tidegraph.storage.eventlog import open_fs
from tidegraph.storage.events import EventBatch

__all__ = ["EmptyStream", "EventSpool", "window_ends"]

log = logging.getLogger(__name__)

PART_EVENTS = 1 << 20
ROW_GROUP = 1 << 16
MANIFEST = "manifest.json"
VERSION = 1  # of the layout; a spool of another is written again
_DTYPES = {str(d): d for d in (torch.int64, torch.int32, torch.float64, torch.float32)}


class EmptyStream(ValueError):
    """A stream without events cannot be spooled."""


class EventSpool:
    """The complete spool at `uri` (`open` or `write` make one)."""

    def __init__(self, fs: pafs.FileSystem, root: str, manifest: dict) -> None:
        self.fs, self.root, self.manifest = fs, root, manifest
        self._starts = [lo for lo, _ in manifest["parts"]]

    # ---- making one ---------------------------------------------------------------------------

    @classmethod
    def open(cls, uri: str, fingerprint: dict) -> EventSpool | None:
        """The complete spool at `uri` written for `fingerprint` (the data settings), or None
        (none there, a load that did not finish, or other settings)."""
        fs, root = open_fs(uri)
        path = f"{root}/{MANIFEST}"
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return None
        manifest = json.loads(read_file(fs, path))
        if manifest.get("version") != VERSION:
            log.warning("spool %s has layout version %r, not %d; reading the data again", root,
                        manifest.get("version"), VERSION)  # fmt: skip
            return None
        if manifest.get("fingerprint") != fingerprint:
            log.warning("spool %s was written for other data settings; reading the data again",
                        root)  # fmt: skip
            return None
        return cls(fs, root, manifest)

    @classmethod
    def write(
        cls, uri: str, batches: Iterable[EventBatch], fingerprint: dict,
        part_events: int | None = None,
    ) -> EventSpool:  # fmt: skip
        """Spool `batches` (the stream in order) to `uri`, replacing whatever is there; the
        spool is complete once `finish` has described it (before, `map_ids` may rewrite its
        ids)."""
        part_events = part_events or PART_EVENTS
        fs, root = open_fs(uri)
        fs.create_dir(root, recursive=True)
        fs.delete_dir_contents(root, missing_dir_ok=True)
        parts, pending, at, first = [], [], 0, None
        for batch in batches:
            if not len(batch):
                continue
            if first is None:
                first = batch.select(slice(0, 0))  # the fields and dtypes
            pending.append(batch)
            held = sum(len(b) for b in pending)
            while held >= part_events:
                head, pending = _split(pending, part_events)
                parts.append(_write_part(fs, root, head, at))
                at, held = at + part_events, held - part_events
        if pending:
            head, _ = _split(pending, sum(len(b) for b in pending))
            parts.append(_write_part(fs, root, head, at))
            at += len(head)
        if first is None:
            raise EmptyStream("EventSpool.write: the stream holds no events")
        manifest = {
            "version": VERSION, "fingerprint": fingerprint, "num_events": at, "parts": parts,
            "dropped_before": 0, "t": str(first.t.dtype),
            "label": None if first.label is None else str(first.label.dtype),
            "feat": None if first.edge_feat is None else [str(first.edge_feat.dtype),
                                                          int(first.edge_feat.shape[1])],
            "window_ends": {},
        }  # fmt: skip
        return cls(fs, root, manifest)

    def map_ids(self, fn: Callable) -> int:
        """Rewrite every part's (src, dst) as `fn(src, dst)`, part by part in stream order
        (before `finish`); returns one past the largest id written."""
        top = 0
        for p, (lo, hi) in enumerate(self.manifest["parts"]):
            ev = self._read_part(p, lo, hi)
            ev.src, ev.dst = fn(ev.src, ev.dst)
            top = max(top, int(torch.maximum(ev.src.max(), ev.dst.max())) + 1)
            _write_part(self.fs, self.root, ev, lo)
        return top

    def finish(self, name: str, num_nodes: int, idmap, rows_read: int | None) -> None:
        """Describe the stream and make the spool complete (its manifest, written last)."""
        buf = io.BytesIO()
        torch.save(idmap.state_dict(), buf)
        write_file(self.fs, f"{self.root}/idmap.pt", buf.getvalue())
        self.manifest.update(name=name, num_nodes=num_nodes, rows_read=rows_read)
        self._save_manifest()
        log.info("stream spooled to %s: %d events in %d parts", self.root, self.num_events,
                 len(self.manifest["parts"]))  # fmt: skip

    # ---- what it holds ------------------------------------------------------------------------

    @property
    def num_events(self) -> int:
        return self.manifest["num_events"]

    def __len__(self) -> int:
        return self.num_events

    def idmap_state(self) -> dict:
        return torch.load(io.BytesIO(read_file(self.fs, f"{self.root}/idmap.pt")))

    def template(self) -> EventBatch:
        """No events, with the stream's fields and dtypes."""
        m = self.manifest
        e = torch.empty(0, dtype=torch.int64)
        feat = None
        if m["feat"] is not None:
            feat = torch.empty(0, m["feat"][1], dtype=_DTYPES[m["feat"][0]])
        label = None if m["label"] is None else torch.empty(0, dtype=_DTYPES[m["label"]])
        return EventBatch(e, e.clone(), torch.empty(0, dtype=_DTYPES[m["t"]]), e.clone(), feat,
                          label)  # fmt: skip

    def read(self, lo: int, hi: int) -> EventBatch:
        """Events [lo, hi) of the stream, in tensors of their own."""
        if not 0 <= lo <= hi <= self.num_events:
            raise ValueError(f"spool {self.root}: events [{lo}, {hi}) are outside its "
                             f"{self.num_events}")  # fmt: skip
        if lo < self.manifest["dropped_before"] and hi > lo:
            gone = self.manifest["dropped_before"]
            raise ValueError(f"spool {self.root}: events [{lo}, {hi}) were dropped (before "
                             f"{gone}); the event log holds them")  # fmt: skip
        pieces = [self.template()]
        p = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        while p < len(self._starts) and self._starts[p] < hi:
            if max(lo, self._starts[p]) < min(hi, self.manifest["parts"][p][1]):  # overlaps
                pieces.append(self._read_part(p, lo, hi))
            p += 1
        out = EventBatch.cat(pieces)
        out.eid = torch.arange(lo, hi)
        return out

    def times(self, start: int) -> Iterator[torch.Tensor]:
        """The stream's times from event `start` on, a row group at a time."""
        p = max(bisect.bisect_right(self._starts, start) - 1, 0)
        for q in range(p, len(self._starts)):
            plo, phi = self.manifest["parts"][q]
            f = self._file(q)
            starts = _group_starts(f)
            for g in range(f.num_row_groups):
                glo = plo + starts[g]
                if plo + starts[g + 1] <= start:
                    continue
                t = _column(f.read_row_group(g, columns=["t"]), "t", self.manifest["t"])
                yield t[max(start - glo, 0) :]

    def window_ends(self, start: int, window: float) -> list[int]:
        """`window_ends` over the spool's times, computed once and kept in the manifest."""
        key = f"{start}:{window!r}"
        cached = self.manifest["window_ends"].get(key)
        if cached is None:
            cached = window_ends(self.times(start), start, window)
            self.manifest["window_ends"][key] = cached
            self._save_manifest()
        return list(cached)

    def drop_before(self, offset: int) -> None:
        """Delete the parts wholly before event `offset` (the event log holds them)."""
        gone = [(lo, hi) for lo, hi in self.manifest["parts"] if hi <= offset]
        if not gone:
            return
        if gone[-1][1] > self.manifest["dropped_before"]:
            self.manifest["dropped_before"] = gone[-1][1]
            self._save_manifest()  # first: a reader never looks for a deleted part
            log.info("spool: dropped events before %d (in the event log)", gone[-1][1])
        for lo, hi in gone:  # those a kill left behind too
            path = self._path(lo, hi)
            if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
                self.fs.delete_file(path)

    # ---- internals ----------------------------------------------------------------------------

    def _save_manifest(self) -> None:
        write_file(self.fs, f"{self.root}/{MANIFEST}", json.dumps(self.manifest).encode())

    def _path(self, lo: int, hi: int) -> str:
        return _part_path(self.root, lo, hi)

    def _file(self, p: int) -> pq.ParquetFile:
        lo, hi = self.manifest["parts"][p]
        return pq.ParquetFile(self._path(lo, hi), filesystem=self.fs)

    def _read_part(self, p: int, lo: int, hi: int) -> EventBatch:
        """Events [lo, hi) of part p, reading only the row groups they fall in."""
        plo, phi = self.manifest["parts"][p]
        a, b = max(lo, plo) - plo, min(hi, phi) - plo
        f = self._file(p)
        starts = _group_starts(f)  # as the file's metadata gives them
        first = min(bisect.bisect_right(starts, a) - 1, f.num_row_groups - 1)
        last = max(bisect.bisect_left(starts, b), first + 1)  # groups [first, last) hold it
        table = f.read_row_groups(list(range(first, last)))
        table = table.slice(a - starts[first], b - a)
        m = self.manifest
        src, dst = _column(table, "src", "torch.int64"), _column(table, "dst", "torch.int64")
        feat = label = None
        if m["feat"] is not None:
            flat = table.column("feat").combine_chunks().flatten()  # the slice's values only
            feat = _tensor(flat, m["feat"][0]).reshape(-1, m["feat"][1])
        if m["label"] is not None:
            label = _column(table, "label", m["label"])
        t = _column(table, "t", m["t"])
        return EventBatch(src, dst, t, torch.empty(len(src), dtype=torch.int64), feat, label)


def window_ends(chunks: Iterable[torch.Tensor], start: int, window: float) -> list[int]:
    """Ends of the time windows of `window` seconds that cut a time-ordered stream from event
    `start` on (its times given in consecutive `chunks`): a window ends where
    floor((t - t[start]) / window) changes, and the last at the stream's end."""
    ends, at, t0, prev = [], start, None, None
    for t in chunks:
        if not t.numel():
            continue
        if t0 is None:
            t0 = t[0]
        win = torch.floor((t - t0) / window).long()
        if prev is not None and bool(win[0] != prev):
            ends.append(at)
        ends.extend((at + 1 + torch.nonzero(win[1:] != win[:-1]).flatten()).tolist())
        prev, at = win[-1], at + t.numel()
    if at > start:
        ends.append(at)
    return ends


def _split(batches: list[EventBatch], n: int) -> tuple[EventBatch, list[EventBatch]]:
    """(the first n events of `batches`, joined; the batches of the rest)."""
    head, rest, got = [], [], 0
    for b in batches:
        if got >= n:
            rest.append(b)
            continue
        take = min(n - got, len(b))
        head.append(b.select(slice(0, take)) if take < len(b) else b)
        if take < len(b):
            rest.append(b.select(slice(take, None)))
        got += take
    return EventBatch.cat(head), rest


def _group_starts(f: pq.ParquetFile) -> list[int]:
    """Where each row group of `f` starts, then its number of rows."""
    md = f.metadata
    return np.cumsum([0] + [md.row_group(g).num_rows for g in range(md.num_row_groups)]).tolist()


def _write_part(fs, root: str, ev: EventBatch, lo: int) -> list[int]:
    cols = {"src": pa.array(ev.src.numpy()), "dst": pa.array(ev.dst.numpy()),
            "t": pa.array(ev.t.numpy())}  # fmt: skip
    if ev.label is not None:
        cols["label"] = pa.array(ev.label.numpy())
    if ev.edge_feat is not None:
        feat = ev.edge_feat.contiguous()
        cols["feat"] = pa.FixedSizeListArray.from_arrays(pa.array(feat.numpy().reshape(-1)),
                                                         int(feat.shape[1]))  # fmt: skip
    hi = lo + len(ev)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(cols), sink, row_group_size=ROW_GROUP)
    write_file(fs, _part_path(root, lo, hi), sink.getvalue())
    return [lo, hi]


def _part_path(root: str, lo: int, hi: int) -> str:
    return f"{root}/part-{lo:012d}-{hi:012d}.parquet"


def _tensor(array: pa.Array, dtype: str) -> torch.Tensor:
    values = np.array(array.to_numpy(zero_copy_only=False))  # its own, writable copy
    out = torch.from_numpy(values)
    if str(out.dtype) != dtype:
        raise ValueError(f"spool: a column of {out.dtype} where {dtype} was written")
    return out


def _column(table: pa.Table, name: str, dtype: str) -> torch.Tensor:
    return _tensor(table.column(name).combine_chunks(), dtype)
