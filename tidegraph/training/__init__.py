"""Continuous learning of temporal link prediction (evaluate, then retrain with replay) and the
offline 70/15/15 protocol, split into graph shards, data-parallel trainers and a schedule that
run in one process (`LocalGroup`) or on Ray actors; state_dict() on everything stateful."""

from tidegraph.training.config import (
    ContinualConfig,
    DataConfig,
    RunConfig,
    SamplerConfig,
    TrainConfig,
)
from tidegraph.training.continual import ContinualLearner
from tidegraph.training.data import Stream, load_stream
from tidegraph.training.group import LocalGroup
from tidegraph.training.metrics import average_precision, link_metrics, mrr, roc_auc
from tidegraph.training.offline import run_offline
from tidegraph.training.sampling import ImportanceReplay, NegativeSampler, UniformReplay
from tidegraph.training.schedule import increment_bounds, slice_bounds
from tidegraph.training.shard import ShardCore
from tidegraph.training.trainer import TrainerCore

__all__ = [
    "ContinualConfig",
    "ContinualLearner",
    "DataConfig",
    "ImportanceReplay",
    "LocalGroup",
    "NegativeSampler",
    "RunConfig",
    "SamplerConfig",
    "ShardCore",
    "Stream",
    "TrainConfig",
    "TrainerCore",
    "UniformReplay",
    "average_precision",
    "increment_bounds",
    "link_metrics",
    "load_stream",
    "mrr",
    "roc_auc",
    "run_offline",
    "slice_bounds",
]
