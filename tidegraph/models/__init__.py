"""Temporal GNN models in pure PyTorch over the sampler's dense blocks: TGN, TGAT, DySAT-style
snapshots, JODIE, APAN and a GraphSAGE baseline, with an MLP link predictor."""

from tidegraph.models.apan import APAN
from tidegraph.models.base import LinkPredictor, TemporalModel
from tidegraph.models.config import MODELS, ModelConfig, build_model
from tidegraph.models.dysat import DySAT
from tidegraph.models.jodie import JODIE
from tidegraph.models.memory import TGNMemory
from tidegraph.models.sage import GraphSAGE
from tidegraph.models.tgat import TGAT
from tidegraph.models.tgn import TGN
from tidegraph.models.time_encoding import TimeEncoder

__all__ = [
    "APAN",
    "DySAT",
    "GraphSAGE",
    "JODIE",
    "LinkPredictor",
    "MODELS",
    "ModelConfig",
    "TGAT",
    "TGN",
    "TGNMemory",
    "TemporalModel",
    "TimeEncoder",
    "build_model",
]
