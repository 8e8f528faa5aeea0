"""Elastic scaling: trainers join and leave a running group at step boundaries."""

from tidegraph.elastic.policy import SCALE_RULES, ResizeDecision, plan_resize, scaled

__all__ = ["SCALE_RULES", "ResizeDecision", "plan_resize", "scaled"]
