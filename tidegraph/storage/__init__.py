"""Dynamic graph store, event batches, loaders and feature stores."""

from tidegraph.storage.events import EventBatch
from tidegraph.storage.graph import DynamicGraph
from tidegraph.storage.loaders import load_events, open_events, read_node_features
from tidegraph.storage.loaders_config import ColumnMap, LoaderConfig, LoaderError

__all__ = [
    "ColumnMap",
    "DynamicGraph",
    "EventBatch",
    "LoaderConfig",
    "LoaderError",
    "load_events",
    "open_events",
    "read_node_features",
]
