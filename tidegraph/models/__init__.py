"""Temporal GNN models in pure PyTorch over the sampler's dense blocks: TGN, TGAT, DySAT-style
snapshots, JODIE, APAN, GraphMixer, DyGFormer, TPNet and a GraphSAGE baseline, with an MLP
link predictor, and EdgeBank, the memorising baseline (a job's model, `EdgeBankModel`, and
TGB's own run of it, `tidegraph.training.tgb.edgebank_tgb`); each declared by a row of
`tidegraph.models.registry`."""

from tidegraph.models.apan import APAN
from tidegraph.models.base import LinkPredictor, TemporalModel
from tidegraph.models.config import MODELS, ModelConfig, build_model
from tidegraph.models.dysat import DySAT
from tidegraph.models.edgebank import EdgeBankModel
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
    "EdgeBankModel",
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
