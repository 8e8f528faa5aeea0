"""Temporal GNN models in pure PyTorch over the sampler's dense blocks: TGN, TGAT, DySAT-style
snapshots, JODIE, APAN, GraphMixer, DyGFormer, TPNet and a GraphSAGE baseline, with an MLP
link predictor; each declared by a row of `tidegraph.models.registry`. EdgeBank, the
memorising baseline, is in `tidegraph.models.edgebank` (no parameters: evaluated on TGB's
protocol by `tidegraph.training.tgb.edgebank_tgb`)."""

from tidegraph.models.apan import APAN
from tidegraph.models.base import LinkPredictor, TemporalModel
from tidegraph.models.config import MODELS, ModelConfig, build_model
from tidegraph.models.dysat import DySAT
from tidegraph.models.graphmixer import GraphMixer
from tidegraph.models.jodie import JODIE
from tidegraph.models.memory import TGNMemory
from tidegraph.models.sage import GraphSAGE
from tidegraph.models.tgat import TGAT
from tidegraph.models.tgn import TGN
from tidegraph.models.time_encoding import TimeEncoder
from tidegraph.models.tpnet import TPNet

__all__ = [
    "APAN",
    "DySAT",
    "GraphMixer",
    "GraphSAGE",
    "JODIE",
    "LinkPredictor",
    "MODELS",
    "ModelConfig",
    "TGAT",
    "TGN",
    "TGNMemory",
    "TPNet",
    "TemporalModel",
    "TimeEncoder",
    "build_model",
]
