"""Loading a dataset as one time-ordered `EventBatch`: the single place training reads files.

`load_stream` accepts a bundled name (the registry is `tidegraph.data`: `wikipedia`, `uci`
and their aliases such as `collegemsg`) or a path. Both go through `tidegraph.storage.ingest`:
every format the loaders read (detected from the file), with their validation and error
messages, quarantine of bad rows when asked; edge features come along when the format has
them or the data section names them. `stream_for(config.data)` applies every option of a
`DataConfig`. Nothing else in training reads files.

Streaming. A file is read a chunk at a time and only the events' arrays are kept (never the
file's text or Arrow tables), so a run's memory is its events, graph, features and model.
Time order comes from a bounded reorder window (`data.reorder_window`, 100k rows by default):
an event may arrive up to that many rows after events with a later time; one later than that
is an error naming its line (or is quarantined), and `data.reorder_window: null` sorts the
whole file in memory instead (it then holds every row before the first event comes out).
`max_events` N stops reading once the first N events of that time order are out: a sorted
file is read up to about N + reorder_window rows (rows past N can still be earlier events),
never to its end; in an unsorted file the N events are the N earliest of the window-ordered
stream, the same prefix a whole run of the file would see first. Bundled datasets are small
and read whole (their node count is the whole file's).

Ids. Events enter a run here (and through `ContinualLearner.append`): node ids become dense
through an `IdMap` (`tidegraph.storage.idmap`) kept with the stream as `Stream.idmap`. Dense
data (the bundled datasets) keeps its ids bitwise; sparse, huge or negative int64 ids and,
with `data.string_ids`, string ids are mapped in order of first appearance. The map is state:
the learner checkpoints it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from tidegraph.data import bundled_names, bundled_path, is_bundled
from tidegraph.storage.events import EventBatch
from tidegraph.storage.idmap import IdMap
from tidegraph.storage.ingest import load_events, open_events, parse_columns, parse_features
from tidegraph.storage.spool import EmptyStream, EventSpool

__all__ = [
    "DEFAULT_REORDER_WINDOW", "Stream", "load_stream", "spooled_stream", "stream_for",
    "stream_of",
]  # fmt: skip

log = logging.getLogger(__name__)

DEFAULT_REORDER_WINDOW = 100_000


@dataclass
class Stream:
    """The whole stream in time order, with the node-id bound and the edge-feature width;
    `idmap` turns its dense ids back into the file's; `rows_read` counts the file's rows read
    (None for bundled data)."""

    events: EventBatch
    num_nodes: int
    edge_dim: int
    name: str
    idmap: IdMap | None = None
    rows_read: int | None = None
    spool: EventSpool | None = None  # the events, on disk (`events` is then none of them)

    @property
    def num_events(self) -> int:
        return self.spool.num_events if self.spool is not None else len(self.events)


def load_stream(
    dataset: str,
    max_events: int | None = None,
    *,
    format: str = "auto",
    quarantine: str | None = None,
    columns: str | dict | None = None,
    header: bool | None = None,
    features: str | list | None = None,
    string_ids: bool = False,
    reorder_window: int | None = DEFAULT_REORDER_WINDOW,
) -> Stream:
    """The stream of a bundled name or a file; the other options apply to files (the bundled
    files are read with their known layout)."""
    if is_bundled(dataset):
        return _bundled(dataset, max_events, format, quarantine, columns, header, features,
                        string_ids)  # fmt: skip
    reader = _open_file(dataset, format, quarantine, columns, header, features, string_ids,
                        reorder_window)  # fmt: skip
    events = _read(reader, max_events)
    _require_events(events, reader.path)
    stream = stream_of(events, reader.path.name, reader.id_map)
    stream.rows_read = reader.stats.rows_read
    _give_back_memory()
    return stream


def _bundled(dataset, max_events, format, quarantine, columns, header, features, string_ids):
    path = bundled_path(dataset)
    log.info("bundled dataset %s: %s", dataset, path)
    given = {"format": format != "auto", "quarantine": quarantine, "columns": columns,
             "header": header is not None, "features": features,
             "string_ids": string_ids}  # fmt: skip
    ignored = [k for k, v in given.items() if v]
    if ignored:
        log.warning("%s apply to files only: %s is read with its known layout",
                    ", ".join(ignored), dataset)  # fmt: skip
    events = load_events(path, sort="full")
    num_nodes = _num_nodes(events)  # of the whole file, as always for bundled data
    if max_events is not None:
        events = events.select(slice(0, max_events))
    _require_events(events, path)
    stream = stream_of(events, path.name, IdMap(num_nodes))  # dense: ids kept as they are
    stream.num_nodes = num_nodes
    return stream


def _open_file(dataset, format, quarantine, columns, header, features, string_ids,
               reorder_window):  # fmt: skip
    """A reader of the file `dataset` with every loader option."""
    path = _resolve(dataset)
    options = {
        "columns": parse_columns(columns, "data.columns"),
        "features": parse_features(features, "data.features"),
        "header": header,
    }
    if options["features"] is not None and getattr(options["columns"], "features", None):
        raise ValueError("data.features (--features): the feature columns are named in "
                         "data.columns (--columns) too; name them once")  # fmt: skip
    return open_events(path, format, quarantine=quarantine, negative_ids=True,
                       string_ids=string_ids, **_order(reorder_window, path),
                       **options)  # fmt: skip


def _give_back_memory() -> None:
    """Return the memory the load freed (chunks, batches joined, mapping temporaries) to the
    system: pyarrow's pool and glibc's heap keep freed pages (the job raises glibc's trim
    threshold for speed), so without this a run's RSS would stay at the load's peak."""
    pa.default_memory_pool().release_unused()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def _order(window: int | None, path: Path) -> dict:
    """Loader options for the time order `data.reorder_window` asks for (and the log line)."""
    if window is None:
        log.info("%s: sorted in memory by time (data.reorder_window: null holds the whole "
                 "file before the first event)", path)  # fmt: skip
        return {"sort": "full"}
    if window == 0:
        log.info("%s: time must not decrease (data.reorder_window 0)", path)
        return {"sort": False}
    log.info("%s: streamed in time order through a reorder window of %d rows (an event later "
             "than that is an error, or quarantined; data.reorder_window sets it, null sorts "
             "the whole file in memory)", path, window)  # fmt: skip
    return {"sort": "window", "reorder_window": window}


def _read(reader, max_events: int | None) -> EventBatch:
    """The reader's events, stopping once `max_events` are out (the file is not read on)."""
    batches = list(_batches(reader, max_events))
    if not batches:
        return _no_events()
    _give_back_memory()
    events = _joined(batches)
    _give_back_memory()
    return events


