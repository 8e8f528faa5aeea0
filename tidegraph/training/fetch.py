"""The fetch stage: edge features joined to sampled blocks and recorded events before forward.

Samplers return ids; `join_edge_features` gathers every eid a step needs (the valid slots of
every block, and the events whose messages node state records) and reads them with one `get`
on the trainer's feature store, normally a `CachedFeatureStore` over a `ShardedFeatureStore`,
which sends one batched request per shard. Models then only index fetched rows.
"""

from __future__ import annotations

import torch

from tidegraph.sampling.block import Block
from tidegraph.sampling.multihop import ask_owners
from tidegraph.storage.events import EventBatch
from tidegraph.storage.features import EncodedRows, FeatureStore

__all__ = ["ShardedFeatureStore", "flat_blocks", "join_edge_features"]


class ShardedFeatureStore(FeatureStore):
    """Read-only view of edge features spread over shards: eid e lives on shard e mod P.

    `shards[p].fetch(eids)` returns the stored rows (local or remote); `num_rows` follows the
    stream and is set by whoever ingests (`set_num_rows`), so asking needs no round trip.
    With `rows_int8` (`comm.rows_int8`), shards answer int8 rows with a scale per row, which
    `get` (or the cache wrapping this store) decodes: rows cross the wire at a quarter of
    fp32's bytes, within half a step (max|row| / 254) of the stored value per element.
    """

    def __init__(
        self, shards: list, dim: int, precision: str = "fp32", gather=None, rows_int8: bool = False
    ) -> None:
        self.shards = list(shards)
        self.gather = gather or (lambda xs: xs)  # waits for remote shards' answers at once
        self.dim = dim
        self.rows_int8 = rows_int8
        self.precision = "int8" if rows_int8 else precision  # what `fetch` returns
        self._num_rows = 0
        self.requests = 0

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def set_num_rows(self, n: int) -> None:
        self._num_rows = max(self._num_rows, int(n))

    def fetch(self, ids: torch.Tensor) -> EncodedRows:
        ids = ids.cpu()
        p = len(self.shards)
        if p == 1:
            self.requests += 1
            return self.gather([self._ask(0, ids)])[0]
        ask = lambda q, idx: self._ask(q, ids.index_select(0, idx))  # noqa: E731
        answers = ask_owners(torch.remainder(ids, p), p, ask, self.gather)
        self.requests += len(answers)
        data, scale = None, None
        for idx, rows in answers:
            if data is None:
                data = rows.data.new_empty((ids.shape[0], self.dim))
                if rows.scale is not None:
                    scale = rows.scale.new_empty(ids.shape[0])
            data.index_copy_(0, idx, rows.data)
            if scale is not None:
                scale.index_copy_(0, idx, rows.scale)
        if data is None:  # no ids
            return self.gather([self._ask(0, ids)])[0]
        return EncodedRows(data, scale)

    def _ask(self, part: int, ids: torch.Tensor):
        if self.rows_int8:
            return self.shards[part].fetch(ids, int8=True)
        return self.shards[part].fetch(ids)

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        from tidegraph.storage.features import decode

        return decode(self.fetch(ids))

    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        raise TypeError("ShardedFeatureStore is read-only: shards ingest features")

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        raise TypeError("ShardedFeatureStore is read-only: shards ingest features")

    def state_dict(self) -> dict:
        return {"num_rows": self._num_rows}

    def load_state_dict(self, state: dict) -> None:
        self._num_rows = state["num_rows"]


def flat_blocks(blocks: list) -> list[Block]:
    """Blocks of every hop (and every snapshot window), in order."""
    if blocks and isinstance(blocks[0], list):
        return [b for window in blocks for b in window]
    return list(blocks)


def join_edge_features(
    store: FeatureStore | None, blocks: list, events: EventBatch | None = None
) -> EventBatch | None:
    """Set `edge_feat` of every block (valid slots, row-major) and return `events` with its
    `edge_feat` read from `store` too (stored precision, as blocks see it); one `get`."""
    if store is None:
        return events
    flat = flat_blocks(blocks)
    eids = [b.valid(b.nbr_eids) for b in flat]
    if events is not None:
        eids.append(events.eid)
    if not eids:
        return events
    # blocks are on the trainer's device, a batch's events may still be on the host
    rows = store.get(torch.cat([e.to(eids[0].device) for e in eids]))
    parts = rows.split([e.shape[0] for e in eids])
    for b, part in zip(flat, parts, strict=False):
        b.edge_feat = part
    if events is None:
        return None
    out = EventBatch(events.src, events.dst, events.t, events.eid, parts[-1], events.label)
    return out
