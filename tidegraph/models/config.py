"""Model configuration and the factory that builds a model from it.

`ModelConfig.num_layers` left at None takes the model's usual depth (TGN 1, TGAT 2, DySAT 1
per snapshot, GraphSAGE 2, JODIE 0: no neighbours, APAN 1: the neighbours its mails go to); the
run config checks it against the sampler's fanouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidegraph.config_check import check_fields
from tidegraph.models.apan import APAN
from tidegraph.models.base import TemporalModel
from tidegraph.models.dysat import DySAT
from tidegraph.models.jodie import JODIE
from tidegraph.models.layers import TemporalAttention
from tidegraph.models.sage import GraphSAGE
from tidegraph.models.tgat import TGAT
from tidegraph.models.tgn import TGN
from tidegraph.models.time_encoding import TimeEncoder
from tidegraph.ops import SLOT_PRECISIONS

__all__ = ["MODELS", "ModelConfig", "build_model"]

MODELS = ("tgn", "tgat", "dysat", "sage", "jodie", "apan")
DEFAULT_LAYERS = {"tgn": 1, "tgat": 2, "dysat": 1, "sage": 2, "jodie": 0, "apan": 1}


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "tgn"
    dim: int = 100
    time_dim: int = 100
    memory_dim: int = 100
    heads: int = 2
    num_layers: int | None = None
    # False (default): fixed time-encoding frequencies, as GraphMixer recommends; on wikipedia it
    # gave higher AP than trainable ones and a faster TGN epoch (no backward through the
    # cosines of every neighbour slot). True: trained as in the TGN and TGAT papers.
    time_trainable: bool = False
    # precision of the attention layers' per-neighbour-slot time and edge projections, their
    # largest matrix products: "auto" multiplies them in bfloat16 on devices that do so natively
    # (CUDA Ampere+, CPUs with AVX512-BF16/AMX; faster TGN and TGAT steps, see RESULTS.md,
    # same AP), float32 elsewhere; "fp32" and "bf16" force one. With bf16 on the CPU the time
    # encodings feeding them use a cosine accurate to bf16 (`tidegraph.ops.bf16_cos_`)
    slot_precision: str = "auto"
    # TGN only: a learned table of node embeddings ("static node memory", DistTGL) added to
    # the dynamic memory as each node's layer-0 state, zero at first. On Wikipedia it raised
    # test AP / MRR at every global batch from 200 to 3,200 (benchmarks/RESULTS.md, "Scale-out",
    # item 3); its cost is nodes x memory_dim more parameters on every trainer, all-reduced
    # and stepped each step (JODIE has such a table already)
    static_memory: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "model")
        if self.name not in MODELS:
            raise ValueError(f"model.name must be one of {MODELS}, got {self.name!r}")
        for field in ("dim", "time_dim", "memory_dim", "heads"):
            if getattr(self, field) < 1:
                raise ValueError(f"model.{field} must be >= 1, got {getattr(self, field)}")
        if self.slot_precision not in SLOT_PRECISIONS:
            raise ValueError(
                f"model.slot_precision must be one of {SLOT_PRECISIONS}, "
                f"got {self.slot_precision!r}"
            )
        if self.dim % self.heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.heads")
        if self.static_memory and self.name != "tgn":
            raise ValueError(
                f"model.static_memory is a TGN option (jodie has a static embedding of its "
                f"own), got model.name {self.name!r}"
            )
        if self.num_layers is None:
            self.num_layers = DEFAULT_LAYERS[self.name]
        if self.name == "jodie" and self.num_layers != 0:
            raise ValueError(
                f"model.num_layers must be 0 for jodie (it samples no neighbours), "
                f"got {self.num_layers}"
            )
        if self.name == "apan" and self.num_layers != 1:
            raise ValueError(
                "model.num_layers must be 1 for apan (one hop of neighbours receives its mails), "
                f"got {self.num_layers}"
            )
        if self.name != "jodie" and self.num_layers < 1:
            raise ValueError(f"model.num_layers must be >= 1, got {self.num_layers}")


def build_model(
    config: ModelConfig,
    num_nodes: int,
    edge_dim: int = 0,
    num_snapshots: int = 1,
    node_features=None,
    node_feat_dim: int = 0,
) -> TemporalModel:
    """A fresh model; parameters come from torch's global generator (seed it first)."""
    c = config
    if c.name == "tgn":
        model = TGN(num_nodes, c.dim, c.memory_dim, c.time_dim, edge_dim, c.num_layers, c.heads,
                    static_memory=c.static_memory)  # fmt: skip
    elif c.name == "tgat":
        nodes = dict(node_features=node_features, node_feat_dim=node_feat_dim)
        model = TGAT(num_nodes, c.dim, c.time_dim, edge_dim, c.num_layers, c.heads, **nodes)
    elif c.name == "apan":
        model = APAN(num_nodes, c.dim, c.time_dim, edge_dim, c.heads)
    elif c.name == "jodie":
        model = JODIE(num_nodes, c.dim, c.memory_dim, c.time_dim, edge_dim)
    elif c.name == "dysat":
        nodes = dict(node_features=node_features, node_feat_dim=node_feat_dim)
        model = DySAT(num_nodes, num_snapshots, c.dim, c.num_layers, c.heads, **nodes)
    else:
        model = GraphSAGE(num_nodes, c.dim, c.num_layers, node_features, node_feat_dim)
    for module in model.modules():
        if isinstance(module, TemporalAttention):
            module.slot_precision = c.slot_precision
        if not c.time_trainable and isinstance(module, TimeEncoder):
            module.weight.requires_grad_(False)
            module.bias.requires_grad_(False)
    return model