def _batches(reader, max_events: int | None) -> Iterator[EventBatch]:
    """The reader's batches, the last cut so that at most `max_events` are out (the file is
    not read on)."""
    count = 0
    for i, batch in enumerate(reader):
        if max_events is not None and count + len(batch) >= max_events:
            yield batch.select(slice(0, max_events - count))
            count = max_events
            break  # closes the reader's pass: its file and quarantine are closed
        count += len(batch)
        yield batch
        if i % 16 == 15:  # what parsing freed goes back before the next chunks
            _give_back_memory()
    rows = reader.stats.rows_read
    if max_events is not None and count >= max_events:
        log.info("%s: read %d rows for the first %d events (--max-events); the rest of the "
                 "file is not read", reader.path, rows, max_events)  # fmt: skip
    else:
        log.info("%s: read %d rows, %d events", reader.path, rows, count)


def _joined(batches: list[EventBatch]) -> EventBatch:
    """One batch of `batches` (emptied), joined a field at a time: the parts of a field are
    freed once it is joined, so the peak is the events plus one field, not twice the events."""
    names = [f.name for f in dataclasses.fields(EventBatch)]
    parts = {name: [getattr(b, name) for b in batches] for name in names}
    batches.clear()
    out = {}
    for name in names:
        values = parts.pop(name)
        out[name] = None if values[0] is None else torch.cat(values)
        del values
    return EventBatch(**out)


def _no_events() -> EventBatch:
    e = torch.empty(0, dtype=torch.int64)
    return EventBatch(src=e, dst=e.clone(), t=torch.empty(0, dtype=torch.float64), eid=e.clone())


def _require_events(events: EventBatch, path: Path) -> None:
    if len(events) == 0:
        raise ValueError(f"data.dataset: {path} holds no valid events")


def stream_for(data, spool: str | None = None, reuse: bool = False) -> Stream:
    """The stream a `DataConfig` names, with all its loader options; `spool`: a directory
    (path or storage URI) to write its events to, a chunk at a time, so that the stream holds
    none of them in memory (`spooled_stream`)."""
    if spool is not None:
        return spooled_stream(data, spool, reuse)
    return load_stream(
        data.dataset,
        data.max_events,
        format=data.format,
        quarantine=data.quarantine,
        columns=data.columns,
        header=data.header,
        features=data.features,
        string_ids=data.string_ids,
        reorder_window=data.reorder_window,
    )


def spooled_stream(data, uri: str, reuse: bool = False) -> Stream:
    """The stream of `data` with its events in an `EventSpool` at `uri`: with `reuse` (a
    resumed run), the spool found there when it is complete and was written for these data
    settings; else one written now (a fresh run reads its file again, however it changed),
    the file read once a chunk at a time (a bundled dataset, small, is read whole first).
    The stream's `events` are none (a template of the fields); `spool` holds them."""
    fingerprint = {k: v for k, v in dataclasses.asdict(data).items() if k != "quarantine"}
    spool = EventSpool.open(uri, fingerprint) if reuse else None
    if spool is not None:
        log.info("%s: the stream spooled at %s (%d events)", data.dataset, uri, spool.num_events)
        idmap = IdMap.from_state(spool.idmap_state())
    elif is_bundled(data.dataset):
        whole = _bundled(data.dataset, data.max_events, data.format, data.quarantine,
                         data.columns, data.header, data.features, data.string_ids)  # fmt: skip
        spool, idmap = EventSpool.write(uri, [whole.events], fingerprint), whole.idmap
        spool.finish(whole.name, whole.num_nodes, idmap, None)
        del whole
    else:
        spool, idmap = _spool_file(data, uri, fingerprint)
    m = spool.manifest
    feat = m["feat"]
    return Stream(events=spool.template(), num_nodes=m["num_nodes"],
                  edge_dim=0 if feat is None else feat[1], name=m["name"], idmap=idmap,
                  rows_read=m["rows_read"], spool=spool)  # fmt: skip


