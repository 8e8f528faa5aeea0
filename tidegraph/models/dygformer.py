"""DyGFormer (Yu et al., NeurIPS 2023): a pair (u, v) at time t is encoded jointly. Each
endpoint's sequence is the node itself then its L - 1 most recent interactions (newest first);
each token carries the time encoding of its age, its edge's features and its neighbour
co-occurrence encoding, the number of times the token's node appears in u's sequence and in
v's (so "v is among u's recent neighbours", the signal EdgeBank memorises, is read by a
learned function); the two sequences, concatenated, go through a Transformer encoder, and each
endpoint's tokens are averaged into its side of the pair's representation, scored by the link
predictor.

The score of (u, v) depends on both sequences: every negative of a positive is a pair encoded
anew (batched over pairs, `pair_chunk` at a time, no loop per pair), and a node has no
embedding alone (`embed` refuses; the registry declares `embeds=False`). No node state: W
trainers are plain data-parallel SGD. Padding tokens are masked out of attention and means;
no dropout, so a step is a function of its batch alone (W trainers give one trainer's step).
Patches of one token (the paper's patch size 1 on short sequences); an encoder without
biases (see `__init__`).
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.models.base import TemporalModel, first_block, pairwise_scores
from tidegraph.models.time_encoding import TimeEncoder

__all__ = ["DyGFormer"]


class DyGFormer(TemporalModel):
    root_dedup = True  # a root's sequence is a function of (node, time) alone

    def __init__(
        self,
        num_nodes: int,
        dim: int = 100,
        time_dim: int = 100,
        edge_dim: int = 0,
        length: int = 32,
        channels: int = 50,
        layers: int = 2,
        heads: int = 2,
        pair_chunk: int = 2048,
    ) -> None:
        super().__init__(dim)
        self.num_layers = 1
        self.edge_dim, self.length, self.pair_chunk = edge_dim, length, pair_chunk
        self.time_enc = TimeEncoder(time_dim)
        self.time_in = nn.Linear(time_dim, channels)
        self.edge_in = nn.Linear(edge_dim, channels) if edge_dim else None
        self.cooc = nn.Sequential(nn.Linear(1, channels), nn.ReLU(), nn.Linear(channels, channels))
        width = channels * (3 if edge_dim else 2)
        # no biases in the encoder: attention is blind to a key bias (it adds the same to a
        # query's every score), so its gradient is zero up to rounding, on which Adam would
        # step; the token projections before it have theirs
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           batch_first=True, bias=False)  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(width, dim)

    def embed(self, ids, ts, blocks):
        raise ValueError("dygformer encodes a pair jointly: a node has no embedding alone")

    def _sequences(self, block):
        """Per block row: token ids [R, L] (the node, then its L - 1 newest neighbours), their
        mask, ages [R, L] and edge features [R, L, De] (the node's own token: age 0, zero
        features)."""
        r, k = block.nbr_ids.shape
        if k != self.length - 1:
            raise ValueError(f"dygformer: built for sequences of {self.length} (the node and "
                             f"{self.length - 1} neighbours), the sampler gave {k} "
                             f"neighbours (sampler.fanouts)")  # fmt: skip
        ids = torch.cat([block.dst_ids.unsqueeze(1), block.nbr_ids], 1)
        mask = torch.cat([block.mask.new_ones(r, 1), block.mask], 1)
        dt = torch.cat([block.dt.new_zeros(r, 1), block.dt.masked_fill(~block.mask, 0)], 1)
        feat = None
        if self.edge_in is not None:
            feat = self.edge_in.weight.new_zeros(r * k, self.edge_dim)
            if block.edge_feat is not None:
                rows = block.edge_feat.to(feat.device, feat.dtype)
                feat = feat.index_copy(0, block.valid_index, rows)
            feat = torch.cat([feat.new_zeros(r, 1, self.edge_dim), feat.view(r, k, -1)], 1)
        return ids, mask, dt, feat

    def score(self, src, dst, neg_BQ, t, blocks):
        b, q = neg_BQ.shape
        block = first_block(blocks)
        ids, mask, dt, feat = self._sequences(block)
        pairs = lambda left, right: self._pairs(ids, mask, dt, feat, left, right)  # noqa: E731
        return pairwise_scores(block, b, q, self.pair_chunk, pairs)

    def _side(self, ids, mask, dt, feat, own, other):
        """Tokens [P, L, C] of the `own` rows' sequences in pairs with the `other` rows'."""
        seq, m = ids[own], mask[own]
        in_own = ((seq.unsqueeze(2) == seq.unsqueeze(1)) & m.unsqueeze(1)).sum(2)
        in_other = ((seq.unsqueeze(2) == ids[other].unsqueeze(1)) & mask[other].unsqueeze(1)).sum(2)
        counts = torch.stack([in_own, in_other], 2) * m.unsqueeze(2)
        counts = counts.to(self.out.weight.dtype)
        parts = [self.time_in(self.time_enc(dt[own])),
                 self.cooc(counts.unsqueeze(3)).sum(2)]  # fmt: skip
        if feat is not None:
            parts.insert(0, self.edge_in(feat[own]))
        return torch.cat(parts, 2) * m.unsqueeze(2).to(counts.dtype)

    def _pairs(self, ids, mask, dt, feat, left, right):
        # a sequence's valid tokens come first (newest first, then padding): both sides are
        # cut to the longest valid prefix of the chunk (no positions are encoded, and
        # padding is masked, so only the work changes)
        n_left = int(mask[left].sum(1).max())
        n_right = int(mask[right].sum(1).max())
        x = torch.cat([self._side(ids, mask, dt, feat, left, right)[:, :n_left],
                       self._side(ids, mask, dt, feat, right, left)[:, :n_right]], 1)  # fmt: skip
        keep = torch.cat([mask[left, :n_left], mask[right, :n_right]], 1)
        h = self.encoder(x, src_key_padding_mask=~keep)
        h = h * keep.unsqueeze(2)
        z_left = h[:, :n_left].sum(1) / keep[:, :n_left].sum(1, keepdim=True)
        z_right = h[:, n_left:].sum(1) / keep[:, n_left:].sum(1, keepdim=True)
        return self.predictor(self.out(z_left), self.out(z_right))
