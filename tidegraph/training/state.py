"""Sharded node state: graph shards own their nodes' state rows, trainers pull them per step.

With `cluster.memory = "sharded"` no trainer holds a node-state table. Each shard keeps the
rows of the nodes it owns (`ShardNodeState`: a model instance used only for its node-state
tables, compact, through a dense id -> row map) and applies, after every global step, the part
of the step's merged updates that concerns its nodes (the same `apply_updates` code as a
replica, restricted with `owned`). Before a forward pass a trainer reads the rows that pass
needs (`ShardedStateSource.read`: one request per shard; TGN and JODIE add a second, for the
memory of pending messages' sources) and installs them as compact tables. Every slice of step s
thus reads S(s-1) from the shards, and all of step s lands at the shards before step s + 1
reads: the semantics of replicated state, with state memory divided by P instead of multiplied
by W.
"""

from __future__ import annotations

import torch

from tidegraph.comm.quantize import QuantizedRows, dequantize_rows, quantize_rows
from tidegraph.sampling.multihop import ask_owners

__all__ = [
    "DenseRowIndex",
    "ShardNodeState",
    "ShardedStateSource",
    "SortedRowIndex",
    "decode_state_rows",
    "encode_state_rows",
]


class SortedRowIndex:
    """Rows of a compact table whose node ids are `ids` (sorted, distinct)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.ids, ids)


class DenseRowIndex:
    """A growing id -> row map (8 bytes per id up to the largest id added)."""

    def __init__(self) -> None:
        self.row_of = torch.empty(0, dtype=torch.int64)
        self.size = 0

    def add(self, ids: torch.Tensor) -> None:
        """Give each id without a row the next row, in order of first appearance."""
        ids = ids.cpu()
        if ids.numel() == 0:
            return
        top = int(ids.max()) + 1
        if top > self.row_of.shape[0]:
            pad = self.row_of.new_full((top - self.row_of.shape[0],), -1)
            self.row_of = torch.cat([self.row_of, pad])
        uniq, first = _first_appearance(ids)
        new = uniq[self.row_of[uniq] < 0]
        order = torch.argsort(first[self.row_of[uniq] < 0], stable=True)
        new = new[order]
        self.row_of[new] = torch.arange(self.size, self.size + new.shape[0])
        self.size += int(new.shape[0])

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        inside = ids < self.row_of.shape[0]
        rows = self.row_of[torch.where(inside, ids, 0)] if self.row_of.numel() else ids * 0 - 1
        return inside & (rows >= 0)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.row_of[ids.clamp(max=self.row_of.shape[0] - 1)] if self.row_of.numel() else ids
        bad = (ids >= self.row_of.shape[0]) | (rows < 0)
        if bool(bad.any()):
            raise KeyError(f"node {int(ids[bad][0])} has no state row on this shard")
        return rows

    def state_dict(self) -> dict:
        return {"row_of": self.row_of.clone(), "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        self.row_of = state["row_of"].clone()
        self.size = state["size"]


def _cpu(x):
    """`x` (updates: dicts, lists and tuples of tensors) with every tensor on the CPU, where
    shards keep node state."""
    if torch.is_tensor(x):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_cpu(v) for v in x)
    return x


def _first_appearance(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    uniq, inv = torch.unique(ids, return_inverse=True)
    first = torch.full_like(uniq, ids.shape[0])
    first.scatter_reduce_(0, inv, torch.arange(ids.shape[0]), reduce="amin")
    return uniq, first


class ShardNodeState:
    """A shard's node-state rows: `model` (built for no nodes) serves only its state tables."""

    def __init__(self, model) -> None:
        self.model = model
        self.index = DenseRowIndex()
        self.model.load_compact_state(self.index, self.model.state_tables())

    def add_nodes(self, ids: torch.Tensor) -> None:
        before = self.index.size
        self.index.add(ids)
        if self.index.size > before:
            self._grow(self.index.size)

    def _grow(self, rows: int) -> None:
        self.model.row_index = None  # grow pads whole tables with empty rows
        self.model.grow(rows)
        self.model.load_compact_state(self.index, self.model.state_tables())

    def read(self, ids: torch.Tensor, names: tuple[str, ...] | None = None) -> dict:
        rows = self.index(ids.cpu())
        tables = self.model.state_tables()
        return {k: v.index_select(0, rows) for k, v in tables.items() if not names or k in names}

    def apply(self, updates: list) -> None:
        self.model.apply_updates(_cpu(updates), owned=self.index.contains)

    def reset(self) -> None:
        self.model.reset_state()

    def state_dict(self) -> dict:
        tables = {k: v.clone() for k, v in self.model.state_tables().items()}
        return {"index": self.index.state_dict(), "tables": tables}

    def load_state_dict(self, state: dict) -> None:
        _check_tables(state["tables"], self.model.state_tables())
        self.index.load_state_dict(state["index"])
        tables = {k: v.clone() for k, v in state["tables"].items()}
        self.model.load_compact_state(self.index, tables)


