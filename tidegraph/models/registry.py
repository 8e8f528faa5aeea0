"""The model registry: one row a model, declaring what it needs from the rest of the system
and how it is built. `ModelConfig` and `RunConfig` read their defaults and checks from here,
and `build_model` builds from here; a new model is its module and a row.

A row declares:
- `layers`: its usual depth (the sampler's hops); `fixed_layers`: the only depth it takes
  (JODIE 0: no neighbours; APAN 1: the hop its mails go to; GraphMixer 1: its tokens);
- `fanout`: neighbours a hop by default (GraphMixer's K tokens: 20, as its paper);
- `snapshots`: the sampler's snapshot windows by default; `uses_snapshots`: whether it takes
  more than one (DySAT);
- `node_state`: whether it keeps state between steps (memory, mailboxes, EdgeBank's pairs),
  held replicated or, where it has node-state tables, sharded (`cluster.memory`); stateless
  models train as plain data-parallel SGD;
- `embeds`: whether `/embed` can embed a node alone (not DyGFormer and TPNet, which encode a
  pair jointly, nor EdgeBank, which looks the pair up);
- `options`: the `ModelConfig` options only some models take, that this one does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tidegraph.models.apan import APAN
from tidegraph.models.base import TemporalModel
from tidegraph.models.dygformer import DyGFormer
from tidegraph.models.dysat import DySAT
from tidegraph.models.edgebank import EdgeBankModel
from tidegraph.models.graphmixer import GraphMixer
from tidegraph.models.jodie import JODIE
from tidegraph.models.sage import GraphSAGE
from tidegraph.models.tgat import TGAT
from tidegraph.models.tgn import TGN
from tidegraph.models.tpnet import TPNet

__all__ = ["REGISTRY", "BuildArgs", "ModelSpec", "spec"]


@dataclass(frozen=True)
class BuildArgs:
    """What a model is built from besides its config: the stream's shape and the sampler's."""

    num_nodes: int
    edge_dim: int = 0
    num_snapshots: int = 1
    node_features: object = None
    node_feat_dim: int = 0
    fanouts: tuple[int, ...] = ()

    def fanout(self, default: int) -> int:
        """The sampler's first hop's fanout (`default` when built without a sampler)."""
        return self.fanouts[0] if self.fanouts else default

    @property
    def nodes(self) -> dict:
        return {"node_features": self.node_features, "node_feat_dim": self.node_feat_dim}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[object, BuildArgs], TemporalModel]  # (ModelConfig, BuildArgs) -> model
    layers: int = 1
    fixed_layers: int | None = None
    fanout: int = 10
    snapshots: int = 1
    uses_snapshots: bool = False
    node_state: bool = False
    embeds: bool = True
    options: frozenset[str] = field(default_factory=frozenset)
    why_fixed: str = ""  # why `fixed_layers`, for the error naming it


def _tgn(c, a: BuildArgs) -> TemporalModel:
    return TGN(a.num_nodes, c.dim, c.memory_dim, c.time_dim, a.edge_dim, c.num_layers, c.heads,
               static_memory=c.static_memory)  # fmt: skip


def _graphmixer(c, a: BuildArgs) -> TemporalModel:
    return GraphMixer(a.num_nodes, c.dim, c.time_dim, a.edge_dim, a.fanout(20), **a.nodes)


def _dygformer(c, a: BuildArgs) -> TemporalModel:
    length = a.fanout(31) + 1  # the node's own token, then its history
    channels = -(-50 // c.heads) * c.heads  # the paper's 50 a feature, a multiple of heads
    return DyGFormer(a.num_nodes, c.dim, c.time_dim, a.edge_dim, length, channels,
                     heads=c.heads)  # fmt: skip


def _tpnet(c, a: BuildArgs) -> TemporalModel:
    return TPNet(a.num_nodes, c.dim, c.time_dim, a.edge_dim, a.fanout(20), decay=c.walk_decay)


REGISTRY: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec("tgn", _tgn, layers=1, node_state=True, options=frozenset({"static_memory"})),
        ModelSpec("tgat", lambda c, a: TGAT(a.num_nodes, c.dim, c.time_dim, a.edge_dim,
                                            c.num_layers, c.heads, **a.nodes), layers=2),
        ModelSpec("dysat", lambda c, a: DySAT(a.num_nodes, a.num_snapshots, c.dim, c.num_layers,
                                              c.heads, **a.nodes),
                  layers=1, snapshots=3, uses_snapshots=True),
        ModelSpec("sage", lambda c, a: GraphSAGE(a.num_nodes, c.dim, c.num_layers,
                                                 a.node_features, a.node_feat_dim), layers=2),
        ModelSpec("jodie", lambda c, a: JODIE(a.num_nodes, c.dim, c.memory_dim, c.time_dim,
                                              a.edge_dim),
                  layers=0, fixed_layers=0, node_state=True, why_fixed="it samples no neighbours"),
        ModelSpec("apan", lambda c, a: APAN(a.num_nodes, c.dim, c.time_dim, a.edge_dim, c.heads),
                  layers=1, fixed_layers=1, node_state=True,
                  why_fixed="one hop of neighbours receives its mails"),
        ModelSpec("graphmixer", _graphmixer, layers=1, fixed_layers=1, fanout=20,
                  why_fixed="its tokens are one hop's most recent interactions"),
        ModelSpec("dygformer", _dygformer, layers=1, fixed_layers=1, fanout=31, embeds=False,
                  why_fixed="its sequences are one hop's most recent interactions"),
        ModelSpec("edgebank", lambda c, a: EdgeBankModel(c.edgebank_window), layers=0,
                  fixed_layers=0, node_state=True, embeds=False,
                  options=frozenset({"edgebank_window"}),
                  why_fixed="it scores a pair from its memory of pairs, no neighbours"),
        ModelSpec("tpnet", _tpnet, layers=1, fixed_layers=1, fanout=20, node_state=True,
                  embeds=False, options=frozenset({"walk_decay"}),
                  why_fixed="its tokens are one hop's most recent interactions"),
    )
}  # fmt: skip


def spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"model.name must be one of {tuple(REGISTRY)}, got {name!r}") from None
