"""Building blocks over dense [roots, fanout] neighbourhoods: node inputs, attention, mean.

Every layer takes root states [R, D] and the states of the *valid* neighbour slots only, [V, D]
in row-major order of the mask (the order `Block.next_roots` lists them in, so the next hop's
results need no scatter); per-slot work (projections, time encodings) runs on the V valid slots,
and only the attention scores are laid out densely as [R, K]. A root without a valid neighbour
gets a zero aggregate (never NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidegraph.ops import gather_rows, resolved_slot_precision, slot_linear
from tidegraph.sampling.block import Block

__all__ = [
    "NodeInput",
    "TemporalAttention",
    "MeanAggregator",
    "edge_features",
    "blocks_bottom_up",
    "project_distinct",
]


_INIT_BLOCK = 4096  # node-table rows drawn per generator seed


class NodeInput(nn.Module):
    """Layer-0 node states: features from a store (`get(ids)`) or a learned embedding table.

    The table grows with `grow(num_nodes)` as new nodes arrive in the stream. Row i's initial
    values are a function of (the module's seed, i) alone: rows come in blocks of
    `_INIT_BLOCK` ids, each block drawn from a generator seeded with (seed, block), so the
    table is the same however it grew, never touches torch's global generator after
    construction, and every replica grows alike. The seed is drawn once at construction (from
    the global generator, which the caller seeds) and is a buffer, so checkpoints keep it.
    """

    def __init__(
        self, num_nodes: int, dim: int, features=None, feat_dim: int = 0, init_scale: float = 0.1
    ) -> None:
        super().__init__()
        self.dim = dim
        self.init_scale = init_scale  # of the table's initial N(0, 1) draws
        self.features = features
        if features is not None:
            self.proj = nn.Linear(feat_dim, dim)
            self.table = None
        else:
            self.proj = None
            seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
            self.register_buffer("table_seed", seed)
            self.table = nn.Parameter(self._init_rows(0, num_nodes, torch.device("cpu")))

    def _init_rows(self, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """Initial values of rows [lo, hi): one draw per block of ids (not per row)."""
        if self.init_scale == 0.0:  # no draws needed (the seed was drawn all the same)
            return torch.zeros(max(hi - lo, 0), self.dim, device=device)
        b = _INIT_BLOCK
        blocks = []
        for block in range(lo // b, -(-hi // b)):
            gen = torch.Generator().manual_seed(int(self.table_seed) + block)
            blocks.append(torch.randn(b, self.dim, generator=gen) * self.init_scale)
        if not blocks:
            return torch.empty(0, self.dim, device=device)
        start = (lo // b) * b
        return torch.cat(blocks)[lo - start : hi - start].to(device)

    def grow(self, num_nodes: int) -> None:
        if self.table is None or num_nodes <= self.table.shape[0]:
            return
        old = self.table.shape[0]
        extra = self._init_rows(old, num_nodes, self.table.device).to(self.table.dtype)
        self.table = nn.Parameter(torch.cat([self.table.data, extra]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """States of `ids` (valid ids only)."""
        if self.table is not None:
            return gather_rows(self.table, ids)
        return self.proj(self.features.get(ids).to(self.proj.weight.device))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "table"
        if self.table is not None and key in state_dict:
            self.grow(state_dict[key].shape[0])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class TemporalAttention(nn.Module):
    """TGAT/TGN graph attention: query (root state, phi(0)), keys (nbr state, phi(dt), edge).

    Keys and values are W [state] plus one projection of [phi(dt), edge] added to both (as in
    TransformerConv's edge attributes), each part its own linear map so that no per-slot concat
    is built and a caller may project each distinct neighbour state once (`kv_nbr`); keys and
    values have separate maps so that neither is a view into a shared tensor (the backward of
    such a split copies both halves again).
    `time_enc` None means no time features (DySAT's structural attention).
    `slot_precision` ("auto", "fp32", "bf16") is the precision of the per-slot time and edge
    projections (`tidegraph.ops.slot_linear`; "auto": bfloat16 where the device has it natively).
    """

    slot_precision = "fp32"  # build_model sets the configured one

    def __init__(
        self, in_dim: int, time_enc: nn.Module | None, edge_dim: int, out_dim: int, heads: int = 2
    ) -> None:
        super().__init__()
        if out_dim % heads:
            raise ValueError(f"TemporalAttention: out_dim {out_dim} not divisible by {heads}")
        self.heads = heads
        self.out_dim = out_dim
        self.time_enc = time_enc
        time_dim = time_enc.dim if time_enc is not None else 0
        self.q = nn.Linear(in_dim, out_dim)
        # the query's time part is phi(0), the same for every root: one row, broadcast
        self.q_time = nn.Linear(time_dim, out_dim, bias=False) if time_dim else None
        self.key = nn.Linear(in_dim, out_dim)
        self.value = nn.Linear(in_dim, out_dim)
        self.kv_time = nn.Linear(time_dim, out_dim, bias=False) if time_dim else None
        self.kv_edge = nn.Linear(edge_dim, out_dim, bias=False) if edge_dim else None
        self.merge = nn.Sequential(
            nn.Linear(out_dim + in_dim, out_dim), nn.ReLU(), nn.Linear(out_dim, out_dim)
        )
        self.norm = nn.LayerNorm(out_dim)

    def forward(
        self,
        h_root: torch.Tensor,  # [R, Din]
        h_nbr: torch.Tensor,  # [V, Din], valid slots in row-major order
        dt: torch.Tensor,  # [V] time since each neighbour's edge
        e_feat: torch.Tensor | None,  # [V, De] or None
        block: Block,  # the hop: its mask [R, K] and valid-slot positions
        kv_nbr: tuple[torch.Tensor, torch.Tensor] | None = None,  # project(h_nbr), by the caller
    ) -> torch.Tensor:
        """`kv_nbr` lets a caller project each distinct neighbour once and gather the rows."""
        r, k = block.mask.shape
        h, d = self.heads, self.out_dim // self.heads
        k_V, v_V = self.project(h_nbr) if kv_nbr is None else kv_nbr
        edge = None  # [V, out]: added to both keys and values
        if self.time_enc is not None:  # phi(0)'s part of the query folded into its bias
            q_bias = self.q.bias + self.q_time(self.time_enc(dt.new_zeros(1)))[0]
            query = F.linear(h_root, self.q.weight, q_bias)
            bf16 = resolved_slot_precision(self.slot_precision, dt.device) == "bf16"
            phi = self.time_enc(dt, bf16_consumer=bf16)
            edge = slot_linear(self.kv_time, phi, self.slot_precision)
        else:
            query = self.q(h_root)
        if self.kv_edge is not None and e_feat is not None:
            e = slot_linear(self.kv_edge, e_feat, self.slot_precision)
            edge = e if edge is None else edge + e
        if edge is not None:
            k_V, v_V = k_V + edge, v_V + edge
        k_V, v_V = k_V.view(-1, h, d), v_V.view(-1, h, d)
        row, slot = block.valid_rows, block.valid_index  # per valid slot (row-major, like h_nbr)
        q_V = gather_rows(query.view(r, h, d), row)
        score_V = (q_V * k_V).sum(-1) / d**0.5  # [V, H]
        # softmax over each root's valid slots, laid out densely only as [R, K, H] scores
        fill = torch.finfo(score_V.dtype).min
        score = score_V.new_full((r * k, h), fill).index_copy(0, slot, score_V)
        attn_V = torch.softmax(score.view(r, k, h), 1).view(r * k, h).index_select(0, slot)
        agg = v_V.new_zeros(r, h, d).index_add(0, row, attn_V.unsqueeze(-1) * v_V).view(r, -1)
        return self.norm(self.merge(torch.cat([agg, h_root], -1)))

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Node parts of keys and values of states `h` [n, Din]: ([n, out], [n, out])."""
        return self.key(h), self.value(h)


class MeanAggregator(nn.Module):
    """GraphSAGE mean aggregator: W [h_root || mean of valid neighbours]."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * in_dim, out_dim)

    def forward(self, h_root: torch.Tensor, h_nbr: torch.Tensor, mask: torch.Tensor):
        slots = h_nbr.new_zeros(mask.shape + (h_nbr.shape[-1],)).index_put((mask,), h_nbr)
        count = mask.sum(1, keepdim=True).clamp(min=1).to(h_nbr.dtype)
        return self.lin(torch.cat([h_root, slots.sum(1) / count], -1))


def edge_features(rows: torch.Tensor | None, edge_dim: int, like: torch.Tensor):
    """Fetched edge-feature `rows` [n, edge_dim] as `like`'s device and dtype; None when the
    model takes none (`edge_dim` 0) or none were fetched (a stream without features)."""
    if edge_dim == 0 or rows is None:
        return None
    return rows.to(like.device, like.dtype)


def project_distinct(
    att: TemporalAttention, h0, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`att.project(h0(ids))` projecting each distinct id once: the bottom layer's neighbour
    states depend on the id alone, and a hop holds each node many times (TGAT's second hop:
    ~66k slots over a few thousand nodes on wikipedia)."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    return tuple(gather_rows(x, inv) for x in att.project(h0(uniq)))


def blocks_bottom_up(
    blocks: list[Block], h0, layer_fn, bottom_nbr_states: bool = True
) -> torch.Tensor:
    """Embeddings of blocks[0]'s roots after len(blocks) layers, computed bottom-up.

    `h0(ids)` gives layer-0 states of valid ids; `layer_fn(l, block, h_root, h_nbr)` applies
    layer l (0 is the bottom) to one block, with `h_nbr` the states of its valid neighbour
    slots in row-major order, and returns one row per root. The next hop's roots are this hop's
    roots followed by its valid neighbours, so its output splits into (roots, valid slots);
    where the sampler deduplicated the next hop's roots, the output is first expanded through
    `next_index` (one row per (node, time) pair computed, copied to each slot that holds it).
    With `bottom_nbr_states` False the bottom layer gets None for `h_nbr` (a caller that
    projects neighbour states itself skips the gather).
    """
    depth = len(blocks)
    last = blocks[-1]
    h_root = h0(last.dst_ids)
    h_nbr = h0(last.valid(last.nbr_ids)) if bottom_nbr_states else None
    for layer in range(depth):
        block = blocks[depth - 1 - layer]
        out = layer_fn(layer, block, h_root, h_nbr)
        if layer + 1 < depth:
            upper = blocks[depth - 2 - layer]
            if upper.next_index is not None:
                out = gather_rows(out, upper.next_index)
            h_root, h_nbr = out[: upper.num_roots], out[upper.num_roots :]
    return out
