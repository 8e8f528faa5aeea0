"""Delimited text files for the event loaders: CSV, SNAP edge lists and JODIE CSV.

Internal to `tidegraph.storage.ingest`. Files are read with pyarrow's streaming CSV reader
(`pyarrow.csv.open_csv`, `.gz`/`.bz2` decompressed on the fly), one block (<= 4 MiB) at a time,
never whole. Id, time and label columns are read as bytes, checked as UTF-8 per chunk (a row
with invalid UTF-8 is one reject) and parsed as text by `parse`, so a bad value rejects one row
instead of failing a block. Feature columns are read as float64 by pyarrow itself (wide files
spend most of their time there), which fails a whole block on one bad value; the file is then
read again as text from the first row not yet handed out, and the text path names the bad row.
pyarrow parses text to float64 exactly as the text path does (same values, same strings
refused; tests compare the two), so the result does not depend on the path taken.
Blocks are parsed on several threads; pyarrow only reports the line of a malformed row (wrong
field count) when it reads serially, so a file with such a row is read again serially from the
first row not yet handed out. The threaded reader gets no Python row handler (a malformed row
fails its block instead): a Python callback on pyarrow's worker threads can still be pending
when the interpreter exits, and a thread that then takes the GIL is ended inside C++ code,
which aborts the process ("terminate called without an active exception", apache/arrow#34314).

Assumptions:
- Line numbers are 1-based and count the header and leading comment lines; blank lines are
  skipped by the reader and not counted (so in a file with blank lines inside, numbers are
  those of the non-blank lines). A quoted field with a newline inside also shifts numbers.
- Comment lines (`#` or `%`, as in SNAP and KONECT files) are only recognised at the top.
- Fields are separated by exactly one delimiter character (tab, comma or space, detected from
  the first data line unless given); runs of spaces are not merged, except in SNAP edge lists
  with a space or tab delimiter whose first 64 KiB show runs of spaces and tabs (or leading or
  trailing ones): there pyarrow reads whole lines, which are split on runs of whitespace
  (slower); elsewhere such a line is a wrong-field-count reject. A file without lines has no
  events.
- A UTF-8 byte order mark is dropped (pyarrow drops it too).
- Where a header is expected by default (CSV, TGL, JODIE) and line 1 is all numbers, loading
  fails rather than silently reading a data row as the header; `header=False` reads such a
  file, `header=True` takes line 1 as the header anyway.
- JODIE: the header (if any) is one line whose names need not match the field count (JODIE writes
  `...,comma_separated_list_of_features`); the field count of the first data line sets the
  feature width. Item ids are shifted by `num_users` (given, or max user id + 1 found by a
  first pass that reads the user column only).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from tidegraph.storage.ingest.config import (
    ColumnMap,
    LoaderConfig,
    LoaderError,
    check_width,
    infer_columns,
    resolve_columns,
)
from tidegraph.storage.ingest.parse import IdRules, RawChunk, Rejects, int64_text_fits, values_at

_PEEK_BYTES = 1 << 16
_COMMENTS = ("#", "%")
_WHITESPACE = (" ", "\t")
_HEADERLESS_HINT = (
    "pass header=False (--no-header) to read a file without a header (columns by position)"
)
_LINE = "line"  # the one column of a SNAP file read whole lines at a time


class Peek:
    """The first lines of a text file: comment lines to skip, first lines, line lengths."""

    def __init__(self, path: Path) -> None:
        try:
            with pa.input_stream(str(path), compression="detect") as stream:
                raw = stream.read(_PEEK_BYTES)
        except (OSError, pa.ArrowException) as exc:  # a truncated or corrupt compressed file
            raise LoaderError(path, None, f"cannot read: {exc}") from None
        lines = raw.decode("utf-8-sig", errors="replace").splitlines()  # -sig: drop a BOM
        self.complete = len(raw) < _PEEK_BYTES
        if not self.complete and len(lines) > 1:
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


def split_snap(line: str, delimiter: str) -> list[str]:
    """Fields of a SNAP line: runs of spaces and tabs separate fields when `delimiter` is one."""
    return line.split() if delimiter in _WHITESPACE else split_fields(line, delimiter)


def looks_like_data(line: str, delimiter: str) -> bool:
    """Whether every field of `line` is a number (a header line has names)."""
    fields = split_snap(line, delimiter)
    return bool(line.strip()) and all(is_number(f) for f in fields)


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
    feature_source = ""  # where the feature columns are, for the log
    unused: list | tuple = ()  # columns read by no role (names, or positions without a header)

    @property
    def feature_count(self) -> int:
        return len(self.features)

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
        whitespace: bool = False,
        empty: bool = False,
    ) -> None:
        self.path, self.roles, self.features = path, roles, features
        # whitespace: pyarrow reads whole lines, split here on runs of spaces and tabs (SNAP)
        self.whitespace, self.empty = whitespace, empty
        self.column_names, self.skip_rows, self.delimiter = column_names, skip_rows, delimiter
        self.chunk_rows, self.block_size, self.width_kind = chunk_rows, block_size, width_kind
        self.lenient = lenient  # skip invalid rows without a record (the JODIE first pass)
        roles_read = set(roles.values())
        typed = [c for c in dict.fromkeys(features) if c not in roles_read]
        self.typed = [] if whitespace else typed
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
        if self.empty:  # pyarrow refuses a file without rows
            yield self._chunk(None)
            return
        threads, typed = True, self.read_typed and bool(self.typed)
        while (outcome := (yield from self._pass(threads, typed))) != "complete":
            if outcome == "invalid":  # only the serial reader reports an invalid row's line
                threads = False
            else:  # "unconvertible": the text path finds the bad value and names its row
                typed = False
        yield self._chunk(None)

    def _pass(self, threads: bool, typed: bool) -> Iterator[RawChunk]:
        """One read of the file; rows handed out by an earlier pass are skipped, not repeated.

        Returns "complete", "invalid" when a threaded pass fails a block (a malformed row), or
        "unconvertible" when a typed pass meets a feature value pyarrow cannot parse. Both
        failures are raised in place of their block's batch, so no row from that block or later
        was handed out.
        """
        resume, seen = self._read, 0
        try:
            reader = self._open(threads, typed)
        except OSError as exc:  # a truncated or corrupt compressed stream
            raise self._unreadable(exc) from None
        if isinstance(reader, str):
            return reader
        try:
            for batch in _guarded(reader, self._failure(threads, typed)):
                if isinstance(batch, str):
                    return batch
                fresh = batch.slice(min(max(resume - seen, 0), batch.num_rows))
                seen += batch.num_rows
                for start in range(0, fresh.num_rows, self.chunk_rows):
                    yield self._chunk(fresh.slice(start, self.chunk_rows))
        except OSError as exc:
            raise self._unreadable(exc) from None
        finally:
            reader.close()
        return "complete"

    def _unreadable(self, exc: OSError) -> LoaderError:
        read = self.rows_seen
        where = f" past its first {read} data rows" if read else ""
        reason = f"cannot read the file{where}: {exc}"
        return LoaderError(self.path, None, reason)

    def _failure(self, threads: bool, typed: bool):
        """What a pass does when pyarrow fails a block: the outcome that reads it again, or a
        LoaderError naming the file. A threaded pass has no row handler, so a malformed row
        fails its block too: pyarrow's conversion errors go to the text path, anything else to
        the serial reader (which reports malformed rows one by one and fails again, typed, on a
        bad value)."""

        def outcome(exc: pa.ArrowInvalid) -> str:
            message = str(exc)  # pyarrow echoes a malformed row's text after its own words
            conversion = "CSV conversion error" in message and "CSV parse error" not in message
            if threads and not (typed and conversion):
                return "invalid"
            if typed:
                return "unconvertible"
            raise LoaderError(self.path, None, f"cannot parse: {exc}") from exc

        return outcome

    def _open(self, threads: bool, typed: bool) -> pacsv.CSVStreamingReader | str:
        """A reader, or the pass's outcome when its first block (read on opening) fails."""
        wanted = list(dict.fromkeys([*self.roles.values(), *self.features]))
        names, delimiter, quote = self.column_names, self.delimiter, '"'
        if self.whitespace:  # one column of whole lines ("\x1f", unit separator, never used)
            wanted, names, delimiter, quote = [_LINE], [_LINE], "\x1f", False
        types = {c: pa.binary() for c in wanted}  # UTF-8 checked per chunk: one bad row, one reject
        if typed:
            types.update({c: pa.float64() for c in self.typed})
        read = pacsv.ReadOptions(
            skip_rows=self.skip_rows,
            column_names=names,
            block_size=self.block_size,
            use_threads=threads,
        )
        parse = pacsv.ParseOptions(
            delimiter=delimiter,
            quote_char=quote,
            invalid_row_handler=None if threads else self._on_invalid,
        )
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
            return self._failure(threads, typed)(exc)

    def _on_invalid(self, row: pacsv.InvalidRow) -> str:
        """Serial passes: record a malformed row as a reject (lenient: skip it silently)."""
        if self.lenient:
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
        rejects = self._release(last)
        if batch is None:
            columns = {k: pa.array([], pa.string()) for k in wanted}
        elif self.whitespace:
            (text,), lines, undecoded = decode_utf8([batch.column(0)], [None], lines)
            columns, lines, short = self._split(text, lines, wanted)
            rejects = Rejects.cat([rejects, undecoded, short])
        else:
            arrays = [batch.column(c) for c in wanted.values()]
            arrays, lines, undecoded = decode_utf8(arrays, list(wanted.values()), lines)
            columns = dict(zip(wanted, arrays, strict=True))
            rejects = Rejects.cat([rejects, undecoded])
        return RawChunk(columns, dict(self.roles), lines, list(self.features), rejects=rejects)

    def _split(
        self, text: pa.Array, lines: np.ndarray, wanted: dict[str, str]
    ) -> tuple[dict[str, pa.Array], np.ndarray, Rejects]:
        """Whole lines split on runs of whitespace; rows with another field count are rejects."""
        trimmed = pc.utf8_trim_whitespace(text)
        fields = pc.utf8_split_whitespace(trimmed)
        empty = pc.equal(pc.utf8_length(trimmed), 0).to_numpy(zero_copy_only=False)
        counts = np.where(empty, 0, pc.list_value_length(fields).to_numpy(zero_copy_only=False))
        expected = len(self.column_names)
        bad = counts != expected
        if bad.any():
            index = np.flatnonzero(bad)
            reasons = [
                f"{self.width_kind}: row has {k} fields, expected {expected}" for k in counts[index]
            ]
            short = Rejects(lines[index], reasons, values_at(text, index))
            keep = pa.array(np.flatnonzero(~bad))
            fields, lines = fields.take(keep), lines[~bad]
        else:
            short = Rejects.empty()
        position = {c: i for i, c in enumerate(self.column_names)}
        columns = {k: pc.list_element(fields, position[c]) for k, c in wanted.items()}
        return columns, lines, short

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


