"""Streaming event loaders: files of timestamped interactions -> time-ordered `EventBatch`es.

Formats: JODIE CSV (`user_id,item_id,timestamp,state_label,f1..fk`), TGL directories
(`edges.csv` + optional `edge_features.pt` / `node_features.pt`), SNAP-style edge lists
(`src dst t`, no header; more than three columns without a header or a `ColumnMap` are an
error, since any of them could be the time), any CSV through a `ColumnMap`, and Parquet.
`format="auto"` picks one from the path (see `sources.detect_format`). Edge features are the
JODIE feature fields, TGL's `edge_features.pt`, or the columns `ColumnMap.features` /
`LoaderConfig.features` name (CSV columns, Parquet columns or one Parquet list column); the
log says how many were read and from where, or which columns were left unread.

    reader = open_events("wiki.csv.gz", sort=True, quarantine="bad_rows.csv")
    for batch in reader:          # EventBatch, time order, eid = 0, 1, 2, ... over the stream
        ...
    reader.stats.rows_rejected

Assumptions and rules:
- Files are streamed a chunk at a time (`chunk_rows` rows); no file is read whole, except with
  `sort="full"`, which holds all events in memory to sort them.
- Batches come out in time order, ties in file order. `eid` numbers the yielded events 0..N-1.
- Ids are int64 (negative ones only with `negative_ids`, never in JODIE files) or, with
  `string_ids`, any non-empty text coded by the reader's `id_map` (`EventReader.id_map`): dense
  ids in order of first appearance in the time-ordered stream, consistent across passes.
- Bad rows (non-numeric or NaN time, negative (see above), non-integer or out-of-range ids --
  beyond `num_nodes` or int64 --, wrong field count or feature width, NaN or infinite features,
  invalid UTF-8, missing values, time out of order) raise `LoaderError` naming file, line and
  reason (the first bad row in file order); with `quarantine=PATH` they are written to that CSV
  (columns `line,reason,text`) instead, counted in `stats`, and a warning is logged. Valid rows
  are never dropped.
- A file that cannot be read on (truncated or corrupt compression, a corrupt Parquet file or
  feature tensor) or a Parquet column of a type no row of which could be read (a boolean or
  nested time column) raises `LoaderError` naming the file, quarantine or not.
- Line numbers: see `text` (1-based, header included, blank lines not counted).
  Parquet files report 1-based row positions instead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import torch

from tidegraph.storage.events import EventBatch
from tidegraph.storage.idmap import IdMap
from tidegraph.storage.ingest.config import LoaderConfig, LoaderError
from tidegraph.storage.ingest.order import FullSorter, Reorderer
from tidegraph.storage.ingest.parse import IdRules, RawChunk, Rejects, Rows, parse_chunk
from tidegraph.storage.ingest.sources import (
    ParquetSource,
    Source,
    TglSource,
    detect_format,
    load_tensor,
)
from tidegraph.storage.ingest.text import jodie_source, text_source

logger = logging.getLogger(__name__)

_QUARANTINE_SCHEMA = pa.schema(
    [("line", pa.int64()), ("reason", pa.string()), ("text", pa.string())]
)


@dataclass
class LoadStats:
    """Counts of one pass over a file; `rejected_by_reason` keys are reasons without values."""

    rows_read: int = 0
    rows_yielded: int = 0
    rows_rejected: int = 0
    rejected_by_reason: Counter = field(default_factory=Counter)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self) | {"rejected_by_reason": dict(self.rejected_by_reason)}


class EventReader:
    """An iterable over the time-ordered event batches of one file (one pass per iteration)."""

    def __init__(self, path: str | Path, config: LoaderConfig, id_map: IdMap | None = None) -> None:
        """`id_map`: with `config.string_ids`, the map of strings the batches' ids come from
        (None: a new one, `self.id_map`); it grows with every pass."""
        self.path = Path(path)
        self.config = config
        self.id_map = (id_map or IdMap(kind="str")) if config.string_ids else None
        if not self.path.exists():
            raise LoaderError(self.path, None, "no such file or directory")
        self.format = config.format if config.format != "auto" else detect_format(self.path)
        try:
            self._source, self._rules = self._make_source()
        except (OSError, pa.ArrowException) as exc:  # LoaderError is neither
            raise LoaderError(self.path, None, f"cannot read: {exc}") from None
        self.stats = LoadStats()
        self._log_features()

    def _log_features(self) -> None:
        """How many edge-feature columns are read and from where; unread columns too."""
        src = self._source
        if src.feature_count:
            logger.info("edge features: %d columns from %s", src.feature_count, src.feature_source)
            return
        unused = getattr(src, "unused", ())
        if unused:
            logger.info(
                "no edge features read from %s; its columns %s are not read (name them with "
                "--features, data.features or LoaderConfig.features)",
                src.path,
                unused,
            )

    def _make_source(self) -> tuple[Source, IdRules]:
        cfg, fmt = self.config, self.format
        rules = IdRules(node_bound=cfg.num_nodes, negative=cfg.negative_ids)
        if fmt == "jodie":
            if cfg.string_ids:
                reason = "string ids do not apply to format 'jodie' (its item ids are shifted "
                raise LoaderError(self.path, None, reason + "by the user count)")
            for name in ("columns", "features"):
                if getattr(cfg, name) is not None:
                    reason = (
                        f"LoaderConfig.{name} does not apply to format 'jodie' (user, item, "
                        "time, label, then every feature field); choose columns with format "
                        "'csv' (--format csv)"
                    )
                    raise LoaderError(self.path, None, reason)
            return jodie_source(self.path, cfg)
        if fmt == "tgl":
            return TglSource(self.path, cfg), rules
        if fmt == "parquet":
            return ParquetSource(self.path, cfg), rules
        header = cfg.header if cfg.header is not None else fmt == "csv"
        return text_source(self.path, cfg, cfg.columns, header=header, snap=fmt == "snap"), rules

    @property
    def unit(self) -> str:
        return self._source.unit

    def node_features(self) -> torch.Tensor | None:
        """TGL `node_features.pt` (memory-mapped) next to the edges; None if there is none."""
        return read_node_features(self._source.directory) if self.format == "tgl" else None

    def __iter__(self) -> Iterator[EventBatch]:
        self.stats = LoadStats()
        window = self.config.window
        order = FullSorter() if window is None else Reorderer(window)
        out = _Batcher(self.config.chunk_rows, self.stats)
        if self.id_map is not None:  # file-order codes per pass, stream-order ids per batch
            self._rules.text_ids = out.codes = IdMap(kind="str")
            out.id_map = self.id_map
        with _Quarantine(self.config.quarantine) as quarantine:
            for chunk in _readable(self._source):
                self.stats.rows_read += len(chunk.lines) + _count(chunk.rejects)
                rows, rejects = parse_chunk(chunk, self._rules, self.config.feature_dim)
                ready, late, bound = order.push(rows)
                # together: the first bad row in file order is the one raised
                self._reject(Rejects.cat([rejects, self._late(rows, late, bound)]), quarantine)
                yield from out.push(ready)
            yield from out.push(order.finish(), last=True)
        self._report()

    def _late(self, rows: Rows, late: np.ndarray, bound: np.ndarray) -> Rejects:
        if late.size == 0:
            return Rejects.empty()
        w = self.config.window
        kind, hint = (
            ("time decreases", "pass sort=True (data.reorder_window > 0) to reorder")
            if w == 0
            else (
                "too late for the reorder window",
                f"raise reorder_window={w} (data.reorder_window) or sort='full' "
                "(data.reorder_window: null)",
            )
        )
        reasons = [
            f"{kind}: time {t:g} is earlier than {b:g}, seen before ({hint})"
            for t, b in zip(rows.t[late].tolist(), bound.tolist(), strict=True)
        ]
        src, dst = rows.src[late], rows.dst[late]
        codes = self._rules.text_ids
        if codes is not None:  # string ids: their text, not the pass's codes
            src, dst = codes.text(src).to_pylist(), codes.text(dst).to_pylist()
        texts = [f"{s},{d},{t!r}" for s, d, t in zip(src, dst, rows.t[late].tolist(), strict=True)]
        return Rejects(rows.lines[late], reasons, texts)

    def _reject(self, rejects: Rejects, quarantine: _Quarantine) -> None:
        if len(rejects) == 0:
            return
        if not quarantine.active:
            i = int(np.argmin(rejects.lines))
            raise LoaderError(
                self._source.path, int(rejects.lines[i]), rejects.reasons[i], self.unit
            )
        quarantine.write(rejects)
        self.stats.rows_rejected += len(rejects)
        self.stats.rejected_by_reason.update(_kind(r) for r in rejects.reasons)

    def _report(self) -> None:
        s = self.stats
        if s.rows_rejected:
            logger.warning(
                "rejected %d of %d rows of %s (%s); written to %s",
                s.rows_rejected,
                s.rows_read,
                self._source.path,
                ", ".join(f"{k}: {v}" for k, v in s.rejected_by_reason.most_common()),
                self.config.quarantine,
            )


class _Batcher:
    """Cuts the stream of ready rows into batches of exactly `size` rows (the last may be short)."""

    def __init__(self, size: int, stats: LoadStats) -> None:
        self.size, self.stats = size, stats
        self._parts: list[Rows] = []  # joined only once they fill a batch: rows copy once
        self._count = 0
        self._eid = 0
        self.codes: IdMap | None = None  # string ids: the pass's codes of the parsed rows ...
        self.id_map: IdMap | None = None  # ... and the map the batches' ids come from

    def push(self, rows: Rows | None, last: bool = False) -> Iterator[EventBatch]:
        if rows is not None and len(rows):
            self._parts.append(rows)
            self._count += len(rows)
        if not self._parts or (self._count < self.size and not last):
            return
        rows = self._parts[0] if len(self._parts) == 1 else Rows.cat(self._parts)
        full = len(rows) if last else len(rows) - len(rows) % self.size
        for start in range(0, full, self.size):
            yield self._batch(rows.take(slice(start, min(start + self.size, full))))
        self._parts = [rows.take(slice(full, len(rows)))] if full < len(rows) else []
        self._count = len(rows) - full

    def _batch(self, rows: Rows) -> EventBatch:
        if self.codes is not None:  # dense ids in order of first appearance in the stream
            text = (self.codes.text(rows.src), self.codes.text(rows.dst))
            rows.src, rows.dst = self.id_map.map_text_events(*text)
        batch = _to_batch(rows, self._eid)
        self._eid += len(rows)
        self.stats.rows_yielded += len(rows)
        return batch


def _readable(source: Source) -> Iterator[RawChunk]:
    """The chunks of `source`; an I/O or Arrow failure (a corrupt file) is a LoaderError
    naming it."""
    try:
        yield from source.chunks()
    except (OSError, pa.ArrowException) as exc:  # LoaderError is neither
        raise LoaderError(source.path, None, f"cannot read: {exc}") from None


def _count(rejects: Rejects | None) -> int:
    return 0 if rejects is None else len(rejects)


def _kind(reason: str) -> str:
    """A reason without its values (reasons read `kind: details`)."""
    return reason.split(":", 1)[0]


def _to_batch(rows: Rows, first_eid: int) -> EventBatch:
    n = len(rows)
    return EventBatch(
        src=torch.from_numpy(np.ascontiguousarray(rows.src, dtype=np.int64)),
        dst=torch.from_numpy(np.ascontiguousarray(rows.dst, dtype=np.int64)),
        t=torch.from_numpy(np.ascontiguousarray(rows.t, dtype=np.float64)),
        eid=torch.from_numpy(np.arange(first_eid, first_eid + n, dtype=np.int64)),
        edge_feat=None if rows.feat is None else torch.from_numpy(_f32(rows.feat)),
        label=None if rows.label is None else torch.from_numpy(_f32(rows.label)),
    )


def _f32(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32)


class _Quarantine:
    """A CSV file of rejected rows, opened on entry when a path is configured."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self._writer: pacsv.CSVWriter | None = None

    @property
    def active(self) -> bool:
        return self.path is not None

    def __enter__(self) -> _Quarantine:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pacsv.CSVWriter(str(self.path), _QUARANTINE_SCHEMA)
        return self

    def write(self, rejects: Rejects) -> None:
        table = pa.table(
            [pa.array(rejects.lines, pa.int64()), rejects.reasons, rejects.texts],
            schema=_QUARANTINE_SCHEMA,
        )
        self._writer.write_table(table)

    def __exit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()


