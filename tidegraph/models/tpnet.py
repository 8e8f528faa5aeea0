"""TPNet (Lu et al., NeurIPS 2024): pair features from time-decayed temporal walk matrices,
kept as random projections and updated event by event.

The walk matrix A^(k)(t)[u, x] sums, over the k-step temporal walks from u to x (each step to
an earlier interaction), exp(-lambda (t - time of the walk's first step)). Kept exactly it is
N x N a level; TPNet keeps its random projection H^(k) = A^(k) P instead, with P a fixed random
N x d matrix (here +-1/sqrt(d) signs from a hash of the node id and column, so any id, on any
shard, after any growth, has the same row without a table). Inner products of projected rows
estimate products of walk matrices: <H^(i)_u, H^(j)_v> ~ (A^(i) A^(j)T)[u, v], the time-decayed
count of walks of length i + j between u and v (level 0 is P itself: <P_u, H^(1)_v> ~ "v met u").

Node state (buffers; `cluster.memory` replicated or sharded like TGN's memory): `walk` [N, K, d]
(levels 1..K) and `walk_t` [N] (the time a row is expressed at; a row read at t is the stored
one times exp(-lambda (t - walk_t)), all of a row's entries decaying alike). An event (u, v, t)
adds v's levels 0..K-1 at t to u's levels 1..K, and u's to v's. A step's events read the state
as the previous step left it (as TGN's memory does: within a batch, events do not see each
other), their contributions are added per node in event order (CPU: the same bits for W slices
as for one batch; CUDA's `index_add_` may order a node's several contributions differently).

A pair (u, v) at time t is scored from: the walk features of (u, v), sign-log scaled inner
products of their K + 1 levels; and each endpoint's `fanout` most recent interactions (the
sampler's `recent` block), each neighbour w a token of the walk features of (w, u) and (w, v),
its age's time encoding and its edge features, through an MLP and averaged. A pair's score
depends on both endpoints, so each negative is a pair of its own (batched, `pair_chunk` pairs
at a time) and a node has no embedding alone (`embeds=False`). Simplifications against the
paper: an MLP over the tokens instead of its MLP-Mixer, K = 2 and d = 128 fixed.
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.models.base import TableStateModel, first_block, pairwise_scores
from tidegraph.models.time_encoding import TimeEncoder
from tidegraph.ops import gather_rows
from tidegraph.storage.events import EventBatch

__all__ = ["WALK_DECAY", "TPNet", "random_signs"]

_STATE = ("walk", "walk_t")
WALK_DECAY = 1e-6  # lambda a time unit by default: a walk a second old in 8 days weighs half
_P = 2147483647  # 2^31 - 1: products of two residues stay below 2^62


def random_signs(ids: torch.Tensor, dim: int, dtype=torch.float32) -> torch.Tensor:
    """[n, dim] entries +-1/sqrt(dim), a fixed pseudo-random function of (id, column): a few
    rounds of squaring modulo a prime, vectorized in int64 (no product exceeds 2^62)."""
    col = torch.arange(dim, device=ids.device)
    x = (ids.remainder(_P).unsqueeze(1) * 40503 + col * 69069 + 12345).remainder(_P)
    for c in (1013904223, 362437, 521288629):
        x = (x * x + c).remainder(_P)
    sign = ((x >> 11) & 1).to(dtype) * 2 - 1
    return sign / dim**0.5


def signed_log(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.log1p(x.abs())


class TPNet(TableStateModel):
    root_dedup = True  # a root's sequence and walk rows are functions of (node, time)
    state_names = _STATE

    def __init__(
        self,
        num_nodes: int,
        dim: int = 100,
        time_dim: int = 100,
        edge_dim: int = 0,
        tokens: int = 20,
        decay: float = WALK_DECAY,
        levels: int = 2,
        walk_dim: int = 128,
        pair_chunk: int = 1024,
    ) -> None:
        super().__init__(dim)
        self.num_layers = 1
        self.edge_dim, self.tokens, self.decay = edge_dim, tokens, decay
        self.levels, self.walk_dim, self.pair_chunk = levels, walk_dim, pair_chunk
        feats = (levels + 1) ** 2
        self.time_enc = TimeEncoder(time_dim)
        self.token_in = nn.Linear(2 * feats + time_dim + edge_dim, dim)
        self.token_mlp = nn.Sequential(nn.ReLU(), nn.Linear(dim, dim))
        self.pair_in = nn.Sequential(nn.Linear(feats, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.head = nn.Sequential(nn.Linear(3 * dim, dim), nn.ReLU(), nn.Linear(dim, 1))
        self.register_buffer("walk", torch.zeros(num_nodes, levels, walk_dim))
        self.register_buffer("walk_t", torch.zeros(num_nodes, dtype=torch.float64))
        # `_queue`, per forward pass: (events in it, its sources' and destinations' walk rows)

    def embed(self, ids, ts, blocks):
        raise ValueError("tpnet scores a pair from both endpoints: a node has no embedding alone")

    def rows(self, ids: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
        """Walk rows [n, K + 1, d] of `ids` at times `ts`: P, then levels 1..K decayed."""
        loc = self._r(ids)
        gap = (ts.to(torch.float64) - self.walk_t.index_select(0, loc)).clamp(min=0)
        fade = torch.exp(-self.decay * gap).to(self.walk.dtype)
        walked = gather_rows(self.walk.reshape(self.walk.shape[0], -1), loc)
        walked = walked.view(-1, self.levels, self.walk_dim) * fade.view(-1, 1, 1)
        return torch.cat([random_signs(ids, self.walk_dim, self.walk.dtype).unsqueeze(1),
                          walked], 1)  # fmt: skip

    # ---- forward ----------------------------------------------------------------------------

    def score(self, src, dst, neg_BQ, t, blocks):
        if self.training:
            self._queue.clear()
        b, q = neg_BQ.shape
        block = first_block(blocks)
        k = block.nbr_ids.shape[1]
        if k != self.tokens:
            raise ValueError(f"tpnet: built for {self.tokens} neighbours a node, the sampler "
                             f"gave {k} (sampler.fanouts)")  # fmt: skip
        with torch.no_grad():  # the rows the events' contributions come from (`take_updates`)
            self._queue.append((b, self.rows(src, t), self.rows(dst, t)))
        slot_row = self._slot_rows(block)
        pairs = lambda left, right: self._pairs(block, slot_row, left, right)  # noqa: E731
        return pairwise_scores(block, b, q, self.pair_chunk, pairs)

    def _slot_rows(self, block) -> torch.Tensor | None:
        """The edge-feature row of each block slot [R, L] (-1 where masked), or None where the
        model takes no edge features or none were fetched."""
        if not self.edge_dim or block.edge_feat is None:
            return None
        index = block.valid_index
        slot = torch.full((block.nbr_ids.numel(),), -1, dtype=torch.int64, device=index.device)
        slot.index_copy_(0, index, torch.arange(index.numel(), device=index.device))
        return slot.view(block.nbr_ids.shape)

    def _pairs(self, block, slot_row, left, right):
        """Logits [P] of the pairs of block rows (`left`, `right`). Walk rows are read a
        chunk at a time, each distinct row of the chunk once (a positive's source is the left
        row of all its negatives' pairs); no parameters, so no gradient flows into the node
        state."""
        rows_l, inv_l = torch.unique(left, return_inverse=True)
        rows_r, inv_r = torch.unique(right, return_inverse=True)
        with torch.no_grad():
            w_l = self.rows(block.dst_ids[rows_l], block.dst_ts[rows_l])
            w_r = self.rows(block.dst_ids[rows_r], block.dst_ts[rows_r])
            w_left, w_right = w_l[inv_l], w_r[inv_r]
        z_left = self._side(block, slot_row, rows_l, inv_l, w_l, w_right)
        z_right = self._side(block, slot_row, rows_r, inv_r, w_r, w_left)
        pair = signed_log(torch.bmm(w_left, w_right.transpose(1, 2)).flatten(1))
        h = torch.cat([z_left, z_right, self.pair_in(pair.to(z_left))], 1)
        return self.head(h).squeeze(1)

    def _side(self, block, slot_row, rows, inv, w_rows, w_other):
        """[P, D]: each pair's own block row (`rows[inv]`) with its neighbour tokens, each the
        walk features of the neighbour with the row's node (`w_rows`, a distinct row's) and
        with the pair's partner (`w_other`, a pair's), its age's time encoding and edge
        features, through the token MLP and averaged. The neighbours' walk rows, and their
        features with the row's node, are computed once a distinct row."""
        u, k = rows.numel(), self.tokens
        mask_u = block.mask[rows]
        with torch.no_grad():
            valid = mask_u.flatten().nonzero().squeeze(1)  # only valid slots hold node ids
            ids = block.nbr_ids[rows].flatten().index_select(0, valid)
            ts = block.dst_ts[rows].repeat_interleave(k).index_select(0, valid)
            seq = w_rows.new_zeros(u * k, self.levels + 1, self.walk_dim)
            seq = seq.index_copy(0, valid, self.rows(ids, ts))
            seq = seq.view(u, k * (self.levels + 1), -1)  # [U, L (K + 1), d]
            p = inv.numel()
            with_own = torch.bmm(seq, w_rows.transpose(1, 2)).view(u, k, -1)[inv]
            with_other = torch.bmm(seq[inv], w_other.transpose(1, 2)).view(p, k, -1)
        dtype, own, mask = self.token_in.weight.dtype, rows[inv], mask_u[inv]
        parts = [signed_log(torch.cat([with_own, with_other], 2)).to(dtype),
                 self.time_enc(block.dt[own].masked_fill(~mask, 0)).to(dtype)]  # fmt: skip
        if self.edge_dim:
            parts.append(self._edge_inputs(block, slot_row, own, dtype))
        x = self.token_mlp(self.token_in(torch.cat(parts, 2)))
        m = mask.unsqueeze(2).to(dtype)
        return (x * m).sum(1) / m.sum(1).clamp(min=1)

    def _edge_inputs(self, block, slot_row, own, dtype):
        """Edge features [P, L, De] of the `own` rows' slots (masked slots, or none fetched:
        zero), gathered for these rows only."""
        k = self.tokens
        out = torch.zeros(own.numel() * k, self.edge_dim, dtype=dtype, device=own.device)
        if slot_row is not None:
            rows = slot_row[own].flatten()
            have = (rows >= 0).nonzero().squeeze(1)
            feat = block.edge_feat.index_select(0, rows.index_select(0, have)).to(out)
            out = out.index_copy(0, have, feat)
        return out.view(-1, k, self.edge_dim)

    # ---- node state -------------------------------------------------------------------------

    def commit(self, events: EventBatch | None) -> None:
        if events is None or not len(events) or not self._queue:
            return  # evaluation chunks queue their rows until the events are recorded
        super().commit(events)

    @torch.no_grad()
    def take_updates(self, events: EventBatch | None) -> dict | None:
        """Each event's contributions to its endpoints' levels 1..K (the other endpoint's
        levels 0..K-1 at the event's time, as the previous step left them), by kind (to the
        sources, to the destinations), so slices concatenate into one batch's order."""
        if events is None or not len(events) or not self._queue:
            self._queue.clear()
            return None
        n = len(events)
        at_src = torch.cat([w for _, w, _ in self._queue])[:n]
        at_dst = torch.cat([w for _, _, w in self._queue])[:n]
        self._queue.clear()
        return {"src": events.src, "dst": events.dst, "t": events.t.to(torch.float64),
                "to_src": at_dst[:, : self.levels], "to_dst": at_src[:, : self.levels]}  # fmt: skip

    @torch.no_grad()
    def apply_updates(self, updates: list[dict | None], owned=None) -> None:
        updates = [u for u in updates if u is not None]
        if not updates:
            return
        cat = lambda key: torch.cat([u[key] for u in updates])  # noqa: E731
        nodes = torch.cat([cat("src"), cat("dst")])
        add = torch.cat([cat("to_src"), cat("to_dst")])
        t = cat("t").repeat(2)
        if owned is not None:  # a shard's part: its nodes' rows, in the same order
            keep = owned(nodes).nonzero().squeeze(1)
            nodes, add, t = nodes.index_select(0, keep), add.index_select(0, keep), t[keep]
        if nodes.numel() == 0:
            return
        uniq, inv = torch.unique(nodes, return_inverse=True)
        loc = self._r(uniq)
        old_t = self.walk_t.index_select(0, loc)
        new_t = old_t.scatter_reduce(0, inv, t, "amax")
        fade_old = torch.exp(-self.decay * (new_t - old_t)).to(self.walk.dtype)
        fade_add = torch.exp(-self.decay * (new_t.index_select(0, inv) - t)).to(self.walk.dtype)
        walked = self.walk.index_select(0, loc) * fade_old.view(-1, 1, 1)
        walked.index_add_(0, inv, add.to(walked.dtype) * fade_add.view(-1, 1, 1))
        self.changed.mark(loc)
        self.walk.index_copy_(0, loc, walked)
        self.walk_t.index_copy_(0, loc, new_t)