def decode_utf8(
    arrays: list[pa.Array], names: list[str | None], lines: np.ndarray
) -> tuple[list[pa.Array], np.ndarray, Rejects]:
    """Binary columns as UTF-8 strings; rows with invalid UTF-8 in any of them become rejects
    (their text decoded with replacement characters) and are dropped from the arrays."""
    try:
        return [a.cast(pa.string()) for a in arrays], lines, Rejects.empty()
    except pa.ArrowInvalid:
        pass
    bad = np.zeros(len(lines), dtype=bool)
    reason: dict[int, str] = {}
    for array, name in zip(arrays, names, strict=True):
        for i in _invalid_utf8(array, 0):
            if not bad[i]:
                where = "the line" if name is None else f"column '{name}'"
                reason[i] = f"invalid UTF-8: {where} holds {array[i].as_py()!r}"
            bad[i] = True
    index = np.flatnonzero(bad)
    texts = [",".join(a[int(i)].as_py().decode("utf-8", "replace") for a in arrays) for i in index]
    rejects = Rejects(lines[index], [reason[int(i)] for i in index], texts)
    keep = pa.array(np.flatnonzero(~bad))
    decoded = [a.take(keep).cast(pa.string()) for a in arrays]
    return decoded, lines[~bad], rejects


def _invalid_utf8(array: pa.Array, offset: int) -> list[int]:
    """Positions of values that are not valid UTF-8, by bisection: one cast per half, so a
    few bad values among many cost a few dozen vectorized casts."""
    try:
        array.cast(pa.string())
        return []
    except pa.ArrowInvalid:
        if len(array) == 1:
            return [offset]
    half = len(array) // 2
    return _invalid_utf8(array.slice(0, half), offset) + _invalid_utf8(
        array.slice(half), offset + half
    )


