"""What a trainer group does after losing members: the decision, as a pure function.

The step protocol makes the decision simple. A trainer changes its state only after every
collective of a step has finished for it (the update exchange, which also carries the slices'
losses, and the gradient all-reduce), so each survivor holds some number of whole steps of the
pass under way, and a survivor that finished step s holds exactly what a fault-free run holds
after step s: its all-reduce could not finish without every slice's gradient. Survivors can
differ by a step (one finished step s before a peer died, another failed inside it), never by
more, since step s + 1 needs step s's collectives from everyone.

So the group goes forward, never back: the survivor with the most finished steps is the source
(the lowest rank among equals, so the choice is deterministic); every lost rank gets a
replacement that copies it, and so does every survivor that finished fewer steps. No step is
undone, none is repeated, and no checkpoint is read. (Undoing the ahead survivor's optimizer
step would also work, but copying forward costs one state transfer the replacements need
anyway, and it is exact, where an undo of Adam is exact only to float rounding.) With no
survivor there is no replica: the run falls back to its last checkpoint.

Before the plan, the triage (`triage_recovery`): a failure with nothing lost is re-raised unless
it is the trainers' group failing (a collective, a rendezvous), lost shards are rebuilt first,
and a group that lost every trainer has no replica left.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NoReplicaLeft", "Plan", "Triage", "plan_trainer_recovery", "triage_recovery"]


class NoReplicaLeft(RuntimeError):
    """Every trainer was lost at once: the run continues from its last checkpoint."""


@dataclass(frozen=True)
class Plan:
    source: int | None  # the replica everyone copies; None: no replica left
    steps_done: int  # whole steps of the pass the group stands at
    replace: tuple[int, ...]  # lost ranks: new trainers, copies of the source
    copy_to: tuple[int, ...]  # every rank that loads the source's state (replacements too)


def plan_trainer_recovery(world: int, lost: list[int], done: dict[int, int]) -> Plan:
    """The plan for a group of `world` trainers that lost ranks `lost`; `done`: finished steps
    of the pass under way per survivor."""
    lost = sorted(set(lost))
    if any(not 0 <= w < world for w in lost):
        raise ValueError(f"lost ranks {lost} are not all in a group of {world}")
    alive = [w for w in range(world) if w not in lost]
    if sorted(done) != alive:
        raise ValueError(f"need the finished steps of every survivor {alive}, got {sorted(done)}")
    if not alive:
        return Plan(None, 0, tuple(lost), ())
    most = max(done.values())
    if most - min(done.values()) > 1:
        raise ValueError(f"survivors cannot be more than one step apart, got {done}")
    source = min(w for w in alive if done[w] == most)
    behind = [w for w in alive if done[w] < most]
    return Plan(source, most, tuple(lost), tuple(sorted(lost + behind)))


@dataclass(frozen=True)
class Triage:
    """What a recovery does after a failure, from what the probes found lost."""

    action: str  # "raise": the cause again (nothing lost); "no_replica"; "recover"
    rebuild_shards: tuple[int, ...]  # lost shards, rebuilt first (before "no_replica" too)
    world: int  # trainers in the group
    min_trainers: int
    reason: str = ""  # the error's message, for "no_replica"

    def may_shrink(self, dropped: int) -> bool:
        """Whether a lost rank may be dropped instead of waiting for its replacement's slot,
        with `dropped` ranks dropped already: the group stays above its minimum."""
        return self.world - dropped > self.min_trainers


def triage_recovery(
    lost: list[int],
    lost_shards: list[int],
    lost_replicas: list,
    group_failure: bool,
    world: int,
    min_trainers: int,
) -> Triage:
    """The triage of a failure in a group of `world` trainers (at least `min_trainers`) that
    lost ranks `lost`, partitions `lost_shards` and replicas `lost_replicas`;
    `group_failure`: the failure is the trainers' collective or rendezvous (the group is
    rebuilt even with nothing lost: a member was lost and replaced meanwhile)."""
    shards = tuple(lost_shards)
    if not lost and not lost_shards and not lost_replicas and not group_failure:
        return Triage("raise", shards, world, min_trainers)
    if len(lost) == world:
        reason = f"all {len(lost)} trainers were lost; no replica to recover from"
        return Triage("no_replica", shards, world, min_trainers, reason)
    return Triage("recover", shards, world, min_trainers)
