"""JODIE (Kumar et al. 2019) as a memory model: no neighbour sampling, a projected memory.

Each node's memory is updated from its events by an RNN (JODIE's mutually recursive updates:
the message holds the node's own memory, the other endpoint's memory, the time since the
node's last update and the edge features; `TGNMemory` with `cell="rnn"`). A root's embedding at
time t projects its memory forward over the time since its last update,
m * (1 + w log(1 + dt)), as JODIE's projection operator does with a linear map of dt, and joins
it with the node's static embedding (JODIE's one-hot static embeddings, here a learned table,
which is the same after a linear map): z = W [projected memory, static]. JODIE standardises dt
with statistics of the whole training set; on a stream those are not known in advance, so dt
enters log-scaled instead. The model samples no neighbours (`num_layers` 0): the sampler is
built with no hops and hands it no blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.models.layers import NodeInput
from tidegraph.models.memory import TGNMemory
from tidegraph.models.tgn import MemoryModel
from tidegraph.ops import gather_rows

__all__ = ["JODIE"]


class JODIE(MemoryModel):
    num_layers = 0

    def __init__(
        self,
        num_nodes: int,
        dim: int = 100,
        memory_dim: int = 100,
        time_dim: int = 100,
        edge_dim: int = 0,
    ) -> None:
        super().__init__(dim)
        self.edge_dim = edge_dim
        self.memory = TGNMemory(num_nodes, memory_dim, time_dim, edge_dim, cell="rnn")
        self.time_proj = nn.Linear(1, memory_dim)
        nn.init.normal_(self.time_proj.weight, std=0.1)
        nn.init.zeros_(self.time_proj.bias)
        self.static = NodeInput(num_nodes, dim)
        self.out = nn.Linear(memory_dim + dim, dim)

    def embed(self, ids: torch.Tensor, ts: torch.Tensor, blocks: list) -> torch.Tensor:
        n_id, inv = torch.unique(ids, return_inverse=True)
        mem, last = self.memory.updated(n_id)
        self._stash = (n_id, mem, last)
        dt = (ts.to(last.dtype) - gather_rows(last, inv)).clamp(min=0)
        grow = self.time_proj(torch.log1p(dt).to(mem.dtype).unsqueeze(-1))
        projected = gather_rows(mem, inv) * (1 + grow)
        return self.out(torch.cat([projected, self.static(ids)], -1))

    def grow(self, num_nodes: int) -> None:
        super().grow(num_nodes)
        self.static.grow(num_nodes)