def _guarded(reader: pacsv.CSVStreamingReader, failure) -> Iterator[pa.RecordBatch | str]:
    """Batches of `reader`; a block pyarrow fails ends them with `failure(exc)` (an outcome).
    A file that cannot be read on (a truncated or corrupt compressed stream) is a LoaderError
    raised by `failure` too."""
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid as exc:
            yield failure(exc)
            return
        yield batch


def text_source(
    path: Path,
    cfg: LoaderConfig,
    columns: ColumnMap | None,
    header: bool,
    *,
    snap: bool = False,
    header_hint: str = _HEADERLESS_HINT,
) -> CsvSource:
    """A CsvSource for a CSV file (header) or a SNAP edge list (no header by default)."""
    peek = Peek(path)
    delimiter = cfg.delimiter or detect_delimiter(peek.first())
    # runs of whitespace in the peeked lines: split whole lines (1.7x slower than pyarrow's
    # parser, so only then; a later irregular line in a regular file is a wrong-width reject)
    whitespace = snap and delimiter in _WHITESPACE and _irregular(peek.lines, delimiter)
    header_line = peek.comments + 1
    if header:
        if cfg.header is None:  # header=True given: line 1 is a header even if it is numeric
            _require_header(peek, delimiter, path, header_hint)
        names = [f.strip('"') for f in peek.first().split(delimiter)]  # as pyarrow names them
        if whitespace:
            names = peek.first().split()
        columns = with_features(columns or infer_columns(names, path, header_line), cfg, path)
    else:
        fields = split_snap(peek.first(), delimiter)
        if columns is None:
            _require_unambiguous(fields, path, header_line)
        columns = with_features(columns or ColumnMap(src=0, dst=1, time=2), cfg, path)
        width = len(fields) if peek.lines else _min_width(columns)
        names = [f"f{i}" for i in range(width)]
    roles, features = resolve_columns(columns, names, path, header_line if header else None, "line")
    check_width(len(features), cfg.feature_dim, path, header_line)
    unused = [n for n in names if n not in roles.values() and n not in features]
    source = CsvSource(
        path,
        roles=roles,
        features=features,
        column_names=names if whitespace or not header else None,
        skip_rows=peek.comments + int(header and whitespace),
        delimiter=delimiter,
        chunk_rows=cfg.chunk_rows,
        block_size=_block_size(peek, cfg.chunk_rows),
        whitespace=whitespace,
        empty=peek.complete and len(peek.lines) <= int(header),
    )
    where = "columns" if header else "columns at positions"
    shown = features if header else [int(n[1:]) for n in features]  # f4 -> 4
    source.feature_source = f"{where} {shown} of {path}" if features else ""
    source.unused = unused if header else [int(n[1:]) for n in unused]
    return source


