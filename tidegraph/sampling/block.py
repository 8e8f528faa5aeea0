"""A sampled hop of a temporal neighbourhood, as dense [roots, fanout] tensors.

Invalid slots (a root with fewer visible neighbours than the fanout) have `mask` False,
`nbr_ids` and `nbr_eids` -1, `nbr_ts` equal to the root's time and `dt` 0; consumers must
select or zero them through `mask`, never index with them unmasked.

Samplers return ids only; a fetch stage fills `edge_feat` with the rows of the valid slots'
edges before the model runs, so models never read a store.

The next hop's roots are this hop's roots followed by its valid neighbours (`next_roots`). A
sampler that deduplicates them sets `next_index`: row i of that list is row `next_index[i]` of
the next block, whose roots are the distinct (node, time) pairs. Likewise a first block sampled
for the distinct (node, time) pairs of a batch's roots carries `root_index`: root i of the
list the caller gave is row `root_index[i]` of the block (models embed each row once and
gather the embeddings back, `TemporalModel.score`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import torch

__all__ = ["Block"]


@dataclass
class Block:
    """One hop: `dst_*` are the R roots of this hop, `nbr_*` their sampled neighbours [R, K]."""

    dst_ids: torch.Tensor  # int64 [R]
    dst_ts: torch.Tensor  # float64 [R]
    nbr_ids: torch.Tensor  # int64 [R, K]
    nbr_ts: torch.Tensor  # float64 [R, K], time of the sampled edge
    nbr_eids: torch.Tensor  # int64 [R, K]
    dt: torch.Tensor  # float32 [R, K] = dst_ts - nbr_ts
    mask: torch.Tensor  # bool [R, K]
    next_index: torch.Tensor | None = None  # int64 [R + V]: next_roots() row -> next block row
    root_index: torch.Tensor | None = None  # int64 [R0]: the caller's root -> this block's row
    # features of the valid slots' edges [V, De], joined by a fetch stage after sampling
    # (`tidegraph.training.fetch`); None when the stream has no edge features
    edge_feat: torch.Tensor | None = None

    @property
    def num_roots(self) -> int:
        return int(self.dst_ids.shape[0])

    @property
    def fanout(self) -> int:
        return int(self.nbr_ids.shape[1])

    @cached_property
    def valid_index(self) -> torch.Tensor:
        """Flat row-major positions of the valid slots, int64 [V] (computed once)."""
        return self.mask.flatten().nonzero().squeeze(1)

    @cached_property
    def valid_rows(self) -> torch.Tensor:
        """The root (row) of each valid slot, int64 [V]."""
        return torch.div(self.valid_index, self.fanout, rounding_mode="floor")

    def valid(self, x: torch.Tensor) -> torch.Tensor:
        """`x[mask]` for x [R, K, ...]: the valid slots in row-major order, [V, ...]."""
        return x.flatten(0, 1).index_select(0, self.valid_index)

    def next_roots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Roots of the next hop: these roots, then the valid neighbours in row-major order."""
        ids = torch.cat([self.dst_ids, self.valid(self.nbr_ids)])
        ts = torch.cat([self.dst_ts, self.valid(self.nbr_ts)])
        return ids, ts

    def to(self, device: torch.device | str) -> Block:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return Block(**{k: v if v is None else v.to(device) for k, v in moved.items()})
