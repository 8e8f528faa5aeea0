"""Data ingest: files of timestamped interactions -> time-ordered `EventBatch`es.

The one public entry of `tidegraph.storage.ingest`; its modules are internal:
`reader` (the pass over a file, quarantine, batching), `config` (`LoaderConfig`, `ColumnMap`,
`LoaderError`), `sources` (format detection, Parquet, TGL directories), `text` (CSV, SNAP,
JODIE), `parse` (vectorized parsing and checks of a chunk) and `order` (time order).

    reader = open_events("wiki.csv.gz", sort=True, quarantine="bad_rows.csv")
    for batch in reader:
        ...
"""

from tidegraph.storage.ingest.config import (
    FORMATS,
    ColumnMap,
    LoaderConfig,
    LoaderError,
    parse_columns,
    parse_features,
)
from tidegraph.storage.ingest.reader import (
    EventReader,
    LoadStats,
    load_events,
    open_events,
    read_node_features,
)

__all__ = [
    "FORMATS",
    "ColumnMap",
    "EventReader",
    "LoadStats",
    "LoaderConfig",
    "LoaderError",
    "load_events",
    "open_events",
    "parse_columns",
    "parse_features",
    "read_node_features",
]
