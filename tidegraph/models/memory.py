"""TGN node memory (Rossi et al. 2020) with vectorized per-batch updates.

State (buffers, so they are part of the owning model's `state_dict`):
- `memory` [N, D] and `last_update` [N] (float64 times);
- the pending raw message of each node: the other endpoint, time and edge features of the
  node's latest observed event that is not folded into its memory yet (`has_msg` [N]).

Flow per batch, as in TGN: `updated(ids)` folds each node's pending message into its memory
with the message function and the updater, differentiably and without side effects; `commit(ids,
mem, last)` writes the (detached) result back and clears those messages; `observe(src, dst, t,
feat)` stores the batch's events as the new pending messages, keeping per node only its latest
event (last-message aggregator, by a scatter-amax over event positions, so duplicates never
race). The message function is TGN's identity: [own memory, other's memory, phi(t - last
update), edge features]; the updater is TGN's GRU or JODIE's RNN. The node table grows with
`grow(n)` as the stream brings new nodes.

Compact tables (sharded node state): with `row_index` set (a callable from global node ids to
rows), the tables hold only some nodes' rows and every lookup goes through it; message sources
(`msg_other`) stay global ids. Graph shards keep their nodes' rows so, and a trainer installs
the rows a step reads (`load_compact`). `apply_*` methods take `owned` (ids -> bool) to apply
only the part of a step's updates that concerns a shard's own nodes.
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.models.base import ChangedRows, row_bits
from tidegraph.models.time_encoding import TimeEncoder
from tidegraph.ops import gather_rows, latest_rows

__all__ = ["TGNMemory"]

_CELLS = {"gru": nn.GRUCell, "rnn": nn.RNNCell}
_TABLES = ("memory", "last_update", "has_msg", "msg_other", "msg_t", "msg_feat")


class TGNMemory(nn.Module):
    """Per-node memory with a GRU (TGN) or plain RNN (JODIE) updater, identity message
    function and last aggregator."""

    def __init__(
        self, num_nodes: int, memory_dim: int, time_dim: int, edge_dim: int, cell: str = "gru"
    ) -> None:
        super().__init__()
        if cell not in _CELLS:
            raise ValueError(f"TGNMemory: cell must be one of {sorted(_CELLS)}, got {cell!r}")
        self.memory_dim = memory_dim
        self.edge_dim = edge_dim
        self.time_enc = TimeEncoder(time_dim)
        self.updater = _CELLS[cell](2 * memory_dim + time_dim + edge_dim, memory_dim)
        self.row_index = None  # None: tables are indexed by node id
        self._alloc(num_nodes)
        # rows of the tables changed since `take_changed` (None: unknown, e.g. after a load)
        self.changed = ChangedRows()

    def _r(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.row_index is None else self.row_index(ids)

    def tables(self) -> dict[str, torch.Tensor]:
        """The live node-state tables (no copies)."""
        return {k: getattr(self, k) for k in _TABLES}

    def load_compact(self, row_index, tables: dict[str, torch.Tensor]) -> None:
        """Use `tables` (rows of some nodes) through `row_index` from now on."""
        self.changed.replaced(self.tables(), tables)
        for k in _TABLES:
            setattr(self, k, tables[k])
        self.row_index = row_index

    def take_changed(self) -> torch.Tensor | None:
        """A bool mask of the table rows changed since the last call (None: unknown), for
        checkpoints that write only those rows (`storage.checkpoint.DeltaTables`)."""
        return self.changed.take(self.num_nodes, self.memory.device)

    def _alloc(self, n: int, device: torch.device | None = None) -> None:
        f64 = dict(dtype=torch.float64, device=device)
        self.register_buffer("memory", torch.zeros(n, self.memory_dim, device=device))
        self.register_buffer("last_update", torch.zeros(n, **f64))
        self.register_buffer("has_msg", torch.zeros(n, dtype=torch.bool, device=device))
        self.register_buffer("msg_other", torch.zeros(n, dtype=torch.int64, device=device))
        self.register_buffer("msg_t", torch.zeros(n, **f64))
        self.register_buffer("msg_feat", torch.zeros(n, self.edge_dim, device=device))

    @property
    def num_nodes(self) -> int:
        return int(self.memory.shape[0])

    def grow(self, num_nodes: int) -> None:
        """Extend every per-node table to `num_nodes` rows (new rows empty)."""
        extra = num_nodes - self.num_nodes
        if extra <= 0:
            return
        for name in ("memory", "last_update", "has_msg", "msg_other", "msg_t", "msg_feat"):
            old = getattr(self, name)
            pad = old.new_zeros((extra,) + tuple(old.shape[1:]))
            setattr(self, name, torch.cat([old, pad]))
        self.changed.grew(extra)

    def reset(self) -> None:
        """Empty memory and messages (start of an epoch over the stream)."""
        for name in ("memory", "last_update", "has_msg", "msg_other", "msg_t", "msg_feat"):
            getattr(self, name).zero_()
        self.changed.forget()

    # ---- per batch ------------------------------------------------------------------------

    def updated(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(memory [n, D], last update [n]) of `ids` with pending messages folded in.

        Only rows with a pending message go through the updater (one host sync on CUDA for the
        row count); the others keep their memory unchanged.
        """
        loc = self._r(ids)
        mem = gather_rows(self.memory, loc)
        last = self.last_update.index_select(0, loc)
        rows = self.has_msg.index_select(0, loc).nonzero().squeeze(1)
        sub = loc.index_select(0, rows)
        msg_t = self.msg_t.index_select(0, sub)
        own = gather_rows(mem, rows)
        parts = [
            own,
            gather_rows(self.memory, self._r(self.msg_other.index_select(0, sub))),
            self.time_enc((msg_t - last.index_select(0, rows)).float()),
        ]
        if self.edge_dim:
            parts.append(gather_rows(self.msg_feat, sub).to(mem.dtype))
        new = self.updater(torch.cat(parts, -1), own)
        return mem.index_copy(0, rows, new), last.index_copy(0, rows, msg_t)

    @torch.no_grad()
    def commit(self, ids: torch.Tensor, mem: torch.Tensor, last: torch.Tensor) -> None:
        """Write back what `updated(ids)` returned; `ids` must be unique."""
        loc = self._r(ids)
        mem = mem.detach().to(self.memory.dtype)
        mask = self.changed.mask
        if mask is not None:  # rows whose bytes change (not every row written)
            moved = self.has_msg.index_select(0, loc)
            moved |= row_bits(self.memory.index_select(0, loc)).ne(row_bits(mem)).any(1)
            moved |= row_bits(self.last_update.index_select(0, loc).unsqueeze(1)).ne(
                row_bits(last.to(self.last_update.dtype).unsqueeze(1))).any(1)  # fmt: skip
            # (no host sync: ids are distinct, each row keeps its mark or takes this one)
            mask.index_copy_(0, loc, mask.index_select(0, loc) | moved)
        self.memory.index_copy_(0, loc, mem)
        self.last_update.index_copy_(0, loc, last)
        self.has_msg.index_fill_(0, loc, False)

    @torch.no_grad()
    def observe(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        t: torch.Tensor,
        feat: torch.Tensor | None,
        owned=None,
    ) -> None:
        """Store each node's latest event of this batch (ties: the later row) as its message;
        with `owned`, only for the nodes it accepts."""
        # rows interleaved (event i -> rows 2i, 2i+1) and stably ordered by time, so that the
        # latest event of a node is the one with the highest rank, ties going to the later row
        node = torch.stack([src, dst], 1).flatten()
        other = torch.stack([dst, src], 1).flatten()
        times = t.to(torch.float64).repeat_interleave(2)
        if owned is None:
            uniq, row = latest_rows(node, times)
        else:  # a node's rows keep their order, so its latest row is the same
            keep = owned(node).nonzero().squeeze(1)
            uniq, row = latest_rows(node.index_select(0, keep), times.index_select(0, keep))
            row = keep.index_select(0, row)
        loc = self._r(uniq)
        self.changed.mark(loc)
        self.has_msg.index_fill_(0, loc, True)
        self.msg_other.index_copy_(0, loc, other.index_select(0, row))
        self.msg_t.index_copy_(0, loc, times.index_select(0, row))
        if self.edge_dim and feat is not None:
            rows = gather_rows(feat.to(self.msg_feat.dtype), row // 2)
            self.msg_feat.index_copy_(0, loc, rows)

    # ---- state ----------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the node state (not the GRU weights), for snapshots and restores."""
        names = ("memory", "last_update", "has_msg", "msg_other", "msg_t", "msg_feat")
        return {k: getattr(self, k).clone() for k in names}

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        state = {k: v.clone().to(getattr(self, k).device) for k, v in state.items()}
        self.changed.replaced(self.tables(), state)
        for k, v in state.items():
            setattr(self, k, v)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "memory"
        if key in state_dict:
            self.grow(state_dict[key].shape[0])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.changed.forget()
