"""The interface every temporal link-prediction model implements, and the link predictor.

A model embeds roots (ids at times) from the sampler's blocks and scores (src, dst) pairs with
an MLP over the pair of embeddings. It reads no store: edge features arrive fetched, in
`Block.edge_feat` for sampled edges and in `EventBatch.edge_feat` for recorded events.

Models with node state (TGN memory) keep it in buffers and expose the step protocol of the
trainers (DESIGN.md, "Distributed semantics"). Every forward pass of a global step reads the
state as the previous step left it; afterwards each data-parallel replica hands over what its
passes change with `take_updates(events)` (detached tensors, `events` the ones to record: None
for replayed or evaluation-only batches), and every replica applies the updates of all slices
of the step, in slice order, with `apply_updates`. Merging per node keeps the latest event's
update (ties: the later row), so W slices give what one batch gives. `commit(events)` is both
at once for one replica; `fold()` keeps a pass's state between evaluation chunks of one step
(every chunk reads the previous step's state); `reset_state`,
`node_state` and `load_node_state` snapshot and restore it. Stateless models inherit no-ops.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tidegraph.ops import gather_rows
from tidegraph.storage.events import EventBatch

__all__ = [
    "LinkPredictor",
    "TableStateModel",
    "TemporalModel",
    "first_block",
    "link_roots",
    "pairwise_scores",
]


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
        neg = self.out(torch.relu(a.unsqueeze(1) + both[b:].view(b, q, both.shape[-1]))).squeeze(-1)
        return pos, neg


class TemporalModel(nn.Module):
    """Base class: subclasses set `num_layers`, `uses_snapshots` and implement `embed`."""

    num_layers: int = 1
    uses_snapshots: bool = False
    # `embed` is a function of each root's (node, time) and its blocks alone, so a sampler may
    # hand it each distinct (node, time) root once (`Block.root_index`, see `score`)
    root_dedup: bool = False
    # node state held elsewhere (sharded placement): `grow` leaves state tables alone and a
    # trainer installs the rows each step reads with `load_compact_state`
    external_state: bool = False

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.predictor = LinkPredictor(dim)

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

        `blocks` were sampled for roots cat(src, dst, neg_BQ.flatten()) at times t, t, t...,
        or for their distinct (node, time) pairs: then the first block's `root_index` maps
        each root to its row, and each pair is embedded once and gathered back (the same
        embeddings; the gradient of the gather sums the duplicates' rows first).
        """
        b, q = neg_BQ.shape
        z = self.embed_roots(*link_roots(src, dst, neg_BQ, t), blocks)
        z_src, z_dst, z_neg = z[:b], z[b : 2 * b], z[2 * b :].view(b, q, z.shape[-1])
        return self.predictor.pairs(z_src, z_dst, z_neg)

    def embed_roots(self, ids: torch.Tensor, ts: torch.Tensor, blocks: list) -> torch.Tensor:
        """`embed` of the roots `blocks` were sampled for, each distinct (node, time) once
        when the sampler deduplicated them (the first block's `root_index` maps each root to
        its row; the gather's gradient sums the duplicates' rows)."""
        first = first_block(blocks)
        if first is None or first.root_index is None:
            return self.embed(ids, ts, blocks)
        return gather_rows(self.embed(first.dst_ids, first.dst_ts, blocks), first.root_index)

    # ---- node state (no-ops for stateless models) -----------------------------------------

    def grow(self, num_nodes: int) -> None:
        """Make room for node ids below `num_nodes`."""

    def commit(self, events: EventBatch | None) -> None:
        """Fold the last forward pass's state in and record `events` (None: record none)."""
        self.apply_updates([self.take_updates(events)])

    def fold(self) -> None:
        """Between evaluation chunks of one step: keep the last pass's state for
        `take_updates` (written when the step's updates are applied, not before)."""

    def take_updates(self, events: EventBatch | None) -> dict | None:
        """This replica's node-state updates since the last call (detached), with `events`
        (carrying fetched `edge_feat` when the model reads edge features) to record."""
        return None

    def apply_updates(self, updates: list[dict | None], owned=None) -> None:
        """Apply the updates of every slice of one step, given in slice order; with `owned`
        (node ids -> bool), only those concerning the nodes it accepts (a shard's)."""

    # ---- sharded node state (models without node state have no tables) --------------------

    def state_tables(self) -> dict[str, torch.Tensor]:
        """Live node-state tables, one row per node (no copies)."""
        return {}

    def take_changed(self) -> torch.Tensor | None:
        """A bool mask of the rows of `state_tables` changed since the last call (None:
        unknown), for checkpoints that write only those (`storage.checkpoint.DeltaTables`)."""
        return None

    def return_changed(self, changed: torch.Tensor | None) -> None:
        """What `take_changed` gave, back (the checkpoint that took it was not written)."""

    def state_ids(self, roots: torch.Tensor, blocks: list) -> torch.Tensor:
        """Sorted distinct node ids whose state a forward pass over these blocks reads."""
        from tidegraph.training.fetch import flat_blocks

        ids = [roots] + [b.valid(b.nbr_ids) for b in flat_blocks(blocks)]
        return torch.unique(torch.cat(ids))

    def extra_state_ids(self, ids: torch.Tensor, tables: dict) -> torch.Tensor | None:
        """Further ids whose state (`memory` only) the pass reads, given `ids`' rows."""
        return None

    def load_compact_state(self, row_index, tables: dict) -> None:
        """Use `tables` (some nodes' rows) through `row_index` (ids -> rows)."""

    def discard(self) -> None:
        """Drop the last forward pass's state without folding it in (evaluation-only passes)."""

    def reset_state(self) -> None:
        """Forget all node state (start of a pass over the stream from its beginning)."""

    def node_state(self) -> dict:
        return {}

    def load_node_state(self, state: dict) -> None:
        """Restore what `node_state` returned."""


