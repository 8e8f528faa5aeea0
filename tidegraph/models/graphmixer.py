"""GraphMixer (Cong et al., ICLR 2023): a node's K most recent interactions, each a token of
its edge features and the fixed time encoding of its age, mixed by an MLP-Mixer (token mixing
across the K positions, newest first, then channel mixing), averaged into a link summary; a
node summary, the node's layer-0 state plus the mean of its neighbours', is added. No
attention, no node memory: the embedding is a function of the node, the time and its one-hop
block, so a node embeds alone and W trainers are plain data-parallel SGD.

The K positions are the sampler's fanout (`recent`: newest first; an interaction less than K
leaves masked slots, zero tokens). Layer-0 states come from node features when a store is
given, otherwise from a learned per-node table, as in TGAT (the paper's node encoder reads
node features, which the bundled datasets lack).
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.models.base import TemporalModel
from tidegraph.models.layers import NodeInput, edge_features
from tidegraph.models.time_encoding import TimeEncoder

__all__ = ["GraphMixer"]


class _MixerLayer(nn.Module):
    def __init__(self, tokens: int, channels: int, token_factor: float = 0.5,
                 channel_factor: float = 4.0) -> None:  # fmt: skip
        super().__init__()
        hidden_t, hidden_c = max(1, int(tokens * token_factor)), int(channels * channel_factor)
        self.norm_t = nn.LayerNorm(channels)
        # no output bias: a token's shift is the same in every channel, which every later
        # layer (a LayerNorm over channels) removes, so its gradient is zero up to rounding
        # and Adam would step on the rounding noise
        self.token = nn.Sequential(nn.Linear(tokens, hidden_t), nn.GELU(),
                                   nn.Linear(hidden_t, tokens, bias=False))  # fmt: skip
        self.norm_c = nn.LayerNorm(channels)
        self.channel = nn.Sequential(nn.Linear(channels, hidden_c), nn.GELU(),
                                     nn.Linear(hidden_c, channels))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, K, C] -> [R, K, C]."""
        x = x + self.token(self.norm_t(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel(self.norm_c(x))


class GraphMixer(TemporalModel):
    root_dedup = True  # a function of (node, time) and its block alone

    def __init__(
        self,
        num_nodes: int,
        dim: int = 100,
        time_dim: int = 100,
        edge_dim: int = 0,
        tokens: int = 20,
        mixer_layers: int = 2,
        node_features=None,
        node_feat_dim: int = 0,
    ) -> None:
        super().__init__(dim)
        self.num_layers = 1
        self.edge_dim, self.tokens = edge_dim, tokens
        self.time_enc = TimeEncoder(time_dim)
        self.token_in = nn.Linear(edge_dim + time_dim, dim)
        self.mixers = nn.ModuleList(_MixerLayer(tokens, dim) for _ in range(mixer_layers))
        self.norm = nn.LayerNorm(dim)
        self.link_out = nn.Linear(dim, dim)
        self.node_input = NodeInput(num_nodes, dim, node_features, node_feat_dim)

    def embed(self, ids: torch.Tensor, ts: torch.Tensor, blocks: list) -> torch.Tensor:
        block = blocks[0]
        r, k = block.nbr_ids.shape
        if k != self.tokens:
            raise ValueError(f"graphmixer: built for {self.tokens} neighbours a node, the "
                             f"sampler gave {k} (sampler.fanouts)")  # fmt: skip
        h_root = self.node_input(block.dst_ids)
        rows = block.valid_rows
        # tokens of the valid slots [V, De + T], scattered into [R, K, C] (masked slots: 0)
        parts = [edge_features(block.edge_feat, self.edge_dim, h_root)] if self.edge_dim else []
        if self.edge_dim and parts[0] is None:  # a stream without features: zero features
            parts = [h_root.new_zeros(rows.numel(), self.edge_dim)]
        parts.append(self.time_enc(block.valid(block.dt)).to(h_root.dtype))
        tok = self.token_in(torch.cat(parts, 1))
        x = h_root.new_zeros(r * k, tok.shape[1]).index_copy(0, block.valid_index, tok)
        x = x.view(r, k, -1)
        for mixer in self.mixers:
            x = mixer(x)
        link = self.link_out(self.norm(x).mean(1))
        # node summary: the root's state plus the mean of its valid neighbours' states
        nbr = self.node_input(block.valid(block.nbr_ids))
        count = torch.bincount(rows, minlength=r).clamp(min=1).unsqueeze(1).to(h_root.dtype)
        mean = h_root.new_zeros(r, h_root.shape[1]).index_add(0, rows, nbr) / count
        return link + h_root + mean

    def grow(self, num_nodes: int) -> None:
        self.node_input.grow(num_nodes)
