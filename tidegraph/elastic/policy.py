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
ends with P // H or P // H + 1 of them, with as few moves as that allows. Which actors leave
(`plan_shard_leavers`): those on draining nodes while an actor elsewhere can take their
partitions over, then, beyond the wanted count, those in slots of their own holding fewest
partitions; when every actor is on a draining node, each partition moves instead to a
successor started off it (`partitions_to_move`).

Pending slots (`spare_slots`) are kept, one per member the run lacks toward its target, so
that Ray places them as room appears.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "SCALE_RULES",
    "ResizeDecision",
    "free_bundles",
    "partitions_to_move",
    "plan_parts",
    "plan_resize",
    "plan_shard_leavers",
    "renumber",
    "scaled",
    "spare_slots",
    "stays",
]

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
    keep = stays(world, leave, join)
    if keep is not None:
        leave.remove(keep)
        reasons.append(f"no slot ready elsewhere: trainer {keep} stays")
    if not leave and not join:
        return None
    return ResizeDecision(tuple(leave), join, "; ".join(reasons))


def stays(world: int, leave: Collection[int], join: int) -> int | None:
    """The rank that stays when ranks `leave` would leave a group of `world` members with
    nobody joining (`join`): the lowest of them, so that a group is never empty (the run
    relies on recovery when its node goes); None when some member stays anyway."""
    if join or any(w not in leave for w in range(world)):
        return None
    return min(leave)


def renumber(
    keep: Sequence[int],
    trainers: Sequence,
    members: Sequence[int],
    incarnations: Sequence[int],
    joined: Sequence[tuple[int, object]] = (),
) -> tuple[list, list[int], list[int]]:
    """(trainers, members, incarnations) by new rank after a resize: ranks `keep`, in their
    order, become ranks 0, 1, ...; then the `joined` (member, trainer), none replaced yet."""
    return (
        [trainers[w] for w in keep] + [t for _, t in joined],
        [members[w] for w in keep] + [m for m, _ in joined],
        [incarnations[w] for w in keep] + [0] * len(joined),
    )


def spare_slots(target: int, have: int, starting: int = 0, spares: int = 0) -> int:
    """Pending slots to keep: one per member that `have` members and `starting` ones lack
    toward `target`, and `spares` more (trainers kept idle for a quick replacement)."""
    return max(0, target - have - starting) + spares


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


def plan_shard_leavers(hosts: Mapping, draining: Collection, target: int) -> tuple[tuple, int]:
    """(shard actors that hand their partitions over now, how many of them for draining)
    of `hosts` {actor: (its node, whether its slot is a reserved bundle of the shards' group,
    partitions it holds)}, in the order they took their first partition, with nodes
    `draining` and `target` actors wanted: those on draining nodes, unless every actor is on
    one (`partitions_to_move` then), then beyond the target those in slots of their own
    first (reserved bundles stay taken), holding fewest partitions, the earliest first."""
    leave = [key for key, (node, _, _) in hosts.items() if node in draining]
    if len(leave) == len(hosts):  # nowhere to go
        leave = []
    drained = len(leave)
    stay = [key for key in hosts if key not in leave]
    extra = len(stay) - target
    if extra > 0:
        order = sorted(stay, key=lambda k: (hosts[k][1], hosts[k][2]))
        leave += order[:extra]
    return tuple(leave), drained


def partitions_to_move(
    nodes: Sequence, draining: Collection, wanted: Collection[int]
) -> tuple[int, ...]:
    """Partitions that need a successor shard (started off draining nodes) to move to, with
    partition p's shard on `nodes[p]`: those an operator asked to move (`wanted`), and those
    on draining nodes when no shard is elsewhere to take them over."""
    elsewhere = any(n not in draining for n in nodes)
    return tuple(
        p for p, node in enumerate(nodes) if (node in draining and not elsewhere) or p in wanted
    )


def free_bundles(taken: Iterable[tuple], group, size: int) -> tuple[int, ...]:
    """Bundles of placement group `group` (of `size` bundles) that none of the slots `taken`
    ((placement group, bundle) pairs, groups compared by identity) uses."""
    used = {b for pg, b in taken if pg is group}
    return tuple(b for b in range(size) if b not in used)
