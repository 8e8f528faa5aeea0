"""Configuration and errors of the event loaders (`tidegraph.storage.ingest`).

`ColumnMap` says which file columns hold src, dst, time, label and features; a column is named by
its header name or by its 0-based position (positions are the only way for files without a
header). `LoaderConfig` holds every option of `open_events`; it is validated on construction and
each message names the field to fix. `parse_columns` / `parse_features` read the
command-line spellings (`src=0,dst=1,time=3`, `4-9,rating`) and their YAML forms.
`infer_columns`, `resolve_columns` and `check_width` map a `ColumnMap` onto a file's column
names, for the text and the Parquet sources alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ColumnMap",
    "LoaderConfig",
    "LoaderError",
    "FORMATS",
    "SORT_MODES",
    "parse_columns",
    "parse_features",
]

FORMATS = ("auto", "jodie", "tgl", "snap", "csv", "parquet")
SORT_MODES = (False, True, "window", "full")

Column = str | int
_ALIASES = {  # common names of a role's column, lower case
    "src": ("src", "source", "u", "user", "user_id", "from", "sender", "node1"),
    "dst": ("dst", "target", "i", "item", "item_id", "to", "receiver", "node2"),
    "time": ("time", "ts", "t", "timestamp", "unixts", "date"),
    "label": ("label", "state_label", "y"),
}


class LoaderError(ValueError):
    """Bad input: names the file, the line (text files) or row (Parquet) and the reason."""

    def __init__(self, path: str | Path, line: int | None, reason: str, unit: str = "line") -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = f"{self.path}: {unit} {line}" if line is not None else self.path
        super().__init__(f"{where}: {reason}")


@dataclass(kw_only=True, frozen=True)
class ColumnMap:
    """Where the event fields are; `features` is a tuple of columns or one list-typed column."""

    src: Column = "src"
    dst: Column = "dst"
    time: Column = "time"
    label: Column | None = None
    features: tuple[Column, ...] | Column | None = None
    negative_ids: bool = False
    string_ids: bool = False

    def __post_init__(self) -> None:
        for name in ("src", "dst", "time", "label"):
            _check_column(getattr(self, name), f"ColumnMap.{name}", optional=name == "label")
        if isinstance(self.features, (list, tuple)):
            for c in self.features:
                _check_column(c, "ColumnMap.features", optional=False)
            object.__setattr__(self, "features", tuple(self.features))
        else:
            _check_column(self.features, "ColumnMap.features", optional=True)

    def feature_columns(self) -> tuple[Column, ...]:
        if self.features is None:
            return ()
        return self.features if isinstance(self.features, tuple) else (self.features,)


_ROLES = ("src", "dst", "time", "label", "features")


def parse_columns(spec: str | Mapping | None, field: str = "columns") -> ColumnMap | None:
    """A `ColumnMap` from `src=0,dst=1,time=3[,label=2][,features=4-9]` or a mapping of the same
    roles (YAML); a column is a 0-based position or a header name. Errors name `field`."""
    if spec is None or isinstance(spec, ColumnMap):
        return spec
    if isinstance(spec, str):
        pairs = [p.split("=", 1) for p in spec.split(",") if p.strip()]
        spec_map: dict = {}
        for pair in pairs:
            if len(pair) != 2:
                raise ValueError(f"{field}: expected role=column pairs such as "
                                 f"src=0,dst=1,time=3, got {spec!r}")  # fmt: skip
            spec_map.setdefault(pair[0].strip(), []).append(pair[1].strip())
        spec = {k: (v if k == "features" else v[0]) for k, v in spec_map.items()}
        if "features" in spec:
            spec["features"] = parse_features(",".join(spec["features"]), f"{field}.features")
        spec = {k: _column(v) if k != "features" else v for k, v in spec.items()}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{field}: a mapping of {_ROLES} to columns expected, got {spec!r}")
    unknown = sorted(set(spec) - set(_ROLES))
    if unknown:
        raise ValueError(f"{field}: unknown roles {unknown}; known: {list(_ROLES)}")
    spec = dict(spec)
    if isinstance(spec.get("features"), list):
        spec["features"] = tuple(spec["features"])
    try:
        return ColumnMap(**spec)
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from None


def parse_features(
    spec: str | int | list | tuple | None, field: str = "features"
) -> tuple[Column, ...] | Column | None:
    """Feature columns from `4-9,rating` (positions, inclusive ranges of positions, header
    names) or a list (YAML); one name alone may be a list-typed (Parquet) column."""
    if spec is None:
        return None
    if isinstance(spec, str):
        items: list[Column] = []
        for part in (p.strip() for p in spec.split(",")):
            lo, dash, hi = part.partition("-")
            if dash and lo.isdigit() and hi.isdigit():
                if int(hi) < int(lo):
                    raise ValueError(f"{field}: empty range {part!r}")
                items.extend(range(int(lo), int(hi) + 1))
            elif part:
                items.append(_column(part))
        if not items:
            raise ValueError(f"{field}: no columns named in {spec!r}")
        spec = items[0] if len(items) == 1 and isinstance(items[0], str) else tuple(items)
    elif isinstance(spec, list):
        spec = tuple(spec)
    try:
        return ColumnMap(features=spec).features
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from None


def _column(text: str) -> Column:
    return int(text) if text.isdigit() else text


def _check_column(value: object, field: str, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{field} must be a column name or a 0-based position, got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{field} must be a position >= 0, got {value}")


@dataclass(kw_only=True)
class LoaderConfig:
    """Options of `open_events` / `load_events`.

    sort: False -- time must never decrease (the first decreasing row is an error);
          True or "window" -- sort within a reorder window of `reorder_window` rows: an event
          may arrive up to that many rows after events with a later time; an event later than
          that is an error (or is quarantined); "full" -- read everything, then sort in memory.
    quarantine: a CSV path; rejected rows are written there (line, reason, text) instead of
          raising, counted in `EventReader.stats` and reported in a logged warning.
    num_users: JODIE only; item ids are shifted by it. None = a first pass over the user column.
    num_nodes: when set, ids must be < num_nodes.
    feature_dim: when set, the file's feature width must equal it.
    features: feature columns added to `columns` (given or found by name): a tuple of columns
          or one list-typed column; not both here and in `columns.features`.
    header: whether line 1 names the columns; None = the format's default (CSV, TGL and JODIE
          have one, refused when line 1 is all numbers; SNAP has none). False reads a CSV or
          JODIE file without one (columns by 0-based position); True forces one.
    negative_ids: negative ids are valid (for a caller that maps ids to dense ones, as
          training does); JODIE files still refuse them (their item ids are shifted by the
          user count, so a negative item id would alias another node).
    string_ids: ids are strings (any non-empty text); the reader codes them with its
          `id_map` (`tidegraph.storage.idmap.IdMap` of strings), which batches then speak:
          dense ids in order of first appearance in the time-ordered stream. Not for JODIE.
    """

    format: str = "auto"
    columns: ColumnMap | None = None
    chunk_rows: int = 65_536
    sort: bool | str = False
    reorder_window: int = 100_000
    quarantine: str | Path | None = None
    num_users: int | None = None
    num_nodes: int | None = None
    feature_dim: int | None = None
    delimiter: str | None = None
    header: bool | None = None
    features: tuple[Column, ...] | Column | None = None
    negative_ids: bool = False
    string_ids: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"LoaderConfig.format must be one of {FORMATS}, got {self.format!r}")
        if self.columns is not None and not isinstance(self.columns, ColumnMap):
            raise ValueError("LoaderConfig.columns must be a ColumnMap or None")
        if not (isinstance(self.sort, bool) or self.sort in ("window", "full")):
            raise ValueError(f"LoaderConfig.sort must be one of {SORT_MODES}, got {self.sort!r}")
        _positive("chunk_rows", self.chunk_rows)
        _positive("reorder_window", self.reorder_window)
        for name in ("num_users", "num_nodes", "feature_dim"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name), allow_zero=name == "feature_dim")
        if self.features is not None:
            self.features = parse_features(self.features, "LoaderConfig.features")
            if self.columns is not None and self.columns.features is not None:
                raise ValueError(
                    "LoaderConfig.features: feature columns are already named in columns.features"
                )
        for name in ("negative_ids", "string_ids"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LoaderConfig.{name} must be true or false, "
                                 f"got {getattr(self, name)!r}")  # fmt: skip
        if self.delimiter is not None and len(self.delimiter) != 1:
            raise ValueError(
                f"LoaderConfig.delimiter must be one character, got {self.delimiter!r}"
            )

    @property
    def window(self) -> int | None:
        """Reorder window in rows: 0 = no reordering, None = full in-memory sort."""
        if self.sort is False:
            return 0
        return None if self.sort == "full" else self.reorder_window


def _positive(name: str, value: object, allow_zero: bool = False) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or value < (0 if allow_zero else 1):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"LoaderConfig.{name} must be an integer {bound}, got {value!r}")


def check_width(width: int, feature_dim: int | None, path: Path, line: int | None) -> None:
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
