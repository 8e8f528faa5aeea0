"""Dynamic graph store, event batches, loaders and feature stores."""

from tidegraph.storage.cache import CacheConfig, CachedFeatureStore, RecentWindowTracker
from tidegraph.storage.events import EventBatch
from tidegraph.storage.features import (
    FeatureConfig,
    FeatureStore,
    HostFeatureStore,
    InMemoryFeatureStore,
)
from tidegraph.storage.graph import DynamicGraph
from tidegraph.storage.ingest import (
    ColumnMap,
    LoaderConfig,
    LoaderError,
    load_events,
    open_events,
    read_node_features,
)

__all__ = [
    "CacheConfig",
    "CachedFeatureStore",
    "ColumnMap",
    "DynamicGraph",
    "EventBatch",
    "FeatureConfig",
    "FeatureStore",
    "HostFeatureStore",
    "InMemoryFeatureStore",
    "LoaderConfig",
    "LoaderError",
    "RecentWindowTracker",
    "load_events",
    "open_events",
    "read_node_features",
]
