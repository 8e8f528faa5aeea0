"""The orchestrator: the run's state machine over a group of shards and trainers."""
