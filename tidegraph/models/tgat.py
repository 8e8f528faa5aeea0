"""TGAT (Xu et al. 2020): stacked temporal graph attention with the functional time encoding.

Two layers by default over `recent` or `uniform` temporal neighbours. Layer-0 states come from
node features when a store is given, otherwise from a learned per-node table (the bundled
datasets have no features); edge features join the keys when `edge_dim` > 0.
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.models.base import TemporalModel
from tidegraph.models.layers import (
    NodeInput,
    TemporalAttention,
    blocks_bottom_up,
    edge_features,
    project_distinct,
)
from tidegraph.models.time_encoding import TimeEncoder

__all__ = ["TGAT"]


class TGAT(TemporalModel):
    root_dedup = True  # embeddings depend on (node, time) and blocks alone

    def __init__(
        self,
        num_nodes: int,
        dim: int = 100,
        time_dim: int = 100,
        edge_dim: int = 0,
        num_layers: int = 2,
        heads: int = 2,
        node_features=None,
        node_feat_dim: int = 0,
    ) -> None:
        super().__init__(dim)
        self.num_layers = num_layers
        self.edge_dim = edge_dim
        self.node_input = NodeInput(num_nodes, dim, node_features, node_feat_dim)
        self.time_enc = TimeEncoder(time_dim)
        self.layers = nn.ModuleList(
            TemporalAttention(dim, self.time_enc, edge_dim, dim, heads) for _ in range(num_layers)
        )

    def embed(self, ids: torch.Tensor, ts: torch.Tensor, blocks: list) -> torch.Tensor:
        def layer(i, block, h_root, h_nbr):
            e = edge_features(block.edge_feat, self.edge_dim, h_root)
            kv_nbr = None
            if i == 0:
                nbr = block.valid(block.nbr_ids)
                kv_nbr = project_distinct(self.layers[0], self.node_input, nbr)
            return self.layers[i](h_root, h_nbr, block.valid(block.dt), e, block, kv_nbr)

        return blocks_bottom_up(blocks, self.node_input, layer, bottom_nbr_states=False)

    def grow(self, num_nodes: int) -> None:
        self.node_input.grow(num_nodes)