def open_events(
    path: str | Path,
    format: str = "auto",
    *,
    config: LoaderConfig | None = None,
    id_map: IdMap | None = None,
    **options,
) -> EventReader:
    """An `EventReader` over `path`; `options` are `LoaderConfig` fields (they override `config`);
    `id_map`: the map of string ids to extend (with `string_ids`).

    Example: open_events(p, columns=ColumnMap(src="u", dst="i", time="ts"), sort=True).
    """
    if config is None:
        config = LoaderConfig(format=format, **options)
    else:
        fmt = {"format": format} if format != "auto" else {}
        config = dataclasses.replace(config, **fmt, **options)
    return EventReader(path, config, id_map)


def load_events(
    path: str | Path,
    format: str = "auto",
    *,
    config: LoaderConfig | None = None,
    id_map: IdMap | None = None,
    **options,
) -> EventBatch:
    """All events of `path` as one `EventBatch` (same options as `open_events`)."""
    reader = open_events(path, format, config=config, id_map=id_map, **options)
    batches = list(reader)
    if not batches:
        return _to_batch(_empty_rows(), 0)
    return EventBatch.cat(batches)


def _empty_rows() -> Rows:
    e = np.empty(0)
    return Rows(src=e.astype(np.int64), dst=e.astype(np.int64), t=e, lines=e.astype(np.int64))


def read_node_features(path: str | Path) -> torch.Tensor | None:
    """TGL `node_features.pt` of a directory (or that file), memory-mapped; None if absent."""
    path = Path(path)
    return load_tensor(path / "node_features.pt" if path.is_dir() else path)
