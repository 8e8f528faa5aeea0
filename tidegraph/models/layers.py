"""Building blocks over dense [roots, fanout] neighbourhoods: node inputs, attention, mean.

Every layer takes root states [R, D], neighbour states [R, K, D] and a validity mask [R, K];
invalid slots may hold anything finite and are excluded through the mask, and a root without a
valid neighbour gets a zero aggregate (never NaN). Multi-hop embedding is computed bottom-up
with `spread_to_slots`, which places the next hop's results into the [R, K] slots of this one.
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.sampling.block import Block

__all__ = [
    "NodeInput",
    "TemporalAttention",
    "MeanAggregator",
    "spread_to_slots",
    "edge_features",
    "blocks_bottom_up",
]


class NodeInput(nn.Module):
    """Layer-0 node states: features from a store (`get(ids)`) or a learned embedding table.

    The table grows with `grow(num_nodes)` as new nodes arrive in the stream; rows of unseen
    nodes start at the init values, drawn from the module's own generator so growth is
    reproducible.
    """

    def __init__(self, num_nodes: int, dim: int, features=None, feat_dim: int = 0) -> None:
        super().__init__()
        self.dim = dim
        self.features = features
        if features is not None:
            self.proj = nn.Linear(feat_dim, dim)
            self.table = None
        else:
            self.proj = None
            self.table = nn.Parameter(torch.randn(num_nodes, dim) * 0.1)

    def grow(self, num_nodes: int) -> None:
        if self.table is None or num_nodes <= self.table.shape[0]:
            return
        extra = torch.randn(num_nodes - self.table.shape[0], self.dim) * 0.1
        self.table = nn.Parameter(torch.cat([self.table.data, extra.to(self.table.device)]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """States of `ids` (-1 allowed: a zero row)."""
        safe = ids.clamp(min=0)
        if self.table is not None:
            out = self.table[safe]
        else:
            out = self.proj(self.features.get(safe).to(self.proj.weight.device))
        return out * (ids >= 0).unsqueeze(-1).to(out.dtype)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "table"
        if self.table is not None and key in state_dict:
            self.grow(state_dict[key].shape[0])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class TemporalAttention(nn.Module):
    """TGAT/TGN graph attention: query (root state, phi(0)), keys (nbr state, phi(dt), edge)."""

    def __init__(
        self, in_dim: int, time_dim: int, edge_dim: int, out_dim: int, heads: int = 2
    ) -> None:
        super().__init__()
        if out_dim % heads:
            raise ValueError(f"TemporalAttention: out_dim {out_dim} not divisible by {heads}")
        self.heads = heads
        self.q = nn.Linear(in_dim + time_dim, out_dim)
        self.kv = nn.Linear(in_dim + time_dim + edge_dim, 2 * out_dim)
        self.merge = nn.Sequential(
            nn.Linear(out_dim + in_dim, out_dim), nn.ReLU(), nn.Linear(out_dim, out_dim)
        )
        self.norm = nn.LayerNorm(out_dim)

    def forward(
        self,
        h_root: torch.Tensor,  # [R, Din]
        h_nbr: torch.Tensor,  # [R, K, Din]
        phi_zero: torch.Tensor,  # [Dt]
        phi_dt: torch.Tensor,  # [R, K, Dt]
        e_feat: torch.Tensor,  # [R, K, De]
        mask: torch.Tensor,  # [R, K]
    ) -> torch.Tensor:
        r, k = mask.shape
        h = self.heads
        q_R = self.q(torch.cat([h_root, phi_zero.expand(r, -1)], -1)).view(r, h, -1)
        k_RK, v_RK = self.kv(torch.cat([h_nbr, phi_dt, e_feat], -1)).view(r, k, h, -1).chunk(2, -1)
        score = torch.einsum("rhd,rkhd->rhk", q_R, k_RK) / q_R.shape[-1] ** 0.5
        keep = mask.unsqueeze(1)
        score = score.masked_fill(~keep, torch.finfo(score.dtype).min)
        attn = torch.softmax(score, -1) * keep.to(score.dtype)  # empty rows -> zeros
        agg = torch.einsum("rhk,rkhd->rhd", attn, v_RK).reshape(r, -1)
        return self.norm(self.merge(torch.cat([agg, h_root], -1)))


class MeanAggregator(nn.Module):
    """GraphSAGE mean aggregator: W [h_root || mean of valid neighbours]."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * in_dim, out_dim)

    def forward(self, h_root: torch.Tensor, h_nbr: torch.Tensor, mask: torch.Tensor):
        w = mask.unsqueeze(-1).to(h_nbr.dtype)
        mean = (h_nbr * w).sum(1) / w.sum(1).clamp(min=1)
        return self.lin(torch.cat([h_root, mean], -1))


def spread_to_slots(block: Block, below: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the next hop's per-root results into (this hop's roots [R, D], slots [R, K, D]).

    `below` holds one row per root of the next hop, whose roots are this block's roots followed
    by its valid neighbours in row-major order (`Block.next_roots`).
    """
    r, k = block.mask.shape
    slots = below.new_zeros((r, k) + tuple(below.shape[1:]))
    slots[block.mask] = below[r:]
    return below[:r], slots


def edge_features(store, edge_dim: int, eids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[..., edge_dim] features of `eids` (-1: zeros); zero-width when there are none."""
    if edge_dim == 0 or store is None:
        return like.new_zeros(tuple(eids.shape) + (edge_dim,))
    feat = store.get(eids.clamp(min=0).flatten()).to(like.device, like.dtype)
    feat = feat.view(tuple(eids.shape) + (edge_dim,))
    return feat * (eids >= 0).unsqueeze(-1).to(feat.dtype)


def blocks_bottom_up(blocks: list[Block], h0, layer_fn) -> torch.Tensor:
    """Embeddings of blocks[0]'s roots after len(blocks) layers, computed bottom-up.

    `h0(ids)` gives layer-0 states; `layer_fn(l, block, h_root, h_nbr)` applies layer l (0 is the
    bottom) to one block and returns one row per root.
    """
    depth = len(blocks)
    last = blocks[-1]
    h_root, h_nbr = h0(last.dst_ids), h0(last.nbr_ids)
    for layer in range(depth):
        block = blocks[depth - 1 - layer]
        out = layer_fn(layer, block, h_root, h_nbr)
        if layer + 1 < depth:
            h_root, h_nbr = spread_to_slots(blocks[depth - 2 - layer], out)
    return out
