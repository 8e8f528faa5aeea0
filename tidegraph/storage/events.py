"""Event batches: the unit in which interactions flow from loaders into the graph and trainers.

An event is (src, dst, t, edge features, optional label). Node ids are int64 and non-negative;
times are float64 (int64 seconds are exact below 2**53). `eid` is the event's position in the
stream (its row in the durable log), so edge features are addressed by it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["EventBatch"]


@dataclass
class EventBatch:
    """A batch of events as 1-D tensors of equal length N (edge_feat is [N, F])."""

    src: torch.Tensor
    dst: torch.Tensor
    t: torch.Tensor
    eid: torch.Tensor
    edge_feat: torch.Tensor | None = None
    label: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.src.shape[0]
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value.shape[0] != n:
                raise ValueError(f"EventBatch.{f.name} has {value.shape[0]} rows, src has {n}")

    def __len__(self) -> int:
        return int(self.src.shape[0])

    def to(self, device: torch.device | str) -> EventBatch:
        return EventBatch(**{f.name: _to(getattr(self, f.name), device) for f in fields(self)})

    def select(self, index: torch.Tensor | slice) -> EventBatch:
        """Rows `index` (a slice, a boolean mask or positions) of every field."""
        return EventBatch(**{f.name: _take(getattr(self, f.name), index) for f in fields(self)})

    @staticmethod
    def cat(batches: list[EventBatch]) -> EventBatch:
        """Concatenate batches; optional fields must be present in all of them or in none."""
        if not batches:
            raise ValueError("EventBatch.cat needs at least one batch")
        out = {}
        for f in fields(EventBatch):
            values = [getattr(b, f.name) for b in batches]
            present = [v is not None for v in values]
            if any(present) and not all(present):
                raise ValueError(f"EventBatch.cat: field {f.name} is missing in some batches")
            out[f.name] = torch.cat(values) if all(present) else None
        return EventBatch(**out)


def _to(value: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    return None if value is None else value.to(device)


def _take(value: torch.Tensor | None, index: torch.Tensor | slice) -> torch.Tensor | None:
    return None if value is None else value[index]