def _check_tables(saved: dict, own: dict) -> None:
    """Saved node-state tables must be this model's (same names, same row shapes): state of
    another model configuration is refused, naming the table, before anything is replaced."""
    if set(saved) != set(own):
        raise ValueError(
            f"node state: the checkpoint holds tables {sorted(saved)}, this model "
            f"{sorted(own)} (model.name differs from the checkpoint's run)"
        )
    for name, table in saved.items():
        if tuple(table.shape[1:]) != tuple(own[name].shape[1:]):
            raise ValueError(
                f"node state {name!r}: rows of shape {tuple(table.shape[1:])} in the checkpoint, "
                f"{tuple(own[name].shape[1:])} in this model (model.dim or memory_dim differs "
                "from the checkpoint's run)"
            )


_INT8_TABLES = (torch.float32, torch.bfloat16, torch.float16)


def encode_state_rows(rows: dict) -> dict:
    """Node-state tables with every float32/16 table of rows ([N, ...], N > 0) as int8 codes
    with one scale per row of its last dimension, rounded to nearest (a function of the rows
    alone: any shard sends the same codes); other tables as they are."""
    out = {}
    for name, table in rows.items():
        if table.dtype in _INT8_TABLES and table.dim() >= 2 and table.numel():
            q = quantize_rows(table.reshape(-1, table.shape[-1]))
            out[name] = (q.values, q.scales, tuple(table.shape), table.dtype)
        else:
            out[name] = table
    return out


def decode_state_rows(rows: dict) -> dict:
    """`encode_state_rows` undone (the tables back in their shapes and dtypes)."""
    out = {}
    for name, table in rows.items():
        if isinstance(table, tuple):
            values, scales, shape, dtype = table
            table = dequantize_rows(QuantizedRows(values, scales, dtype)).reshape(shape)
        out[name] = table
    return out


class ShardedStateSource:
    """Reads node-state rows from the shards that own them (one request per shard)."""

    def __init__(self, shards: list, owner, gather=None, rows_int8: bool = False) -> None:
        """`rows_int8` (`comm.rows_int8`): shards answer float tables of rows (memory, mails)
        as int8 with a scale per row, a quarter of the bytes, decoded here."""
        self.shards = list(shards)
        self.owner = owner
        self.gather = gather or (lambda xs: xs)  # waits for remote shards' answers at once
        self.rows_int8 = rows_int8
        self.requests = 0

    def _ask(self, p: int, ids: torch.Tensor, names) -> object:
        if self.rows_int8:
            return self.shards[p].read_state(ids, names, True)
        return self.shards[p].read_state(ids, names)

    def read(self, ids: torch.Tensor, names: tuple[str, ...] | None = None) -> dict:
        decode = decode_state_rows if self.rows_int8 else (lambda rows: rows)
        if len(self.shards) == 1:
            self.requests += 1
            return decode(self.gather([self._ask(0, ids, names)])[0])
        ask = lambda p, idx: self._ask(p, ids.index_select(0, idx), names)  # noqa: E731
        answers = ask_owners(self.owner(ids), len(self.shards), ask, self.gather)
        answers = [(idx, decode(part)) for idx, part in answers]
        self.requests += len(answers)
        out: dict[str, torch.Tensor] = {}
        for idx, part in answers:
            for k, v in part.items():
                if k not in out:
                    out[k] = v.new_empty((ids.shape[0],) + tuple(v.shape[1:]))
                out[k].index_copy_(0, idx, v)
        return out

    def install(self, model, roots: torch.Tensor, blocks: list) -> None:
        """Install in `model` the compact state its forward over `blocks` reads (ids looked up
        on the CPU, tables and their index moved to the model's device)."""
        device = next(model.parameters()).device
        ids = model.state_ids(roots.to(device), blocks).cpu()
        tables = self.read(ids)
        extra = model.extra_state_ids(ids, tables)
        if extra is not None:
            extra = torch.unique(extra)
            extra = extra[~_isin_sorted(extra, ids)]
        if extra is not None and extra.numel():
            memory = self.read(extra, ("memory",))["memory"]
            all_ids, order = torch.sort(torch.cat([ids, extra]))
            full = {}
            for k, v in tables.items():
                pad = v.new_zeros((extra.shape[0],) + tuple(v.shape[1:]))
                if k == "memory":
                    pad = memory.to(v.dtype)
                full[k] = torch.cat([v, pad]).index_select(0, order)
            ids, tables = all_ids, full
        tables = {k: v.to(device) for k, v in tables.items()}
        model.load_compact_state(SortedRowIndex(ids.to(device)), tables)


def _isin_sorted(x: torch.Tensor, sorted_ids: torch.Tensor) -> torch.Tensor:
    if sorted_ids.numel() == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    pos = torch.searchsorted(sorted_ids, x).clamp(max=sorted_ids.shape[0] - 1)
    return sorted_ids[pos] == x
