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

Shard actors (`cluster.shards: {min, max}`) hold whole partitions of a fixed P = max, so a
change of their number only moves partitions between actors (`plan_parts`): leaving actors
hand all theirs over, joining ones take partitions from the largest actors, and every actor
ends with P // H or P // H + 1 of them, with as few moves as that allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SCALE_RULES", "ResizeDecision", "plan_parts", "plan_resize", "scaled"]

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


def plan_parts(
    hosts: dict[int, list[int]],
    sizes: dict[int, int],
    leaving: frozenset[int] | set[int] = frozenset(),
    joining: tuple[int, ...] | list[int] = (),
) -> list[tuple[int, int, int]]:
    """Moves (partition, from host, to host) that take `hosts` {host: its partitions} (each
    partition's events in `sizes`) to the actors `hosts` minus `leaving` plus `joining` (empty
    ones), balanced to P // H or P // H + 1 partitions each. Hosts above their share give
    their largest partitions, the largest hosts (by events) first; partitions to place go
    largest first to the host with the fewest events among those below their share. [] when
    no host would be left."""
    load = lambda h: sum(sizes.get(q, 0) for q in held[h])  # noqa: E731
    stay = [h for h in hosts if h not in leaving] + [h for h in joining if h not in hosts]
    if not stay:
        return []
    held = {h: sorted(hosts.get(h, [])) for h in stay}
    total = sum(len(v) for v in hosts.values())
    share, extra = divmod(total, len(stay))
    # the hosts holding most keep one more (fewest moves); ties: the lower key
    by_count = sorted(stay, key=lambda h: (-len(held[h]), h))
    quota = {h: share + (i < extra) for i, h in enumerate(by_count)}
    pool = [(q, h) for h in hosts if h in leaving for q in hosts[h]]
    for h in sorted(stay, key=lambda h: (-load(h), h)):  # over their share: give the largest
        over = len(held[h]) - quota[h]
        if over > 0:
            give = sorted(held[h], key=lambda q: (-sizes.get(q, 0), q))[:over]
            pool += [(q, h) for q in give]
            held[h] = [q for q in held[h] if q not in give]
    moves = []
    for q, src in sorted(pool, key=lambda x: (-sizes.get(x[0], 0), x[0])):
        open_ = [h for h in stay if len(held[h]) < quota[h]]
        dst = min(open_, key=lambda h: (load(h), h))
        held[dst].append(q)
        moves.append((q, src, dst))
    return moves
