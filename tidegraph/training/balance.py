"""Where to cut a step's batch among W trainers: even slices, or slices of equal sampled edges.

Each step every trainer gets a contiguous slice of the batch (contiguous, so the slices'
node-state updates concatenate into the batch's order). Even slices can be skewed: the work of
an event is the neighbourhoods of its roots (source, destination, negatives), and a root with
many earlier interactions samples a full fanout at every hop while a new node samples none. A
trainer with the heavier slice makes the others wait at the all-reduce (GNNFlow balances its
static schedule by sampled edges for this reason).

`SliceBalancer` estimates each event's sampled edges from the degrees of the events ingested so
far (one `bincount` per ingest): a root of degree d samples min(d, k1) first-hop edges, each of
which opens at most k2 more, and so on, plus one for the root itself. When the even slices'
estimated work differs by more than `tolerance` (the heaviest slice over the mean), the batch
is cut at equal shares of the estimate instead. Every cut gives the same step (the loss of a
slice is weighted by its share of the global batch; updates concatenate in order), so this
changes where work runs, not what is computed (to float summation order). The degrees are
state: a resumed run cuts its batches where the uninterrupted one did.
"""

from __future__ import annotations

import torch

from tidegraph.storage.events import EventBatch
from tidegraph.training.schedule import slice_bounds

__all__ = ["SliceBalancer"]


class SliceBalancer:
    """Slice bounds for a group of trainers sampling with `fanouts` per hop; `tolerance`
    None keeps even slices always."""

    def __init__(self, fanouts: list[int], tolerance: float | None = 0.1) -> None:
        self.fanouts = [int(k) for k in fanouts]
        self.tolerance = tolerance
        self.degree = torch.zeros(0, dtype=torch.int64)
        self.rebalanced = 0  # steps cut by work, not evenly (a counter for reports)
        # edges opened by each first-hop edge: 1 + k2 + k2*k3 + ...
        tail, self._per_edge = 1, 1
        for k in self.fanouts[1:]:
            tail *= k
            self._per_edge += tail

    def ingest(self, events: EventBatch) -> None:
        if not len(events):
            return
        ends = torch.cat([events.src, events.dst])
        counts = torch.bincount(ends, minlength=len(self.degree))
        if len(counts) > len(self.degree):
            counts[: len(self.degree)] += self.degree
            self.degree = counts
        else:
            self.degree += counts

    def event_work(self, ev: EventBatch, neg_BQ: torch.Tensor) -> torch.Tensor:
        """Estimated sampled edges (plus roots) of each event's roots, [B] int64."""
        return self._root_work(ev.src) + self._root_work(ev.dst) + self._root_work(neg_BQ).sum(1)

    def _root_work(self, ids: torch.Tensor) -> torch.Tensor:
        n = len(self.degree)
        if n == 0:
            deg = torch.zeros_like(ids)
        else:  # nodes not in any ingested event yet have degree 0
            deg = torch.where(ids < n, self.degree[ids.clamp(max=n - 1)], 0)
        first = self.fanouts[0] if self.fanouts else 0  # no sampling: every root costs one
        return 1 + deg.clamp(max=first) * self._per_edge

    def bounds(self, ev: EventBatch, neg_BQ: torch.Tensor, trainers: int) -> list[tuple[int, int]]:
        """Contiguous [lo, hi) per trainer covering the batch."""
        even = slice_bounds(len(ev), trainers)
        if trainers == 1 or self.tolerance is None or len(ev) < trainers:
            return even
        cum = torch.cumsum(self.event_work(ev, neg_BQ), 0)
        ends = torch.tensor([hi for _, hi in even])
        work = torch.diff(cum[ends - 1], prepend=cum.new_zeros(1)).double()
        if work.max() <= (1 + self.tolerance) * work.mean():
            return even
        self.rebalanced += 1
        targets = cum[-1].double() * torch.arange(1, trainers, dtype=torch.float64) / trainers
        # the first event whose running total reaches each target closes a slice
        cuts = (torch.searchsorted(cum.double(), targets) + 1).clamp(max=len(ev)).tolist()
        starts = [0, *cuts]
        return list(zip(starts, [*cuts, len(ev)], strict=True))

    def state_dict(self) -> dict:
        return {"degree": self.degree.clone(), "rebalanced": self.rebalanced}

    def load_state_dict(self, state: dict) -> None:
        self.degree = state["degree"].clone()
        self.rebalanced = int(state["rebalanced"])
