"""DySAT-style model (Sankar et al. 2020) over the sampler's time-window snapshots.

Structural attention (one or more layers, shared across snapshots) embeds each root in each
window [t - (i+1) w, t - i w); temporal self-attention with learned positions then attends from
the newest window over all windows (oldest first), and its output is the root's embedding. The
snapshots are relative to each event's own time, so no snapshot sees the event or its future.
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.models.base import TemporalModel
from tidegraph.models.layers import (
    NodeInput,
    TemporalAttention,
    blocks_bottom_up,
    project_distinct,
)

__all__ = ["DySAT"]


class DySAT(TemporalModel):
    root_dedup = True  # embeddings depend on (node, time) and blocks alone
    uses_snapshots = True

    def __init__(
        self,
        num_nodes: int,
        num_snapshots: int,
        dim: int = 100,
        num_layers: int = 1,
        heads: int = 2,
        node_features=None,
        node_feat_dim: int = 0,
    ) -> None:
        super().__init__(dim)
        self.num_layers = num_layers
        self.num_snapshots = num_snapshots
        self.node_input = NodeInput(num_nodes, dim, node_features, node_feat_dim)
        self.structural = nn.ModuleList(
            TemporalAttention(dim, None, 0, dim, heads) for _ in range(num_layers)
        )
        self.position = nn.Parameter(torch.randn(num_snapshots, dim) * 0.1)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.ffn = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.norm = nn.LayerNorm(dim)

    def embed(self, ids: torch.Tensor, ts: torch.Tensor, blocks: list) -> torch.Tensor:
        snaps = [self._structural(b) for b in reversed(blocks)]  # oldest window first
        z_RSD = torch.stack(snaps, 1) + self.position
        q = self.q(z_RSD[:, -1])
        k, v = self.kv(z_RSD).chunk(2, -1)
        attn = torch.softmax(torch.einsum("rd,rsd->rs", q, k) / self.dim**0.5, -1)
        out = torch.einsum("rs,rsd->rd", attn, v) + z_RSD[:, -1]
        return self.norm(out + self.ffn(out))

    def _structural(self, blocks: list) -> torch.Tensor:
        def layer(i, block, h_root, h_nbr):
            kv_nbr = None
            if i == 0:
                nbr = block.valid(block.nbr_ids)
                kv_nbr = project_distinct(self.structural[0], self.node_input, nbr)
            dt = block.valid(block.dt)
            return self.structural[i](h_root, h_nbr, dt, None, block, kv_nbr)

        return blocks_bottom_up(blocks, self.node_input, layer, bottom_nbr_states=False)

    def grow(self, num_nodes: int) -> None:
        self.node_input.grow(num_nodes)
