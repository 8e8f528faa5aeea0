"""Delimited text files for the event loaders: CSV, SNAP edge lists and JODIE CSV.

Internal to `tidegraph.storage.loaders`. Files are read with pyarrow's streaming CSV reader
(`pyarrow.csv.open_csv`, `.gz`/`.bz2` decompressed on the fly), one block (<= 4 MiB) at a time,
never whole. Id, time and label columns are read as text and parsed by `loaders_parse`, so a bad
value rejects one row instead of failing a block. Feature columns are read as float64 by pyarrow
itself (wide files spend most of their time there), which fails a whole block on one bad value;
the file is then read again as text from the first row not yet handed out, and the text path
names the bad row. pyarrow parses text to float64 exactly as the text path does (same values,
same strings refused; tests compare the two), so the result does not depend on the path taken.
Blocks are parsed on several threads; pyarrow only reports the line of a malformed row (wrong
field count) when it reads serially, so a file with such a row is read again serially from the
first row not yet handed out.

Assumptions:
- Line numbers are 1-based and count the header and leading comment lines; blank lines are
  skipped by the reader and not counted (so in a file with blank lines inside, numbers are
  those of the non-blank lines). A quoted field with a newline inside also shifts numbers.
- Comment lines (`#` or `%`, as in SNAP and KONECT files) are only recognised at the top.
- Fields are separated by exactly one delimiter character (tab, comma or space, detected from
  the first data line unless given); runs of spaces are not merged.
- JODIE: the header is one line whose names need not match the field count (JODIE writes
  `...,comma_separated_list_of_features`); the field count of the first data line sets the
  feature width. Item ids are shifted by `num_users` (given, or max user id + 1 found by a
  first pass that reads the user column only).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from tidegraph.storage.loaders_config import ColumnMap, LoaderConfig, LoaderError
from tidegraph.storage.loaders_parse import IdRules, RawChunk, Rejects

_PEEK_BYTES = 1 << 16
_COMMENTS = ("#", "%")
_ALIASES = {
    "src": ("src", "source", "u", "user", "user_id", "from", "sender", "node1"),
    "dst": ("dst", "target", "i", "item", "item_id", "to", "receiver", "node2"),
    "time": ("time", "ts", "t", "timestamp", "unixts", "date"),
    "label": ("label", "state_label", "y"),
}


class Peek:
    """The first lines of a text file: comment lines to skip, first lines, line lengths."""

    def __init__(self, path: Path) -> None:
        with pa.input_stream(str(path), compression="detect") as stream:
            raw = stream.read(_PEEK_BYTES)
        lines = raw.decode("utf-8", errors="replace").splitlines()
        if len(raw) == _PEEK_BYTES and len(lines) > 1:
            lines = lines[:-1]  # the last line may be cut
        self.comments = 0
        while self.comments < len(lines) and lines[self.comments].lstrip().startswith(_COMMENTS):
            self.comments += 1
        self.lines = [ln for ln in lines[self.comments :] if ln.strip()]
        lengths = [len(ln) + 1 for ln in self.lines] or [64]
        self.mean_len = sum(lengths) / len(lengths)
        self.max_len = max(lengths)

    def first(self, k: int = 0) -> str:
        return self.lines[k] if len(self.lines) > k else ""


def detect_delimiter(line: str) -> str:
    for d in ("\t", ",", " "):
        if d in line:
            return d
    return ","


def split_fields(line: str, delimiter: str) -> list[str]:
    return [f.strip().strip('"').strip() for f in line.split(delimiter)]


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class CsvSource:
    """Streams a delimited text file in chunks of text columns, tracking line numbers."""

    unit = "line"
    read_typed = True  # feature columns as float64 first; tests set False for the text path

    def __init__(
        self,
        path: Path,
        *,
        roles: dict[str, str],
        features: list[str],
        column_names: list[str] | None,
        skip_rows: int,
        delimiter: str,
        chunk_rows: int,
        block_size: int,
        width_kind: str = "wrong field count",
        lenient: bool = False,
    ) -> None:
        self.path, self.roles, self.features = path, roles, features
        self.column_names, self.skip_rows, self.delimiter = column_names, skip_rows, delimiter
        self.chunk_rows, self.block_size, self.width_kind = chunk_rows, block_size, width_kind
        self.lenient = lenient  # skip invalid rows without a record (the JODIE first pass)
        roles_read = set(roles.values())
        self.typed = [c for c in dict.fromkeys(features) if c not in roles_read]
        self._threads = True
        header = 0 if column_names is not None else 1
        self.first_data_line = skip_rows + header + 1
        self._reset()

    def _reset(self) -> None:
        self._skipped: list[int] = []  # data ordinals of structurally bad rows, ascending
        self._adjusted: list[int] = []  # skipped ordinal minus the number skipped before it
        self._pending: list[tuple[int, str, str]] = []
        self._read = 0  # rows returned by pyarrow so far

    def chunks(self) -> Iterator[RawChunk]:
        self._reset()
        threads, typed = True, self.read_typed and bool(self.typed)
        while (outcome := (yield from self._pass(threads, typed))) != "complete":
            if outcome == "invalid":  # only the serial reader reports an invalid row's line
                threads = False
            else:  # "unconvertible": the text path finds the bad value and names its row
                typed = False
        yield self._chunk(None)

    def _pass(self, threads: bool, typed: bool) -> Iterator[RawChunk]:
        """One read of the file; rows handed out by an earlier pass are skipped, not repeated.

        Returns "complete", "invalid" when a threaded pass stops at an invalid row, or
        "unconvertible" when a typed pass meets a feature value pyarrow cannot parse. An invalid
        row's handler runs while its block is parsed, and a conversion error is raised in place
        of its block's batch, so in both cases no row from that block or later was handed out.
        """
        self._threads, self._invalid = threads, False
        resume, seen = self._read, 0
        reader = self._open(threads, typed)
        if reader is None:
            return "unconvertible"
        try:
            for batch in _guarded(reader, self.path, typed):
                if batch is None:
                    return "unconvertible"
                if self._invalid and threads:
                    return "invalid"
                fresh = batch.slice(min(max(resume - seen, 0), batch.num_rows))
                seen += batch.num_rows
                for start in range(0, fresh.num_rows, self.chunk_rows):
                    yield self._chunk(fresh.slice(start, self.chunk_rows))
        finally:
            reader.close()
        return "invalid" if self._invalid and threads else "complete"

    def _open(self, threads: bool, typed: bool) -> pacsv.CSVStreamingReader | None:
        """A reader, or None when a typed reader fails on its first block (it reads one)."""
        wanted = list(dict.fromkeys([*self.roles.values(), *self.features]))
        types = {c: pa.string() for c in wanted}
        if typed:
            types.update({c: pa.float64() for c in self.typed})
        read = pacsv.ReadOptions(
            skip_rows=self.skip_rows,
            column_names=self.column_names,
            block_size=self.block_size,
            use_threads=threads,
        )
        parse = pacsv.ParseOptions(delimiter=self.delimiter, invalid_row_handler=self._on_invalid)
        convert = pacsv.ConvertOptions(
            include_columns=wanted,
            column_types=types,
            null_values=[],  # typed: an empty or "NA" feature fails the block, never a null
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
        )
        stream = pa.input_stream(str(self.path), compression="detect")
        try:
            return pacsv.open_csv(
                stream, read_options=read, parse_options=parse, convert_options=convert
            )
        except pa.ArrowInvalid as exc:
            stream.close()
            if typed:
                return None
            raise LoaderError(self.path, None, f"cannot read: {exc}") from exc

    def _on_invalid(self, row: pacsv.InvalidRow) -> str:
        self._invalid = True
        if self._threads or self.lenient:
            return "skip"
        ordinal = row.number - self.first_data_line
        if self._skipped and ordinal <= self._skipped[-1]:
            return "skip"  # recorded by an earlier serial pass that stopped at a typed block
        self._adjusted.append(ordinal - len(self._skipped))
        self._skipped.append(ordinal)
        counts = f"row has {row.actual_columns} fields, expected {row.expected_columns}"
        self._pending.append((row.number, f"{self.width_kind}: {counts}", row.text))
        return "skip"

    def _chunk(self, batch: pa.RecordBatch | None) -> RawChunk:
        n = 0 if batch is None else batch.num_rows
        k = np.arange(self._read, self._read + n, dtype=np.int64)
        self._read += n
        ordinals = k + np.searchsorted(np.asarray(self._adjusted, dtype=np.int64), k, "right")
        lines = ordinals + self.first_data_line
        last = int(lines[-1]) if n else None
        wanted = {**self.roles, **{c: c for c in self.features}}
        if batch is None:
            columns = {k: pa.array([], pa.string()) for k in wanted}
        else:
            columns = {k: batch.column(c) for k, c in wanted.items()}
        rejects = self._release(last)
        return RawChunk(columns, dict(self.roles), lines, list(self.features), rejects=rejects)

    @property
    def rows_seen(self) -> int:
        """Data rows read so far, good and structurally bad."""
        return self._read + len(self._skipped)

    def _release(self, last_line: int | None) -> Rejects:
        """Structural rejects up to `last_line` (all of them at the end of the file)."""
        cut = len(self._pending)
        if last_line is not None:
            cut = bisect.bisect_right([p[0] for p in self._pending], last_line)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        lines = np.array([p[0] for p in out], dtype=np.int64)
        return Rejects(lines, [p[1] for p in out], [p[2] for p in out])


def _guarded(
    reader: pacsv.CSVStreamingReader, path: Path, typed: bool
) -> Iterator[pa.RecordBatch | None]:
    """Batches of `reader`; a parse failure becomes a LoaderError naming the file, except in a
    typed pass, which ends with None instead (the text pass re-reads the block and reports)."""
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid as exc:
            if typed:
                yield None
                return
            raise LoaderError(path, None, f"cannot parse: {exc}") from exc
        yield batch


def text_source(
    path: Path, cfg: LoaderConfig, columns: ColumnMap | None, header: bool
) -> CsvSource:
    """A CsvSource for a CSV file (header) or a SNAP edge list (no header)."""
    peek = Peek(path)
    delimiter = cfg.delimiter or detect_delimiter(peek.first())
    header_line = peek.comments + 1
    if header:
        names = [f.strip('"') for f in peek.first().split(delimiter)]  # as pyarrow names them
        columns = columns or infer_columns(names, path, header_line)
    else:
        names = [f"f{i}" for i in range(len(split_fields(peek.first(), delimiter)))]
        columns = columns or ColumnMap(src=0, dst=1, time=2)
    roles, features = resolve_columns(columns, names, path, header_line if header else None, "line")
    _check_width(len(features), cfg.feature_dim, path, header_line)
    return CsvSource(
        path,
        roles=roles,
        features=features,
        column_names=None if header else names,
        skip_rows=peek.comments,
        delimiter=delimiter,
        chunk_rows=cfg.chunk_rows,
        block_size=_block_size(peek, cfg.chunk_rows),
    )


def jodie_source(path: Path, cfg: LoaderConfig) -> tuple[CsvSource, IdRules]:
    """A JODIE CSV: user, item, time, state label, then features; items shifted past users."""
    peek = Peek(path)
    delimiter = cfg.delimiter or ","
    width = len(split_fields(peek.first(1), delimiter)) if peek.first(1) else 4
    if width < 4:
        raise LoaderError(path, peek.comments + 2, f"JODIE rows need >= 4 fields, got {width}")
    features = [f"f{i}" for i in range(width - 4)]
    _check_width(len(features), cfg.feature_dim, path, peek.comments + 2)
    names = ["user_id", "item_id", "timestamp", "state_label", *features]
    roles = {"src": "user_id", "dst": "item_id", "time": "timestamp", "label": "state_label"}
    source = CsvSource(
        path,
        roles=roles,
        features=features,
        column_names=names,
        skip_rows=peek.comments + 1,
        delimiter=delimiter,
        chunk_rows=cfg.chunk_rows,
        block_size=_block_size(peek, cfg.chunk_rows),
        width_kind=f"feature width mismatch ({len(features)} features expected)",
    )
    num_users = cfg.num_users if cfg.num_users is not None else _max_user(source) + 1
    return source, IdRules(dst_offset=num_users, src_bound=num_users, node_bound=cfg.num_nodes)


def _max_user(source: CsvSource) -> int:
    """The largest well-formed user id: a first pass that reads the user column only."""
    probe = CsvSource(
        source.path,
        roles={"src": "user_id"},
        features=[],
        column_names=source.column_names,
        skip_rows=source.skip_rows,
        delimiter=source.delimiter,
        chunk_rows=1 << 30,
        block_size=source.block_size,
        lenient=True,
    )
    best = -1
    for chunk in probe.chunks():
        text = pc.utf8_trim_whitespace(chunk.columns["src"])
        ok = pc.fill_null(pc.match_substring_regex(text, r"^\+?\d+$"), False)
        ids = pc.cast(pc.filter(pc.utf8_ltrim(text, characters="+"), ok), pa.int64())
        best = max(best, pc.max(ids).as_py() if len(ids) else -1)
    return best


def _block_size(peek: Peek, chunk_rows: int) -> int:
    """Bytes per pyarrow block: about `chunk_rows` rows up to 4 MiB (measured fastest), and
    never less than a few long lines."""
    return int(max(min(chunk_rows * peek.mean_len, 1 << 22), 16 * peek.max_len, 1 << 14))


def _check_width(width: int, feature_dim: int | None, path: Path, line: int) -> None:
    if feature_dim is not None and width != feature_dim:
        reason = f"feature width mismatch: {width} feature columns, expected {feature_dim}"
        raise LoaderError(path, line, reason)


def infer_columns(names: list[str], path: Path, header_line: int | None) -> ColumnMap:
    """Columns found by common names (src/u/source, dst/i/target, ts/time, label)."""
    lower = {n.strip().lower(): n for n in names}
    found = {}
    for role, aliases in _ALIASES.items():
        found[role] = next((lower[a] for a in aliases if a in lower), None)
    for role in ("src", "dst", "time"):
        if found[role] is None:
            reason = (
                f"cannot find a {role} column among {names}; pass columns=ColumnMap(...) to name it"
            )
            raise LoaderError(path, header_line, reason, "line")
    return ColumnMap(**found)


def resolve_columns(
    columns: ColumnMap, names: list[str], path: Path, header_line: int | None, unit: str
) -> tuple[dict[str, str], list[str]]:
    """File column names for each role and the feature columns; missing ones are an error."""
    roles = {r: getattr(columns, r) for r in ("src", "dst", "time", "label")}
    roles = {r: _name(c, names, path, header_line, unit) for r, c in roles.items() if c is not None}
    features = [_name(c, names, path, header_line, unit) for c in columns.feature_columns()]
    return roles, features


def _name(column: str | int, names: list[str], path: Path, line: int | None, unit: str) -> str:
    if isinstance(column, int):
        if column >= len(names):
            reason = f"missing column at position {column}: the file has {len(names)} columns"
            raise LoaderError(path, line, reason, unit)
        return names[column]
    if column not in names:
        raise LoaderError(path, line, f"missing column {column!r} (columns: {names})", unit)
    return column