def _require_unambiguous(fields: list[str], path: Path, line: int) -> None:
    """Without a header and a column map, columns 0, 1, 2 are src, dst, time; with more than
    three columns any of them could be the time (`src,dst,rating,time`): refuse to guess."""
    if len(fields) <= 3:
        return
    shown = ", ".join(f"{i}: {f!r}" for i, f in enumerate(fields[:12]))
    more = f" (and {len(fields) - 12} more)" if len(fields) > 12 else ""
    reason = (
        f"{len(fields)} columns and no header ({shown}{more}): which is the time is ambiguous; "
        "name the columns, e.g. --columns src=0,dst=1,time=3 (and --features 2 to use another "
        "column as an edge feature), with --no-header for a headerless --format csv file "
        "(API: columns=ColumnMap(src=0, dst=1, time=3), header=False)"
    )
    raise LoaderError(path, line, reason)


def with_features(columns: ColumnMap, cfg: LoaderConfig, path: Path) -> ColumnMap:
    """`columns` with the feature columns of `cfg.features` (when given)."""
    if cfg.features is None:
        return columns
    if columns.features is not None:
        raise LoaderError(path, None, "feature columns named twice: in columns and in features")
    return dataclasses.replace(columns, features=cfg.features)


def _irregular(lines: list[str], delimiter: str) -> bool:
    """Whether any line separates fields by something other than one `delimiter`."""
    return any(line.split() != line.split(delimiter) for line in lines)


