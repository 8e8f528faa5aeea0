"""What a group does after losing shards: the decisions, as pure functions.

A lost partition with a replica left gets that replica in its place: it took every write
the shard took, so nothing is replayed (`plan_shard_recovery`). One with none is rebuilt on
another actor from the newest checkpoint's snapshot of it (or from nothing) by doing again
what changed it since (`replay_ops`): the batches ingested since, routed again with the same
feature rounding, when node state lives on the trainers; when the shards own node state, the
journal of every change since the snapshot (ingests, node-state updates, resets, loads), in
order. The journal keeps only what followed the last two states taken, so a snapshot older
than that cannot be brought forward: the run must resume from its checkpoint instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ShardRecoveryPlan", "plan_shard_recovery", "replay_ops"]


@dataclass(frozen=True)
class ShardRecoveryPlan:
    promote: tuple[int, ...]  # lost partitions whose first replica takes the shard's place
    rebuild: tuple[int, ...]  # lost partitions with no replica: rebuilt by replay


def plan_shard_recovery(lost: Sequence[int], replicas: Sequence[int]) -> ShardRecoveryPlan:
    """The plan for partitions `lost`, in their order; `replicas`: live replicas per
    partition."""
    promote = tuple(p for p in lost if replicas[p])
    return ShardRecoveryPlan(promote, tuple(p for p in lost if p not in promote))


def replay_ops(
    lost: list[int],
    snapshot: dict | None,
    start: int,
    num_ingests: int,
    journal: Sequence[tuple] | None = None,
    journal_base: int = 0,
    cause: BaseException | None = None,
) -> tuple[tuple, ...]:
    """What rebuilds partitions `lost` from `snapshot` (the checkpoint's group state, None:
    from nothing), which covers the run's first `start` of its `num_ingests` ingests: the
    ops ("ingest", k) of the later ingests; or, with node state on the shards, `journal`'s
    entries since the snapshot's position (`journal[0]` is the run's entry `journal_base`).
    Raises RuntimeError (chained to `cause`) when the journal no longer reaches back to it."""
    if journal is None:
        return tuple(("ingest", k) for k in range(start, num_ingests))
    since = 0 if snapshot is None else snapshot.get("journal_pos", -1)
    if since < journal_base:
        raise RuntimeError(
            f"shards {lost} were lost with the node state they own (cluster.memory "
            "'sharded') and no replica (cluster.shard_replicas), and the journal of "
            "node-state updates since their snapshot is gone: resume the run from "
            "its last checkpoint"
        ) from cause
    return tuple(journal[since - journal_base :])
