"""Vectorized conversion and validation of one chunk of raw columns into typed event rows.

Internal to `tidegraph.storage.ingest`. A source hands over a chunk whose columns are named by
role (`src`, `dst`, `time`, optional `label`, feature columns) and hold either text (CSV) or
native numbers (Parquet, and CSV feature columns that pyarrow read as float64). Each column is
parsed with one pyarrow cast on the fast path; only a chunk that fails the cast is diagnosed row
by row, with vectorized regular expressions. Feature columns that are already floats without
nulls are stacked as they are: no value of theirs can fail a check.

Assumptions:
- Ids are integers >= 0 (any int64 with `IdRules.negative`, which the training path sets: an
  id map makes them dense); a value such as "3.0" or "1e3" that is integral is accepted as an
  id. With `IdRules.text_ids` (string ids) an id is any non-empty text, trimmed, and becomes
  the code a reader's `IdMap` of strings gives it (rejected rows get none).
- Time must be a finite number; labels must be numbers; features must be finite numbers
  (a NaN or infinite feature fails its row: the model cannot train on it).
- The first failed check of a row is its reason; a row has one reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_FLOAT_RE = r"^[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|(?i:nan|inf|infinity))$"
_INT_RE = r"^[+-]?\d+$"
_INT64_MAX = int(np.iinfo(np.int64).max)
_TWO_63 = 2.0**63


@dataclass
class Rejects:
    """Rejected rows of a chunk: line (or row) numbers, reasons and raw text, in any order."""

    lines: np.ndarray
    reasons: list[str]
    texts: list[str]

    @staticmethod
    def empty() -> Rejects:
        return Rejects(np.empty(0, dtype=np.int64), [], [])

    def __len__(self) -> int:
        return len(self.reasons)

    @staticmethod
    def cat(parts: list[Rejects]) -> Rejects:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Rejects.empty()
        lines = np.concatenate([p.lines for p in parts])
        order = np.argsort(lines, kind="stable")
        reasons = [r for p in parts for r in p.reasons]
        texts = [t for p in parts for t in p.texts]
        return Rejects(lines[order], [reasons[i] for i in order], [texts[i] for i in order])


@dataclass
class Rows:
    """Valid events of a chunk as numpy arrays, with the line (or row) number of each."""

    src: np.ndarray
    dst: np.ndarray
    t: np.ndarray
    lines: np.ndarray
    label: np.ndarray | None = None
    feat: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.src.shape[0])

    def take(self, index: np.ndarray | slice) -> Rows:
        return Rows(
            src=self.src[index],
            dst=self.dst[index],
            t=self.t[index],
            lines=self.lines[index],
            label=None if self.label is None else self.label[index],
            feat=None if self.feat is None else self.feat[index],
        )

    @staticmethod
    def cat(parts: list[Rows]) -> Rows:
        def join(name: str) -> np.ndarray | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else np.concatenate(values)

        return Rows(**{name: join(name) for name in ("src", "dst", "t", "lines", "label", "feat")})


@dataclass(kw_only=True)
class IdRules:
    """Range rules for ids: `dst_offset` is added to dst (JODIE items); bounds are exclusive."""

    dst_offset: int = 0
    src_bound: int | None = None
    node_bound: int | None = None
    src_bound_name: str = "num_users"
    negative: bool = False  # negative ids are valid (external ids an id map makes dense)
    text_ids: object = None  # an IdMap of strings: ids are text, coded by it


@dataclass
class RawChunk:
    """Columns of one chunk keyed by role, with the file's name for each and each row's line."""

    columns: dict[str, pa.Array]
    names: dict[str, str]
    lines: np.ndarray
    feature_names: list[str]
    feat: np.ndarray | None = None
    rejects: Rejects | None = None
    feature_width: int = 0


class _Checks:
    """Collects the first failed check of each row of a chunk."""

    def __init__(self, n: int) -> None:
        self.bad = np.zeros(n, dtype=bool)
        self.reason: dict[int, str] = {}

    def fail(self, mask: np.ndarray, describe) -> None:
        """Mark rows in `mask` not yet failed; `describe(index)` gives their reasons."""
        index = np.flatnonzero(mask & ~self.bad)
        if index.size == 0:
            return
        self.bad[index] = True
        self.reason.update(zip(index.tolist(), describe(index), strict=True))


def parse_chunk(chunk: RawChunk, rules: IdRules, feature_dim: int | None) -> tuple[Rows, Rejects]:
    """Parse and validate a chunk; returns the valid rows and the rejected ones."""
    n = len(chunk.lines)
    checks = _Checks(n)
    cols, names = chunk.columns, chunk.names
    if rules.text_ids is not None:
        text = [_text_id(cols[k], names[k], checks) for k in ("src", "dst")]
        src = dst = np.zeros(n, dtype=np.int64)  # coded below, for the rows kept
    else:
        src = _parse_id(cols["src"], names["src"], checks, rules.negative)
        dst = _parse_id(cols["dst"], names["dst"], checks, rules.negative)
    t = _parse_time(cols["time"], names["time"], checks)
    label = None
    if "label" in cols:
        label = _parse_float(cols["label"], names["label"], checks, "label").astype(np.float32)
    if chunk.feat is not None:  # TGL: rows of edge_features.pt
        feat = chunk.feat
        feature_names = [f"edge_features.pt[:, {j}]" for j in range(feat.shape[1])]
        if feat.dtype == np.float64:
            feat = _to_float32(feat, feature_names, checks)
    else:
        feat = _parse_features(chunk, checks, feature_dim)
        feature_names = chunk.feature_names
        if feat is not None and len(feature_names) == 1 and feat.shape[1] != 1:
            feature_names = feature_names * feat.shape[1]  # one list column
    if feat is not None:
        _check_finite(feat, feature_names, checks)
    dst = _apply_rules(src, dst, rules, checks)
    keep = np.flatnonzero(~checks.bad)
    if rules.text_ids is not None:
        picked = [a.take(pa.array(keep)) for a in text]
        src, dst = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        src[keep], dst[keep] = rules.text_ids.map_text_events(*picked)
    rows = Rows(src=src, dst=dst, t=t, lines=chunk.lines, label=label).take(keep)
    if feat is not None:  # always a fresh array: copied only when rows were rejected
        rows.feat = feat if keep.size == n else feat[keep]
    return rows, _rejects(chunk, checks)


def _rejects(chunk: RawChunk, checks: _Checks) -> Rejects:
    index = np.flatnonzero(checks.bad)
    texts = _row_texts(chunk.columns, index)
    own = Rejects(chunk.lines[index], [checks.reason[i] for i in index.tolist()], texts)
    return own if chunk.rejects is None else Rejects.cat([chunk.rejects, own])


def _row_texts(columns: dict[str, pa.Array], index: np.ndarray) -> list[str]:
    if index.size == 0:
        return []
    picked = [columns[k].take(pa.array(index)).to_pylist() for k in ("src", "dst", "time")]
    return [",".join("" if v is None else str(v) for v in row) for row in zip(*picked, strict=True)]


def values_at(array: pa.Array, index: np.ndarray) -> list:
    """The values of `array` at positions `index`, as Python objects (for messages)."""
    return array.take(pa.array(index)).to_pylist()


def _parse_id(array: pa.Array, name: str, checks: _Checks, negative: bool) -> np.ndarray:
    """Parse ids to int64; non-numeric, non-integer and out-of-int64 ids fail, and negative ids
    unless `negative`."""
    if pa.types.is_integer(array.type):
        values = _integer_ids(array, name, checks)
    else:
        values = _parse_id_slow(array, name, checks)
    if not negative:
        checks.fail(
            values < 0, lambda i: [f"negative id: {v} in column '{name}'" for v in values[i]]
        )
    return values


def _text_id(array: pa.Array, name: str, checks: _Checks) -> pa.Array:
    """String ids, trimmed; a null or empty one fails its row (read as "")."""
    if not _is_text(array):
        array = pc.cast(array, pa.string())
    text = pc.fill_null(pc.utf8_trim_whitespace(array), "")
    empty = pc.equal(pc.utf8_length(text), 0).to_numpy(zero_copy_only=False)
    checks.fail(empty, lambda i: [f"missing id: empty in column '{name}'"] * len(i))
    return text


def _integer_ids(array: pa.Array, name: str, checks: _Checks) -> np.ndarray:
    """Integer columns (Parquet) exactly: nulls are missing, uint64 above int64 out of range."""
    if array.null_count:
        missing = array.is_null().to_numpy(zero_copy_only=False)
        checks.fail(missing, lambda i: [f"missing id: null in column '{name}'"] * len(i))
        array = pc.fill_null(array, 0)
    values = array.to_numpy()
    if values.dtype == np.uint64:
        big = values > np.uint64(_INT64_MAX)
        checks.fail(big, lambda i: [_out_of_range(v, name) for v in values[i].tolist()])
        values = np.where(big, np.uint64(0), values)
    return values.astype(np.int64, copy=False)


def _out_of_range(value: object, name: str) -> str:
    return f"id out of range: {value!r} in column '{name}' does not fit in int64"


def _parse_id_slow(array: pa.Array, name: str, checks: _Checks) -> np.ndarray:
    if _is_text(array) and array.null_count == 0:
        try:
            return pc.cast(array, pa.int64()).to_numpy()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    as_float = _parse_float(array, name, checks, what="id")
    integral = np.isfinite(as_float) & (np.floor(as_float) == as_float)
    non_integer = "non-integer id: {!r} in column '" + name + "'"
    checks.fail(~integral, lambda i: [non_integer.format(v) for v in values_at(array, i)])
    fits = np.abs(as_float) < _TWO_63  # what a float can say; integer text is decided exactly
    values = np.where(integral & fits, as_float, 0).astype(np.int64)
    exact = _exact_ints(array)
    if exact is not None:
        exact_values, is_int, int_fits = exact
        fits = np.where(is_int, int_fits, fits)
        values = np.where(is_int & int_fits, exact_values, values)
    checks.fail(integral & ~fits, lambda i: [_out_of_range(v, name) for v in values_at(array, i)])
    return values


def _exact_ints(array: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """For text that looks like an integer (floats lose ids above 2**53): its exact int64 value,
    whether it looks like one, and whether it fits in int64 (others read 0)."""
    if not _is_text(array):
        return None
    text = pc.utf8_trim_whitespace(array)
    looks = pc.fill_null(pc.match_substring_regex(text, _INT_RE), False)
    fits = pc.and_(looks, int64_text_fits(text))
    cleaned = pc.if_else(fits, pc.utf8_ltrim(text, characters="+"), pa.scalar("0"))
    values = pc.cast(cleaned, pa.int64()).to_numpy()
    return values, looks.to_numpy(zero_copy_only=False), fits.to_numpy(zero_copy_only=False)


def int64_text_fits(text: pa.Array) -> pa.Array:
    """Whether integer text (optional sign, digits, no spaces) is within int64, compared as digit
    strings: a float cannot tell 2**63 - 1 from 2**63."""
    negative = pc.starts_with(text, "-")
    digits = pc.utf8_ltrim(pc.utf8_ltrim(text, characters="+-"), characters="0")
    n = pc.utf8_length(digits)
    limit = pc.if_else(negative, pa.scalar(str(_INT64_MAX + 1)), pa.scalar(str(_INT64_MAX)))
    edge = pc.and_(pc.equal(n, len(str(_INT64_MAX))), pc.less_equal(digits, limit))
    return pc.fill_null(pc.or_(pc.less(n, len(str(_INT64_MAX))), edge), False)


def _is_text(array: pa.Array) -> bool:
    return pa.types.is_string(array.type) or pa.types.is_large_string(array.type)


def _parse_time(array: pa.Array, name: str, checks: _Checks) -> np.ndarray:
    values = _parse_float(array, name, checks, "time")
    bad = ~np.isfinite(values)
    checks.fail(bad, lambda i: [_bad_time(v, name) for v in values[i]])
    return values


def _bad_time(value: float, name: str) -> str:
    kind = "NaN time" if np.isnan(value) else "non-finite time"
    return f"{kind}: column '{name}' holds {value}"


def _parse_float(array: pa.Array, name: str, checks: _Checks, what: str = "value") -> np.ndarray:
    """Parse to float64; rows that are not numbers fail with `non-numeric <what>`."""
    if array.null_count:  # Parquet nulls; CSV text is never null
        missing = array.is_null().to_numpy(zero_copy_only=False)
        checks.fail(missing, lambda i: [f"missing {what}: null in column '{name}'"] * len(i))
    if pa.types.is_integer(array.type) or pa.types.is_floating(array.type):
        return pc.fill_null(pc.cast(array, pa.float64()), np.nan).to_numpy()
    try:
        return pc.fill_null(pc.cast(array, pa.float64()), np.nan).to_numpy()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    text = pc.utf8_trim_whitespace(pc.cast(array, pa.string()))
    looks = pc.fill_null(pc.match_substring_regex(text, _FLOAT_RE), False)
    cleaned = pc.if_else(looks, text, pa.scalar("nan"))
    values = _cast_float_tolerant(cleaned)
    bad = ~looks.to_numpy(zero_copy_only=False) | np.isnan(values) & ~_nan_text(text)
    checks.fail(
        bad,
        lambda i: [f"non-numeric {what}: {v!r} in column '{name}'" for v in values_at(array, i)],
    )
    return values


def _nan_text(text: pa.Array) -> np.ndarray:
    return pc.fill_null(pc.match_substring_regex(text, r"^[+-]?(?i:nan)$"), False).to_numpy(
        zero_copy_only=False
    )


def _cast_float_tolerant(text: pa.Array) -> np.ndarray:
    """Cast text that matched the number pattern; a string pyarrow still refuses becomes NaN."""
    try:
        return pc.cast(text, pa.float64()).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid:
        return np.array([_float_or_nan(s) for s in text.to_pylist()], dtype=np.float64)


def _float_or_nan(text: str | None) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return float("nan")


def _parse_features(chunk: RawChunk, checks: _Checks, feature_dim: int | None) -> np.ndarray | None:
    names = chunk.feature_names
    if not names:
        return None
    if len(names) == 1 and is_list(chunk.columns[names[0]].type):
        width = chunk.feature_width if feature_dim is None else feature_dim
        return _parse_list_features(chunk.columns[names[0]], names[0], checks, width)
    arrays = [chunk.columns[c] for c in names]
    if all(pa.types.is_floating(a.type) and a.null_count == 0 for a in arrays):
        # typed CSV or Parquet floats: only their float32 range to check
        values = np.stack([a.to_numpy() for a in arrays], axis=1, dtype=np.float64)
    else:
        columns = [_parse_float(chunk.columns[c], c, checks, what="feature") for c in names]
        values = np.stack(columns, axis=1)
    return _to_float32(values, names, checks)


def _check_finite(feat: np.ndarray, names: list[str], checks: _Checks) -> None:
    """NaN or infinite features fail their row (they would poison the model), naming the
    first such column."""
    bad = ~np.isfinite(feat)
    hit = np.flatnonzero(bad.any(1))
    if hit.size == 0:
        return
    col = bad[hit].argmax(1)
    reason = {}
    for h, c in zip(hit.tolist(), col.tolist(), strict=True):
        value = float(feat[h, c])
        kind = "NaN feature" if np.isnan(value) else "non-finite feature"
        reason[h] = f"{kind}: {value} in column '{names[c]}'"
    mask = np.zeros(len(checks.bad), dtype=bool)
    mask[hit] = True
    checks.fail(mask, lambda i: [reason[int(p)] for p in i])


def _to_float32(
    values: np.ndarray, names: list[str], checks: _Checks, rows: np.ndarray | None = None
) -> np.ndarray:
    """float64 features [n, k] as float32 (rounded as astype does); a row with a finite value
    beyond float32's range fails instead of holding an infinity it never had. `rows`: the
    chunk positions of the n rows (None: all of the chunk, in order)."""
    with np.errstate(over="ignore"):
        out = values.astype(np.float32)
    over = np.isinf(out) & np.isfinite(values)
    hit = np.flatnonzero(over.any(1))
    if hit.size:
        pos = hit if rows is None else rows[hit]
        col = over[hit].argmax(1)
        reason = {
            int(p): f"feature out of float32 range: {float(values[h, c])!r} in column '{names[c]}'"
            for p, h, c in zip(pos, hit, col, strict=True)
        }
        mask = np.zeros(len(checks.bad), dtype=bool)
        mask[pos] = True
        checks.fail(mask, lambda i: [reason[int(p)] for p in i])
    return out


def is_list(type_: pa.DataType) -> bool:
    return (
        pa.types.is_list(type_)
        or pa.types.is_large_list(type_)
        or pa.types.is_fixed_size_list(type_)
    )


def _parse_list_features(array: pa.Array, name: str, checks: _Checks, width: int) -> np.ndarray:
    """Features stored as one list column (Parquet); every list must have `width` values (a
    width of 0 is valid: empty lists)."""
    if array.null_count:
        missing = array.is_null().to_numpy(zero_copy_only=False)
        checks.fail(missing, lambda i: [f"missing features: null in column '{name}'"] * len(i))
    lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False)
    bad = lengths != width
    msg = "feature width mismatch: {} values in column '" + name + f"', expected {width}"
    checks.fail(bad, lambda i: [msg.format(v) for v in lengths[i]])
    good = np.flatnonzero(~checks.bad & ~bad)
    out = np.zeros((len(array), width), dtype=np.float32)
    if width and good.size:  # reshape(-1, 0) cannot infer a row count
        flat = pc.list_flatten(array.take(pa.array(good)))
        values = pc.cast(flat, pa.float64()).to_numpy(zero_copy_only=False).reshape(-1, width)
        out[good] = _to_float32(values, [name] * width, checks, rows=good)
    return out


def _apply_rules(src: np.ndarray, dst: np.ndarray, rules: IdRules, checks: _Checks) -> np.ndarray:
    if rules.src_bound is not None:
        bound, bname = rules.src_bound, rules.src_bound_name
        checks.fail(
            src >= bound,
            lambda i: [f"id out of range: src id {v} >= {bname} {bound}" for v in src[i]],
        )
    if rules.dst_offset:
        off, oname = rules.dst_offset, rules.src_bound_name
        checks.fail(  # dst + offset would wrap past int64
            dst > _INT64_MAX - off,
            lambda i: [
                f"id out of range: dst id {v} + {oname} {off} exceeds int64" for v in dst[i]
            ],
        )
        dst = dst + off
    if rules.node_bound is not None:
        nb = rules.node_bound
        checks.fail(
            src >= nb, lambda i: [f"id out of range: src id {v} >= num_nodes {nb}" for v in src[i]]
        )
        checks.fail(
            dst >= nb, lambda i: [f"id out of range: dst id {v} >= num_nodes {nb}" for v in dst[i]]
        )
    return dst
