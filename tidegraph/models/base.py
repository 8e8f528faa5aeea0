"""The interface every temporal link-prediction model implements, and the link predictor.

A model embeds roots (ids at times) from the sampler's blocks and scores (src, dst) pairs with
an MLP over the pair of embeddings. Models with node state (TGN memory) keep it in buffers and
expose the batch protocol used by the trainer: after `score` on a batch, `commit(events)` folds
the state computed in that forward pass back and records `events` (None for replayed or
evaluation-only batches whose events must not enter the state); `reset_state`, `node_state` and
`load_node_state` snapshot and restore it. Stateless models inherit no-op versions.
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.storage.events import EventBatch

__all__ = ["LinkPredictor", "TemporalModel"]


class LinkPredictor(nn.Module):
    """logit(src, dst) = w . relu(A z_src + B z_dst) + c (TGN's link predictor)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_src = nn.Linear(dim, dim)
        self.lin_dst = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, z_src: torch.Tensor, z_dst: torch.Tensor) -> torch.Tensor:
        """z_src [B, D] against z_dst [B, D] or [B, Q, D]; logits [B] or [B, Q]."""
        a = self.lin_src(z_src)
        if z_dst.dim() == 3:
            a = a.unsqueeze(1)
        return self.out(torch.relu(a + self.lin_dst(z_dst))).squeeze(-1)

    def pairs(
        self, z_src: torch.Tensor, z_dst: torch.Tensor, z_neg: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(z_src, z_dst)` and `forward(z_src, z_neg)` ([B, Q, D]) with each linear map
        applied once: logits [B] and [B, Q]."""
        b, q, d = z_neg.shape
        a = self.lin_src(z_src)
        both = self.lin_dst(torch.cat([z_dst, z_neg.reshape(b * q, d)]))
        pos = self.out(torch.relu(a + both[:b])).squeeze(-1)
        neg = self.out(torch.relu(a.unsqueeze(1) + both[b:].view(b, q, -1))).squeeze(-1)
        return pos, neg


class TemporalModel(nn.Module):
    """Base class: subclasses set `num_layers`, `uses_snapshots` and implement `embed`."""

    num_layers: int = 1
    uses_snapshots: bool = False

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.predictor = LinkPredictor(dim)
        self.edge_store = None  # any object with get(eids) -> [n, edge_dim]; not a parameter

    def embed(self, ids: torch.Tensor, ts: torch.Tensor, blocks: list) -> torch.Tensor:
        raise NotImplementedError

    def score(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        neg_BQ: torch.Tensor,
        t: torch.Tensor,
        blocks: list,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the true pairs [B] and of (src, negative) pairs [B, Q].

        `blocks` were sampled for roots cat(src, dst, neg_BQ.flatten()) at times t, t, t...
        """
        b, q = neg_BQ.shape
        roots, ts = link_roots(src, dst, neg_BQ, t)
        z = self.embed(roots, ts, blocks)
        z_src, z_dst, z_neg = z[:b], z[b : 2 * b], z[2 * b :].view(b, q, -1)
        return self.predictor.pairs(z_src, z_dst, z_neg)

    # ---- node state (no-ops for stateless models) -----------------------------------------

    def grow(self, num_nodes: int) -> None:
        """Make room for node ids below `num_nodes`."""

    def commit(self, events: EventBatch | None) -> None:
        """Fold the last forward pass's state in and record `events` (None: record none)."""

    def discard(self) -> None:
        """Drop the last forward pass's state without folding it in (evaluation-only passes)."""

    def reset_state(self) -> None:
        """Forget all node state (start of a pass over the stream from its beginning)."""

    def node_state(self) -> dict:
        return {}

    def load_node_state(self, state: dict) -> None:
        """Restore what `node_state` returned."""


def link_roots(
    src: torch.Tensor, dst: torch.Tensor, neg_BQ: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Roots (src, dst, negatives row-major) and their times, in the order `score` expects."""
    q = neg_BQ.shape[1]
    roots = torch.cat([src, dst, neg_BQ.flatten()])
    ts = torch.cat([t, t, t.repeat_interleave(q)])
    return roots, ts
