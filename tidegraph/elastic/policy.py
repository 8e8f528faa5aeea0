"""When and how a trainer group changes size: the decisions, as pure functions.

A resize happens at a step boundary (every member holds the same whole steps, see
`recovery.policy`), so members that join copy any one of them, and members that leave take
nothing with them: with the default rule (keep the global batch) the run goes on exactly as a
fixed-size one would, up to float summation order.

What moves the size:
- members on a node that Ray drains (`ray drain-node`, a spot preemption notice) leave, all
  of them at once: the node is going away;
- an operator's wanted count (`tidegraph.jobs.resize`) sets the target, within the configured
  [min, max]; without one the target is max, so the group grows whenever Ray places another
  member (a node joined, the autoscaler added one);
- members above the target leave, highest ranks first; spare slots that Ray has placed join,
  up to the target.
A group never resizes to nothing: if every member is draining and no slot is ready, the lowest
draining rank stays (and the run relies on recovery when its node goes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SCALE_RULES", "ResizeDecision", "plan_resize", "scaled"]

SCALE_RULES = ("keep_batch", "linear", "sqrt")


@dataclass(frozen=True)
class ResizeDecision:
    """Ranks that leave, how many ready slots get a new member, and why (for logs)."""

    leave: tuple[int, ...]
    join: int
    reason: str

    def size(self, world: int) -> int:
        return world - len(self.leave) + self.join


def plan_resize(
    world: int, target: int, ready: int, draining: dict[int, str] | None = None
) -> ResizeDecision | None:
    """The resize of a group of `world` members toward `target` members, with `ready` spare
    slots placed and `draining` {rank: node} members on draining nodes; None: no change."""
    draining = dict(draining or {})
    leave = sorted(draining)
    reasons = []
    if leave:
        nodes = sorted(set(draining.values()))
        reasons.append(f"node {', '.join(n[:12] for n in nodes)} draining")
    stay = [w for w in range(world) if w not in draining]
    if len(stay) > target:
        extra = stay[target:]  # the highest ranks
        leave = sorted(leave + extra)
        stay = stay[:target]
        reasons.append(f"target {target} < {world} trainers")
    join = max(0, min(ready, target - len(stay)))
    if join:
        reasons.append(f"{join} slot{'s' if join > 1 else ''} placed, target {target}")
    if not stay and not join:  # never empty: the lowest draining rank stays for now
        keep = min(draining)
        leave.remove(keep)
        reasons.append(f"no slot ready elsewhere: trainer {keep} stays")
    if not leave and not join:
        return None
    return ResizeDecision(tuple(leave), join, "; ".join(reasons))


def scaled(rule: str, batch: int, lr: float, start: int, world: int) -> tuple[int, float]:
    """(global training batch, learning rate) at `world` trainers for a run configured with
    `batch` and `lr` and started at `start` trainers. "keep_batch" (the default) keeps both,
    so the run's result does not depend on its size; "linear" keeps each trainer's share of
    the batch (the global batch follows W) and scales the learning rate with it (Goyal et
    al.; DistTGL, GNNFlow); "sqrt" does the same with the square root of the ratio."""
    if rule not in SCALE_RULES:
        raise ValueError(f"cluster.scale_rule must be one of {SCALE_RULES}, got {rule!r}")
    if rule == "keep_batch" or world == start:
        return batch, lr
    ratio = world / start
    return max(1, round(batch * ratio)), lr * (ratio if rule == "linear" else math.sqrt(ratio))
