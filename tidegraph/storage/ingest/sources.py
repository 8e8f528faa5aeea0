"""File formats for the event loaders: detection, Parquet files and TGL directories.

Internal to `tidegraph.storage.ingest`; delimited text lives in `text`. Parquet is
streamed with `ParquetFile.iter_batches` (row numbers are 1-based row positions); column types
are checked against the schema before any row is read: ids must be integers, floats or text,
time a number or a timestamp/date (converted to seconds since the epoch, as the log says),
features numbers or one list of numbers; booleans and nested columns are refused there. A TGL
directory is `edges.csv` (columns `src,dst,time`, others ignored unless named as features) plus
optional `edge_features.pt` with one row per line of `edges.csv` in file order, memory-mapped
and gathered per chunk, and `node_features.pt`; an `edges.csv` path with an `edge_features.pt`
beside it is read as its directory.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from tidegraph.storage.ingest.config import (
    ColumnMap,
    LoaderConfig,
    LoaderError,
    check_width,
    infer_columns,
    resolve_columns,
)
from tidegraph.storage.ingest.parse import RawChunk, is_list
from tidegraph.storage.ingest.text import (
    Peek,
    detect_delimiter,
    is_number,
    split_snap,
    text_source,
    with_features,
)

logger = logging.getLogger(__name__)

_PARQUET_SUFFIXES = (".parquet", ".pq")
_SECONDS = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


class Source(Protocol):
    """What the reader needs of a format: the file errors name, its row unit, raw chunks."""

    path: Path
    unit: str
    feature_count: int  # edge-feature width read (0: none)
    feature_source: str  # where they come from, for the log

    def chunks(self) -> Iterator[RawChunk]: ...


def detect_format(path: Path) -> str:
    """The format of `path`: a directory is TGL, a .parquet file Parquet, else from line 1."""
    if path.is_dir() or is_tgl_edges(path):
        return "tgl"
    if path.suffix.lower() in _PARQUET_SUFFIXES:
        return "parquet"
    peek = Peek(path)
    if peek.complete and not peek.lines:
        return "snap"  # no lines, so no header either: an empty edge list
    first = peek.first()
    if first.lower().startswith("user_id"):
        return "jodie"
    fields = split_snap(first, detect_delimiter(first))
    head = fields[0] if fields else ""
    return "snap" if is_number(head) else "csv"


def is_tgl_edges(path: Path) -> bool:
    """An `edges.csv` of a TGL directory (its `edge_features.pt` beside it)."""
    return path.name == "edges.csv" and (path.parent / "edge_features.pt").exists()


class ParquetSource:
    """Streams a Parquet file in record batches; row numbers are 1-based row positions."""

    unit = "row"

    def __init__(self, path: Path, cfg: LoaderConfig) -> None:
        self.path = path
        # each use opens the file and closes it when done (or when its generator is dropped), so
        # no reader outlives its pass: arrow threads left at interpreter exit can abort it
        with pq.ParquetFile(str(path)) as file:
            self.schema = file.schema_arrow
            names = self.schema.names
            columns = cfg.columns or infer_columns(names, path, header_line=None)
            columns = with_features(columns, cfg, path)
            self.roles, self.features = resolve_columns(
                columns, names, path, header_line=None, unit="row"
            )
            self._check_types()
            self.chunk_rows = cfg.chunk_rows
            width = cfg.feature_dim if cfg.feature_dim is not None else self._width(file)
            self.feature_width = width
        if not self._list_features():  # scalar columns: the count is the width, as in CSV
            check_width(len(self.features), cfg.feature_dim, path, None)
        self.feature_count = width if self._list_features() else len(self.features)
        kind = "list column" if self._list_features() else "columns"
        shown = self.features[0] if self._list_features() else self.features
        self.feature_source = f"{kind} {shown!r} of {path}"
        read = {*self.roles.values(), *self.features}
        self.unused = [n for n in names if n not in read]

    def _check_types(self) -> None:
        """Refuse by schema the column types no row of which could be read right."""
        for role, name in self.roles.items():
            type_ = _plain(self.schema.field(name).type)
            ok = _numeric(type_) or (role == "time" and _temporal(type_))
            ok = ok or (role in ("src", "dst") and _text(type_))
            ok = ok or (role == "label" and pa.types.is_boolean(type_))
            if not ok:
                need = {
                    "time": "a number, timestamp or date",
                    "label": "a number",
                }.get(role, "integers (or integral floats or text)")
                reason = f"{role} column {name!r} has type {type_}; it must hold {need}"
                raise LoaderError(self.path, None, reason)
            if role == "time" and _temporal(type_):
                logger.info(
                    "time column %r of %s is %s: converted to seconds since the epoch",
                    name,
                    self.path,
                    type_,
                )
        for name in self.features:
            type_ = _plain(self.schema.field(name).type)
            value = type_.value_type if is_list(type_) and len(self.features) == 1 else type_
            if not (_numeric(value) or pa.types.is_null(value)):  # null: empty or all-null
                reason = f"feature column {name!r} has type {type_}; it must hold numbers"
                raise LoaderError(self.path, None, reason)

    def _list_features(self) -> bool:
        return len(self.features) == 1 and is_list(self.schema.field(self.features[0]).type)

    def _width(self, file: pq.ParquetFile) -> int:
        """Width of a list-typed feature column: from its type, else from the first row."""
        if not self._list_features():
            return len(self.features)
        type_ = self.schema.field(self.features[0]).type
        if pa.types.is_fixed_size_list(type_):
            return type_.list_size
        for batch in file.iter_batches(batch_size=1, columns=self.features):
            lengths = pc.list_value_length(batch.column(0)).drop_null()
            if len(lengths):
                return lengths[0].as_py()
        return 0

    def chunks(self) -> Iterator[RawChunk]:
        with pq.ParquetFile(str(self.path)) as file:
            yield from self._batches(file)

    def _batches(self, file: pq.ParquetFile) -> Iterator[RawChunk]:
        wanted = list(dict.fromkeys([*self.roles.values(), *self.features]))
        start = 0
        for batch in file.iter_batches(batch_size=self.chunk_rows, columns=wanted):
            lines = np.arange(start + 1, start + 1 + batch.num_rows, dtype=np.int64)
            start += batch.num_rows
            columns = {r: _decoded(batch.column(c)) for r, c in self.roles.items()}
            if _temporal(columns["time"].type):
                columns["time"] = _seconds(columns["time"])
            columns.update({c: _decoded(batch.column(c)) for c in self.features})
            chunk = RawChunk(columns, dict(self.roles), lines, list(self.features))
            chunk.feature_width = self.feature_width
            yield chunk


def _plain(type_: pa.DataType) -> pa.DataType:
    """The type of the values (a dictionary-encoded column, as pandas categoricals write)."""
    return type_.value_type if pa.types.is_dictionary(type_) else type_


def _decoded(array: pa.Array) -> pa.Array:
    return array.dictionary_decode() if pa.types.is_dictionary(array.type) else array


def _numeric(type_: pa.DataType) -> bool:
    return pa.types.is_integer(type_) or pa.types.is_floating(type_) or pa.types.is_decimal(type_)


def _temporal(type_: pa.DataType) -> bool:
    return pa.types.is_timestamp(type_) or pa.types.is_date(type_)


def _text(type_: pa.DataType) -> bool:
    return pa.types.is_string(type_) or pa.types.is_large_string(type_)


def _seconds(array: pa.Array) -> pa.Array:
    """A timestamp or date column as float64 seconds since the epoch (nulls stay null)."""
    type_ = array.type
    if pa.types.is_date(type_):
        days = pc.cast(pc.cast(array, pa.date32()), pa.int32())
        return pc.multiply(pc.cast(days, pa.float64()), 86_400.0)
    ticks = array.view(pa.int64())  # UTC ticks, whatever the time zone shown
    per = _SECONDS[type_.unit]
    whole = pc.divide(ticks, per)  # integer division: nanoseconds exceed a float's 2**53
    rest = pc.subtract(ticks, pc.multiply(whole, per))
    as_float = lambda x: pc.cast(x, pa.float64())  # noqa: E731 -- both are below 2**53
    return pc.add(as_float(whole), pc.divide(as_float(rest), float(per)))


class TglSource:
    """A TGL directory: `edges.csv` streamed as CSV, edge features gathered from a mmap tensor."""

    unit = "line"

    def __init__(self, path: Path, cfg: LoaderConfig) -> None:
        directory = path if path.is_dir() else path.parent  # a directory or its edges.csv
        self.directory = directory
        edges = directory / "edges.csv" if path.is_dir() else path
        if not edges.exists():
            raise LoaderError(directory, None, "not a TGL directory: edges.csv is missing")
        self.path = edges
        self.feat = load_tensor(directory / "edge_features.pt")
        columns = cfg.columns or ColumnMap(src="src", dst="dst", time="time")
        if self.feat is not None:
            _check_feature_tensor(self.feat, directory / "edge_features.pt", cfg.feature_dim)
            if columns.features is not None or cfg.features is not None:
                reason = "edge features come from edge_features.pt; name no feature columns"
                raise LoaderError(directory / "edge_features.pt", None, reason)
        # feature_dim applies to edge_features.pt (checked above), not to columns of edges.csv
        csv_cfg = dataclasses.replace(cfg, feature_dim=None) if self.feat is not None else cfg
        hint = "TGL edges.csv starts with a header line naming src, dst and time"
        self.csv = text_source(edges, csv_cfg, columns, header=True, header_hint=hint)
        if self.feat is not None:
            self.feature_count = int(self.feat.shape[1])
            self.feature_source = f"{directory / 'edge_features.pt'} (rows in edges.csv order)"
        else:
            self.feature_count = self.csv.feature_count
            self.feature_source = self.csv.feature_source
            self.unused = self.csv.unused

    def chunks(self) -> Iterator[RawChunk]:
        for chunk in self.csv.chunks():
            if self.feat is not None:
                chunk.feat = self._features(chunk.lines - self.csv.first_data_line)
            yield chunk
        rows = self.csv.rows_seen
        if self.feat is not None and rows != self.feat.shape[0]:
            reason = f"has {self.feat.shape[0]} rows, edges.csv has {rows}"
            raise LoaderError(self.directory / "edge_features.pt", None, reason)

    def _features(self, ordinals: np.ndarray) -> np.ndarray:
        m = self.feat.shape[0]
        if ordinals.size and ordinals[-1] >= m:
            line = int(ordinals[ordinals >= m][0]) + self.csv.first_data_line
            reason = f"no edge features for this row: edge_features.pt has {m} rows"
            raise LoaderError(self.path, line, reason)
        rows = self.feat[torch.from_numpy(ordinals)]
        # float64 stays so: the parser refuses values float32 cannot hold instead of inf
        return (rows if rows.dtype == torch.float64 else rows.to(torch.float32)).numpy()


def load_tensor(path: Path) -> torch.Tensor | None:
    """A tensor saved with torch.save, memory-mapped when possible; None if the file is absent."""
    if not path.exists():
        return None
    try:
        try:
            value = torch.load(str(path), mmap=True, weights_only=True, map_location="cpu")
        except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
            value = torch.load(str(path), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 -- corrupt, truncated or a pickle: all unreadable
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LoaderError(path, None, f"cannot load the tensor: {reason}") from None
    if not isinstance(value, torch.Tensor):
        raise LoaderError(path, None, f"expected a tensor, found {type(value).__name__}")
    return value


def _check_feature_tensor(feat: torch.Tensor, path: Path, feature_dim: int | None) -> None:
    if feat.dim() != 2:
        raise LoaderError(path, None, f"expected a 2-D tensor [rows, features], got {feat.dim()}-D")
    if feature_dim is not None and feat.shape[1] != feature_dim:
        reason = f"feature width mismatch: {feat.shape[1]} features, expected {feature_dim}"
        raise LoaderError(path, None, reason)
