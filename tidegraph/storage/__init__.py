"""Dynamic graph store, event batches, loaders and feature stores."""

from tidegraph.storage.events import EventBatch

__all__ = ["EventBatch"]