class TableStateModel(TemporalModel):
    """A model whose node state is a few tables of one row a node (`state_names`, buffers;
    `state_fill` the value of an empty row where not 0), changed after each step from the
    forward passes it queued (`_queue`): APAN's mailboxes, TPNet's walk projections. Holds
    what is the same for all such models: compact tables through `row_index` (sharded
    placement), changed rows, snapshots, growth, reset."""

    state_names: tuple[str, ...] = ()
    state_fill: dict[str, float] = {}

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.row_index = None  # compact tables (sharded node state): ids -> rows
        self.changed = ChangedRows()  # rows changed since `take_changed`
        self._queue: list[tuple] = []  # per forward pass, what its updates are made from

    def _r(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.row_index is None else self.row_index(ids)

    def _rows(self) -> int:
        return int(getattr(self, self.state_names[0]).shape[0])

    def state_tables(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.state_names}

    def load_compact_state(self, row_index, tables: dict) -> None:
        self.changed.replaced(self.state_tables(), tables)
        for name in self.state_names:
            setattr(self, name, tables[name])
        self.row_index = row_index

    def take_changed(self) -> torch.Tensor | None:
        table = getattr(self, self.state_names[0])
        return self.changed.take(table.shape[0], table.device)

    def return_changed(self, changed: torch.Tensor | None) -> None:
        self.changed.give_back(changed)

    def discard(self) -> None:
        self._queue.clear()

    def reset_state(self) -> None:
        self._queue.clear()
        for name in self.state_names:
            getattr(self, name).fill_(self.state_fill.get(name, 0))
        self.changed.forget()

    def node_state(self) -> dict:
        return {name: getattr(self, name).clone() for name in self.state_names}

    def load_node_state(self, state: dict) -> None:
        self._queue.clear()
        state = {k: v.clone().to(getattr(self, k).device) for k, v in state.items()}
        self.changed.replaced(self.state_tables(), state)
        for name, value in state.items():
            setattr(self, name, value)

    def grow(self, num_nodes: int) -> None:
        if self.external_state:
            return
        extra = num_nodes - self._rows()
        if extra <= 0:
            return
        for name in self.state_names:
            old = getattr(self, name)
            pad = old.new_full((extra,) + tuple(old.shape[1:]), self.state_fill.get(name, 0))
            setattr(self, name, torch.cat([old, pad]))
        self.changed.grew(extra)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + self.state_names[0]
        if key in state_dict:
            self.grow(state_dict[key].shape[0])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.changed.forget()


def first_block(blocks: list):
    """The first hop's block (of the newest window, with snapshots), or None (no blocks)."""
    if not blocks:
        return None
    return blocks[0][0] if isinstance(blocks[0], list) else blocks[0]


def pairwise_scores(block, b: int, q: int, chunk: int, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """`score` for models that encode each (src, dst) pair jointly: `block` was sampled for
    the roots of `link_roots` (or their distinct rows, `root_index`); `pairs(left, right)`
    gives the logits of pairs of block rows, called `chunk` pairs at a time over (src_i,
    dst_i) for i < b, then (src_i, neg_ij) row-major. Logits [b] and [b, q]."""
    row = (block.root_index if block.root_index is not None
           else torch.arange(2 * b + b * q, device=block.dst_ids.device))  # fmt: skip
    left = torch.cat([row[:b], row[:b].repeat_interleave(q)])
    right = torch.cat([row[b : 2 * b], row[2 * b :]])
    logits = torch.cat([pairs(left[lo : lo + chunk], right[lo : lo + chunk])
                        for lo in range(0, left.numel(), chunk)])  # fmt: skip
    return logits[:b], logits[b:].view(b, q)


def link_roots(
    src: torch.Tensor, dst: torch.Tensor, neg_BQ: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Roots (src, dst, negatives row-major) and their times, in the order `score` expects."""
    q = neg_BQ.shape[1]
    roots = torch.cat([src, dst, neg_BQ.flatten()])
    ts = torch.cat([t, t, t.repeat_interleave(q)])
    return roots, ts


class ChangedRows:
    """Which rows of a model's node-state tables changed since `take` (`mask`, None:
    unknown, as after a load), for checkpoints that write only those rows
    (`storage.checkpoint.DeltaTables`); TGN/JODIE memory and APAN keep one."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None

    def take(self, rows: int, device: torch.device) -> torch.Tensor | None:
        """The mask so far; tracking starts again from none changed (`rows` rows)."""
        out = self.mask
        self.mask = torch.zeros(rows, dtype=torch.bool, device=device)
        return out

    def give_back(self, taken: torch.Tensor | None) -> None:
        """What `take` gave, back (the checkpoint that took it was not written): rows past
        it were grown since and are marked."""
        if self.mask is None or taken is None:
            self.mask = None
            return
        n = min(self.mask.shape[0], taken.shape[0])
        self.mask = torch.cat([self.mask[:n] | taken[:n].to(self.mask.device), self.mask[n:]])

    def mark(self, rows: torch.Tensor) -> None:
        if self.mask is not None:
            self.mask.index_fill_(0, rows, True)

    def grew(self, extra: int) -> None:
        """`extra` rows were added at the end (changed)."""
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(extra)])

    def forget(self) -> None:
        """The tables were replaced wholesale (a load, a reset): changes unknown."""
        self.mask = None

    def replaced(self, old: dict, new: dict) -> None:
        """Tables `new` replace `old`: also the rows whose bytes differ are changed, or
        all (unknown) when a table changes shape (a restored snapshot keeps what it did not
        change)."""
        if self.mask is None:
            return
        for name, table in new.items():
            before = old[name]
            if table is before:
                continue
            if table.shape != before.shape or table.dtype != before.dtype:
                self.mask = None
                return
            if table.numel():
                differ = row_bits(before).ne(row_bits(table.to(before.device))).any(1)
                self.mask = self.mask | differ


def row_bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of each row of `t` as the widest integers that divide a row [rows, k]:
    equal rows, bit for bit (NaN, -0.0), compare equal."""
    row = math.prod(t.shape[1:]) * t.element_size()  # bytes of a row (also with no rows)
    flat = t.contiguous().view(torch.uint8).reshape(t.shape[0], row)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row and row % size == 0:
            return flat.view(dtype)
    return flat
