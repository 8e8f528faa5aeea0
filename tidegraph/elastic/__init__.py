"""Elastic scaling: trainers join and leave a running group at step boundaries."""

from tidegraph.elastic.policy import ResizeDecision, plan_resize

__all__ = ["ResizeDecision", "plan_resize"]
