"""TGN (Rossi et al. 2020): node memory + temporal graph attention over sampled neighbours.

Layer-0 node states are the memories (with pending messages folded in, differentiably) of every
node the blocks touch; `num_layers` attention layers (one by default, as in the paper) run over
the blocks bottom-up. The memory's node state lives in buffers, so `state_dict()` carries it.
`MemoryModel` holds the batch protocol (commit, discard, snapshots) that JODIE shares.
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
)
from tidegraph.models.memory import TGNMemory
from tidegraph.models.time_encoding import TimeEncoder
from tidegraph.ops import gather_rows, latest_rows
from tidegraph.storage.events import EventBatch

__all__ = ["MemoryModel", "TGN"]


class MemoryModel(TemporalModel):
    """A model whose node state is a `TGNMemory` (`self.memory`): `embed` stashes the updated
    rows it computed as `(ids, memory, last_update)`, `commit` writes them back."""

    memory: TGNMemory
    edge_dim: int = 0

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self._stash = None  # (ids, memory, last update) of the last forward pass
        self._folded: list[tuple] = []  # stashes already folded into this replica (`fold`)

    def grow(self, num_nodes: int) -> None:
        if not self.external_state:
            self.memory.grow(num_nodes)

    # ---- sharded node state -------------------------------------------------------------------

    def state_tables(self) -> dict[str, torch.Tensor]:
        return self.memory.tables()

    def load_compact_state(self, row_index, tables: dict) -> None:
        self.memory.load_compact(row_index, tables)

    def take_changed(self) -> torch.Tensor | None:
        return self.memory.take_changed()

    def return_changed(self, changed: torch.Tensor | None) -> None:
        self.memory.changed.give_back(changed)

    def extra_state_ids(self, ids: torch.Tensor, tables: dict) -> torch.Tensor | None:
        """Sources of pending messages among `ids`: their memory is read too."""
        return tables["msg_other"][tables["has_msg"]]

    def fold(self) -> None:
        """Keep the pass's rows for `take_updates` without writing them: later chunks of the
        step read the previous step's state too (as message sources as well), so chunking
        changes nothing, whatever W or the node-state placement."""
        if self._stash is not None:
            self._folded.append(self._stash)
            self._stash = None

    def take_updates(self, events: EventBatch | None) -> dict:
        """{"rows": [(ids, memory, last update)] per forward pass, "events": (src, dst, t,
        feat)}: the rows are the same function of the previous state in every slice that
        touches a node, the events become the nodes' pending messages."""
        stashes = self._folded + ([self._stash] if self._stash is not None else [])
        self._folded, self._stash = [], None
        out = {"rows": [(ids, mem.detach(), last) for ids, mem, last in stashes]}
        if events is not None and len(events):
            feat = edge_features(events.edge_feat, self.edge_dim, self.memory.memory)
            out["events"] = (events.src, events.dst, events.t, feat)
        return out

    def apply_updates(self, updates: list[dict | None], owned=None) -> None:
        updates = [u for u in updates if u is not None]
        rows = [r for u in updates for r in u["rows"]]
        if rows:
            ids, mem, last = _last_rows(rows)
            if owned is not None:
                keep = owned(ids).nonzero().squeeze(1)
                ids, mem, last = (x.index_select(0, keep) for x in (ids, mem, last))
            self.memory.commit(ids, mem, last)
        events = [u["events"] for u in updates if "events" in u]
        if not events:
            return
        src, dst, t = (torch.cat([e[i] for e in events]) for i in range(3))
        feat = None if events[0][3] is None else torch.cat([e[3] for e in events])
        self.memory.observe(src, dst, t, feat, owned)

    def discard(self) -> None:
        self._stash = None
        self._folded = []

    def reset_state(self) -> None:
        self.discard()
        self.memory.reset()

    def node_state(self) -> dict:
        return self.memory.state_tensors()

    def load_node_state(self, state: dict) -> None:
        self.discard()
        self.memory.load_state_tensors(state)


def _last_rows(rows: list[tuple]) -> tuple[torch.Tensor, ...]:
    """The (ids, memory, last update) rows of every forward pass of a step (each pass's ids
    distinct; slices in order) as one commit: per node, the row of the last pass that holds
    it, as committing the passes one after another would leave it. One batched write
    whatever the number of slices W."""
    if len(rows) == 1:
        return rows[0]
    ids, mem, last = (torch.cat([r[i] for r in rows]) for i in range(3))
    order = torch.arange(ids.shape[0], device=ids.device)
    uniq, row = latest_rows(ids, order)
    return uniq, mem.index_select(0, row), last.index_select(0, row)


class TGN(MemoryModel):
    root_dedup = True  # embeddings depend on (node, time) and blocks alone

    def __init__(
        self,
        num_nodes: int,
        dim: int = 100,
        memory_dim: int = 100,
        time_dim: int = 100,
        edge_dim: int = 0,
        num_layers: int = 1,
        heads: int = 2,
        static_memory: bool = False,
    ) -> None:
        super().__init__(dim)
        self.num_layers = num_layers
        self.edge_dim = edge_dim
        self.memory = TGNMemory(num_nodes, memory_dim, time_dim, edge_dim)
        self.time_enc = TimeEncoder(time_dim)
        self.layers = nn.ModuleList(
            TemporalAttention(memory_dim if i == 0 else dim, self.time_enc, edge_dim, dim, heads)
            for i in range(num_layers)
        )
        # static node memory: learned rows added to the memory as layer-0 states, zero at
        # first (the model starts as plain TGN); never part of the node state it commits
        self.static = NodeInput(num_nodes, memory_dim, init_scale=0.0) if static_memory else None

    def grow(self, num_nodes: int) -> None:
        super().grow(num_nodes)
        if self.static is not None:
            self.static.grow(num_nodes)

    def embed(self, ids: torch.Tensor, ts: torch.Tensor, blocks: list) -> torch.Tensor:
        # the nodes touched are the bottom hop's roots (`ids` themselves for one layer, else
        # ids and the upper hops' neighbours) and its neighbours; `unique`'s inverse gives the
        # row of each (on the CPU much faster than a `searchsorted` per lookup)
        bottom = blocks[-1]
        bottom_nbrs = bottom.valid(bottom.nbr_ids)
        n_id, inv = torch.unique(torch.cat([bottom.dst_ids, bottom_nbrs]), return_inverse=True)
        root_pos, nbr_pos = inv.split([bottom.num_roots, bottom_nbrs.shape[0]])
        mem, last = self.memory.updated(n_id)
        self._stash = (n_id, mem, last)
        if self.static is not None:
            mem = mem + self.static(n_id)

        def h0(x: torch.Tensor) -> torch.Tensor:  # called with the bottom hop's roots
            pos = root_pos if x is bottom.dst_ids else torch.searchsorted(n_id, x)
            return gather_rows(mem, pos)

        def layer(i, block, h_root, h_nbr):
            e = edge_features(block.edge_feat, self.edge_dim, h_root)
            kv_nbr = None
            if i == 0:  # project each distinct node's memory once, then gather per slot
                kv_nbr = tuple(gather_rows(x, nbr_pos) for x in self.layers[0].project(mem))
            return self.layers[i](h_root, h_nbr, block.valid(block.dt), e, block, kv_nbr)

        return blocks_bottom_up(blocks, h0, layer, bottom_nbr_states=False)
