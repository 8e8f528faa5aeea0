"""Recovery decisions, free of Ray: the triage of a failure, which replica a lost trainer is
rebuilt from, who copies it, and when no replica is left (`policy`); the run's recovery budget
(`budget`); lost shards promoted or rebuilt, and what a rebuild replays (`shards`); the steps
sent again after a recovery, and when a pass gives up (`steps`). The shard journal that a
rebuild replays is written by the orchestrator; `updatelog` logs trainers' steps."""

from tidegraph.recovery.policy import NoReplicaLeft, Plan, plan_trainer_recovery

__all__ = ["NoReplicaLeft", "Plan", "plan_trainer_recovery"]