def _min_width(columns: ColumnMap) -> int:
    """Fields a file without lines is taken to have: enough for every position named."""
    named = [columns.src, columns.dst, columns.time, columns.label, *columns.feature_columns()]
    return 1 + max((c for c in named if isinstance(c, int)), default=-1)


def _require_header(peek: Peek, delimiter: str, path: Path, hint: str) -> None:
    """A header line is expected: refuse to read a first line of numbers as one (its row would
    be lost)."""
    first = peek.first()
    if first and looks_like_data(first, delimiter):
        reason = f"no header found: the first line {first.strip()!r} looks like data; {hint}"
        raise LoaderError(path, peek.comments + 1, reason)


def jodie_source(path: Path, cfg: LoaderConfig) -> tuple[CsvSource, IdRules]:
    """A JODIE CSV: user, item, time, state label, then features; items shifted past users."""
    peek = Peek(path)
    delimiter = cfg.delimiter or ","
    header = cfg.header is not False  # JODIE files have a header line; header=False reads none
    if cfg.header is None:
        hint = "pass header=False (--no-header) to read a JODIE file without a header"
        _require_header(peek, delimiter, path, hint)
    data_line = peek.comments + 1 + int(header)
    first = peek.first(int(header))
    width = len(split_fields(first, delimiter)) if first else 4
    if width < 4:
        raise LoaderError(path, data_line, f"JODIE rows need >= 4 fields, got {width}")
    features = [f"f{i}" for i in range(width - 4)]
    check_width(len(features), cfg.feature_dim, path, data_line)
    names = ["user_id", "item_id", "timestamp", "state_label", *features]
    roles = {"src": "user_id", "dst": "item_id", "time": "timestamp", "label": "state_label"}
    source = CsvSource(
        path,
        roles=roles,
        features=features,
        column_names=names,
        skip_rows=peek.comments + int(header),
        delimiter=delimiter,
        chunk_rows=cfg.chunk_rows,
        block_size=_block_size(peek, cfg.chunk_rows),
        width_kind=f"feature width mismatch ({len(features)} features expected)",
        empty=peek.complete and len(peek.lines) <= int(header),
    )
    source.feature_source = f"JODIE fields 5-{width} of {path}"
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
        empty=source.empty,
    )
    best = -1
    for chunk in probe.chunks():
        text = pc.utf8_trim_whitespace(chunk.columns["src"])
        ok = pc.fill_null(pc.match_substring_regex(text, r"^\+?\d+$"), False)
        ok = pc.and_(ok, int64_text_fits(text))  # larger ids are rejected when parsed
        ids = pc.cast(pc.filter(pc.utf8_ltrim(text, characters="+"), ok), pa.int64())
        best = max(best, pc.max(ids).as_py() if len(ids) else -1)
    return best


def _block_size(peek: Peek, chunk_rows: int) -> int:
    """Bytes per pyarrow block: about `chunk_rows` rows up to 4 MiB (measured fastest), and
    never less than a few long lines."""
    return int(max(min(chunk_rows * peek.mean_len, 1 << 22), 16 * peek.max_len, 1 << 14))
