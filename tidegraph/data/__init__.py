"""Small real datasets bundled with the package: the one registry of bundled names.

- "wikipedia" (alias "wiki"): JODIE Wikipedia without its edge features; CSV with header
  `u,i,ts,label`, item ids already shifted past user ids (users 0..8226, pages 8227..9226);
  157,474 events, sorted.
- "uci" (aliases "collegemsg", "uci-msg"): SNAP CollegeMsg; space-separated `src dst t`, no
  header; node ids 1..1899; 59,835 events, sorted.

Both load with `tidegraph.storage.ingest.load_events(bundled_path(name))` (format "auto");
`tidegraph.training.data.load_stream` takes the names too. Provenance and statistics: the data
README of the project.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUNDLED", "bundled_names", "bundled_path", "is_bundled"]

DATA_DIR = Path(__file__).resolve().parent

BUNDLED = {
    "wikipedia": "wikipedia_u_i_ts_label.csv.gz",
    "uci": "CollegeMsg.txt.gz",
}
_ALIASES = {"wiki": "wikipedia", "collegemsg": "uci", "uci-msg": "uci"}


def bundled_names() -> list[str]:
    """Names accepted by `bundled_path`, aliases excluded."""
    return sorted(BUNDLED)


def is_bundled(name: str) -> bool:
    """Whether `name` (case-insensitive, aliases included) names a bundled dataset."""
    return _ALIASES.get(name.lower(), name.lower()) in BUNDLED


def bundled_path(name: str) -> Path:
    """The path of the bundled dataset `name` (case-insensitive; e.g. "wikipedia", "uci")."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in BUNDLED:
        raise KeyError(f"no bundled dataset {name!r}; choose one of {bundled_names()}")
    path = DATA_DIR / BUNDLED[key]
    if not path.exists():
        raise FileNotFoundError(f"bundled dataset {name!r} is missing: {path}")
    return path