def _spool_file(data, uri: str, fingerprint: dict) -> tuple[EventSpool, IdMap]:
    """Spool a file a chunk at a time; (the spool, the stream's id map). Int ids are counted
    as they pass (`_IdCounts`); the map the whole stream calls for (`IdMap.for_counts`, as
    `stream_of` builds it) then rewrites the parts when it is not the identity; string ids
    come dense from the reader."""
    reader = _open_file(data.dataset, data.format, data.quarantine, data.columns, data.header,
                        data.features, data.string_ids, data.reorder_window)  # fmt: skip
    counts = _IdCounts()
    try:
        spool = EventSpool.write(uri, map(counts.see, _batches(reader, data.max_events)),
                                 fingerprint)  # fmt: skip
    except EmptyStream:
        _require_events(_no_events(), reader.path)
    _give_back_memory()
    idmap, top = reader.id_map, counts.top
    if idmap is None:
        idmap = IdMap.for_counts(counts.top, counts.size, counts.distinct)
        if not (idmap.identity_bound and counts.low >= 0):
            top = spool.map_ids(idmap.map_events)
    spool.finish(reader.path.name, top, idmap, reader.stats.rows_read)
    if idmap.mapped:
        log.info("%s: %d nodes; ids below %d kept as they are, %d others mapped to dense ids "
                 "in order of first appearance", reader.path.name, top, idmap.identity_bound,
                 idmap.mapped)  # fmt: skip
    return spool, idmap


class _IdCounts:
    """What `IdMap.for_ids` asks of a stream's ids, counted a batch at a time: how many,
    the smallest, one past the largest non-negative one (`top`), and how many distinct
    non-negative ones (kept as sorted runs, merged once they outgrow the merged set:
    memory in proportion to the nodes)."""

    def __init__(self) -> None:
        self.size, self.low, self.top = 0, 0, 0
        self._merged = np.empty(0, dtype=np.int64)
        self._runs: list[np.ndarray] = []

    def see(self, batch: EventBatch) -> EventBatch:
        if len(batch):
            ids = torch.cat([batch.src, batch.dst]).numpy()
            self.low = int(ids.min()) if self.size == 0 else min(self.low, int(ids.min()))
            self.size += ids.size
            plain = np.unique(ids[ids >= 0])
            if plain.size:
                self.top = max(self.top, int(plain[-1]) + 1)
                self._runs.append(plain)
                if sum(r.size for r in self._runs) > self._merged.size + (1 << 20):
                    self._merge()
        return batch

    @property
    def distinct(self) -> int:
        self._merge()
        return int(self._merged.size)

    def _merge(self) -> None:
        if self._runs:
            self._merged = np.unique(np.concatenate([self._merged, *self._runs]))
            self._runs = []


def stream_of(events: EventBatch, name: str, idmap: IdMap | None = None) -> Stream:
    """`events` (time-ordered, not empty) as a stream: eids become their positions, the rows
    of the stream and of its edge-feature store. `idmap`: the map the events' ids already come
    from; None: a new map (`IdMap.for_ids`) makes their ids dense (dense ids stay as they are)."""
    events.eid = torch.arange(len(events))
    if idmap is None:
        idmap = IdMap.for_ids(torch.stack([events.src, events.dst]))
        low = min(int(events.src.min()), int(events.dst.min())) if len(events) else 0
        if not (idmap.identity_bound and low >= 0):  # ids below the bound stay: no copy
            events.src, events.dst = idmap.map_events(events.src, events.dst)
    feat = events.edge_feat
    edge_dim = 0 if feat is None else int(feat.shape[1])
    stream = Stream(events=events, num_nodes=_num_nodes(events), edge_dim=edge_dim, name=name,
                    idmap=idmap)  # fmt: skip
    if idmap.mapped:
        log.info("%s: %d nodes; ids below %d kept as they are, %d others mapped to dense ids "
                 "in order of first appearance", name, stream.num_nodes, idmap.identity_bound,
                 idmap.mapped)  # fmt: skip
    return stream


def _num_nodes(events: EventBatch) -> int:
    return int(torch.maximum(events.src.max(), events.dst.max())) + 1


def _resolve(dataset: str) -> Path:
    path = Path(dataset)
    if not path.exists():
        raise ValueError(
            f"data.dataset: {dataset!r} is neither a bundled dataset {bundled_names()} "
            "(or an alias such as 'collegemsg') nor an existing file"
        )
    return path
