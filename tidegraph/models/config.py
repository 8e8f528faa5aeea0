"""Model configuration and the factory that builds a model from it.

`ModelConfig.num_layers` left at None takes the model's usual depth from its registry row
(`tidegraph.models.registry`: TGN 1, TGAT 2, DySAT 1 per snapshot, GraphSAGE 2, JODIE 0: no
neighbours, APAN 1: the neighbours its mails go to, GraphMixer 1: its tokens); the run config
checks it against the sampler's fanouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidegraph.config_check import check_fields
from tidegraph.models.base import TemporalModel
from tidegraph.models.layers import TemporalAttention
from tidegraph.models.registry import REGISTRY, BuildArgs, spec
from tidegraph.models.time_encoding import TimeEncoder
from tidegraph.models.tpnet import WALK_DECAY
from tidegraph.ops import SLOT_PRECISIONS

__all__ = ["DEFAULT_LAYERS", "MODELS", "ModelConfig", "build_model"]

MODELS = tuple(REGISTRY)
DEFAULT_LAYERS = {name: s.layers for name, s in REGISTRY.items()}


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
    # TPNet only: the time decay lambda of its walk matrices, per time unit of the stream (a
    # walk's weight is exp(-lambda x its age); 1e-6 a second halves a walk's weight in 8 days)
    walk_decay: float = WALK_DECAY
    # EdgeBank only: 0 remembers every pair seen (TGB's unlimited memory); > 0 only pairs seen
    # within that long (the stream's time units) before the latest time remembered (TGB's
    # time window: there 0.15 of the train split's span)
    edgebank_window: float = 0.0

    def __post_init__(self) -> None:
        check_fields(self, "model")
        model = spec(self.name)
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
        if self.static_memory and "static_memory" not in model.options:
            raise ValueError(
                f"model.static_memory is a TGN option (jodie has a static embedding of its "
                f"own), got model.name {self.name!r}"
            )
        if not self.walk_decay >= 0 or self.walk_decay == float("inf"):
            raise ValueError(f"model.walk_decay must be finite and >= 0, got {self.walk_decay}")
        if self.walk_decay != WALK_DECAY and "walk_decay" not in model.options:
            raise ValueError(f"model.walk_decay is a TPNet option, got model.name {self.name!r}")
        if not 0 <= self.edgebank_window < float("inf"):
            raise ValueError(
                f"model.edgebank_window must be finite and >= 0 (0: unlimited memory), got "
                f"{self.edgebank_window}"
            )
        if self.edgebank_window and "edgebank_window" not in model.options:
            raise ValueError(
                f"model.edgebank_window is an EdgeBank option, got model.name {self.name!r}"
            )
        if self.num_layers is None:
            self.num_layers = model.layers
        if model.fixed_layers is not None and self.num_layers != model.fixed_layers:
            raise ValueError(
                f"model.num_layers must be {model.fixed_layers} for {self.name} "
                f"({model.why_fixed}), got {self.num_layers}"
            )
        if model.fixed_layers != 0 and self.num_layers < 1:
            raise ValueError(f"model.num_layers must be >= 1, got {self.num_layers}")


def build_model(
    config: ModelConfig,
    num_nodes: int,
    edge_dim: int = 0,
    num_snapshots: int = 1,
    node_features=None,
    node_feat_dim: int = 0,
    fanouts=None,
) -> TemporalModel:
    """A fresh model; parameters come from torch's global generator (seed it first).
    `fanouts`: the sampler's, for models whose shape depends on them (GraphMixer's tokens)."""
    args = BuildArgs(num_nodes, edge_dim, num_snapshots, node_features, node_feat_dim,
                     tuple(fanouts or ()))  # fmt: skip
    model = spec(config.name).build(config, args)
    for module in model.modules():
        if isinstance(module, TemporalAttention):
            module.slot_precision = config.slot_precision
        if not config.time_trainable and isinstance(module, TimeEncoder):
            module.weight.requires_grad_(False)
            module.bias.requires_grad_(False)
    return model
