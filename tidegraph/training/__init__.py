"""Single-process continuous learning of temporal link prediction (evaluate, then retrain with
replay) and the offline 70/15/15 protocol, with state_dict() on everything stateful."""

from tidegraph.training.config import (
    ContinualConfig,
    DataConfig,
    RunConfig,
    SamplerConfig,
    TrainConfig,
)
from tidegraph.training.continual import ContinualLearner, increment_bounds
from tidegraph.training.data import Stream, load_stream
from tidegraph.training.engine import LinkEngine
from tidegraph.training.metrics import average_precision, link_metrics, mrr, roc_auc
from tidegraph.training.offline import run_offline
from tidegraph.training.sampling import ImportanceReplay, NegativeSampler, UniformReplay

__all__ = [
    "ContinualConfig",
    "ContinualLearner",
    "DataConfig",
    "ImportanceReplay",
    "LinkEngine",
    "NegativeSampler",
    "RunConfig",
    "SamplerConfig",
    "Stream",
    "TrainConfig",
    "UniformReplay",
    "average_precision",
    "increment_bounds",
    "link_metrics",
    "load_stream",
    "mrr",
    "roc_auc",
    "run_offline",
]
