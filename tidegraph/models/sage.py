"""GraphSAGE (Hamilton et al. 2017) with the mean aggregator: a static baseline.

It ignores time apart from what the sampler enforces: neighbours are sampled at the event's
time, so link prediction stays free of leakage (sampling at +inf would let it see the future).
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.models.base import TemporalModel
from tidegraph.models.layers import MeanAggregator, NodeInput, blocks_bottom_up

__all__ = ["GraphSAGE"]


class GraphSAGE(TemporalModel):
    root_dedup = True  # embeddings depend on (node, time) and blocks alone

    def __init__(
        self,
        num_nodes: int,
        dim: int = 100,
        num_layers: int = 2,
        node_features=None,
        node_feat_dim: int = 0,
    ) -> None:
        super().__init__(dim)
        self.num_layers = num_layers
        self.node_input = NodeInput(num_nodes, dim, node_features, node_feat_dim)
        self.layers = nn.ModuleList(MeanAggregator(dim, dim) for _ in range(num_layers))

    def embed(self, ids: torch.Tensor, ts: torch.Tensor, blocks: list) -> torch.Tensor:
        def layer(i, block, h_root, h_nbr):
            out = self.layers[i](h_root, h_nbr, block.mask)
            return torch.relu(out) if i + 1 < self.num_layers else out

        return blocks_bottom_up(blocks, self.node_input, layer)

    def grow(self, num_nodes: int) -> None:
        self.node_input.grow(num_nodes)
