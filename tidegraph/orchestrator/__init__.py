"""The orchestrator: the run's state machine over a group of shards and trainers."""

from tidegraph.orchestrator.backend import make_group
from tidegraph.orchestrator.controller import Orchestrator, RunState

__all__ = ["Orchestrator", "RunState", "make_group"]
