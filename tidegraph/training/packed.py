"""A pass's steps as a few tensors, for one task that carries the whole pass.

A whole pass sent to a trainer is a list of per-step tuples (a slice's events, weights,
negatives, counts). Serialized as they are, each of its small tensors costs the driver and the
trainer a pickling and an object-store buffer of its own: about 1.2 ms a step on this project's
dev box at slices of 25 events, as much as the slice's forward pass (benchmarks/RESULTS.md,
"A step's fixed cost"). `PackedSteps` stores each position of the tuples as one tensor, the
steps' pieces concatenated with their lengths (an `EventBatch` field by field), so a pass
ships O(fields) tensors whatever its steps; iterating gives the tuples back, each tensor a
copy with its own storage (what the list carried: a step's events may be kept in node-state
updates, the update log or a recovery report, and a view would carry the whole pass along).
Positions that are not all tensors of one kind (None, numbers, a mix) stay Python lists.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from tidegraph.storage.events import EventBatch

__all__ = ["PackedSteps"]


class PackedSteps:
    """The tuples of `steps` (each of the same length), packed by position."""

    def __init__(self, steps: list[tuple]) -> None:
        self.count = len(steps)
        width = len(steps[0]) if steps else 0
        if any(len(s) != width for s in steps):
            raise ValueError("PackedSteps: every step must have the same number of parts")
        self.columns = [_pack([s[i] for s in steps]) for i in range(width)]

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return zip(*(_unpack(c) for c in self.columns), strict=True) if self.columns else iter(())


def _pack(values: list):
    if all(isinstance(v, EventBatch) for v in values) and _same_fields(values):
        lengths = torch.tensor([len(v) for v in values], dtype=torch.int64)
        return ("events", EventBatch.cat(values), lengths)
    if all(torch.is_tensor(v) for v in values) and _stackable(values):
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int64)
        return ("tensor", torch.cat(values), lengths)
    return ("values", [_own(v) for v in values])


def _same_fields(batches: list[EventBatch]) -> bool:
    """Whether every batch has the same optional fields, of one dtype and row shape each."""
    return all(len({_kind(getattr(b, f.name)) for b in batches}) == 1 for f in fields(EventBatch))


def _stackable(tensors: list[torch.Tensor]) -> bool:
    return len({_kind(t) for t in tensors}) == 1 and tensors[0].dim() > 0


def _kind(x: torch.Tensor | None):
    return None if x is None else (x.dtype, x.device, tuple(x.shape[1:]))


def _unpack(column):
    if column[0] == "values":
        yield from column[1]
        return
    kind, flat, lengths = column
    ends = torch.cumsum(lengths, 0).tolist()
    starts = [0, *ends[:-1]]
    for lo, hi in zip(starts, ends, strict=True):
        if kind == "tensor":
            yield flat[lo:hi].clone()
        else:
            yield EventBatch(**{f.name: _copy(getattr(flat, f.name), lo, hi)
                                for f in fields(EventBatch)})  # fmt: skip


def _own(x):
    """`x` in storage of its own (a view would pickle its whole base)."""
    if torch.is_tensor(x):
        return x.clone()
    if isinstance(x, EventBatch):
        return EventBatch(**{f.name: _copy(getattr(x, f.name), 0, len(x)) for f in fields(x)})
    return x


def _copy(x: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if x is None else x[lo:hi].clone()
