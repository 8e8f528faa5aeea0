"""Recovery decisions, free of Ray: which replica a lost trainer is rebuilt from, who copies it,
and when no replica is left (`policy`)."""

from tidegraph.recovery.policy import NoReplicaLeft, Plan, plan_trainer_recovery

__all__ = ["NoReplicaLeft", "Plan", "plan_trainer_recovery"]
