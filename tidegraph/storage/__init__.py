"""Dynamic graph store, event batches, loaders and feature stores."""

from tidegraph.storage.events import EventBatch
from tidegraph.storage.graph import DynamicGraph

__all__ = ["DynamicGraph", "EventBatch"]
