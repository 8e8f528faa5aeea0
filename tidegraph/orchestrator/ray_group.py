"""`RayGroup`: the shards and trainers of a run as Ray actors, with `LocalGroup`'s interface.

Placement: shards in a SPREAD placement group (one bundle of `cluster.shard_cpus` each, on
different nodes where there are several), trainers in a PACK group (one bundle of
`cluster.trainer_cpus`, and a GPU on CUDA, each). The trainers rendezvous through the
coordinator actor's store and sum gradients with an all-reduce inside the step; the driver
only routes events, hands out slices and passes each step's node-state updates (object refs,
never copied through the driver) to every trainer, or to every shard when shards hold node
state. Per trainer and step: one request per shard per hop to sample, one per shard for
features, and with sharded node state one or two per shard for state rows.

Ordering: calls from the driver to one actor run in order, so a trainer applies step s's
updates before it trains step s + 1, and the driver submits up to `pipeline_depth` steps ahead
(their losses are read later) so that preparing the next step overlaps training this one.
Shards are called by trainers too, so the driver waits for steps under way before it changes
shards (ingest), and waits for sharded node-state updates before the next step starts.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import re
import time

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from tidegraph.actors import CoordinatorActor, TrainerActor
from tidegraph.actors.shard import PartHandle, ShardHostActor
from tidegraph.actors.trainer import ALL_SLICES
from tidegraph.elastic.policy import ResizeDecision, plan_parts, plan_resize, scaled
from tidegraph.recovery.policy import NoReplicaLeft, plan_trainer_recovery
from tidegraph.rng import load_generator_state, seed_for, stream
from tidegraph.storage.events import EventBatch
from tidegraph.storage.partition import build_partitioner, partition_report
from tidegraph.training.balance import SliceBalancer
from tidegraph.training.group import check_placement, choose_memory_placement, state_row_bytes
from tidegraph.training.schedule import batch_start, train_slices
from tidegraph.training.shard import route_batch

__all__ = ["NoReplicaLeft", "PlacementTimeout", "RayGroup"]

log = logging.getLogger(__name__)


def _value_error(exc: Exception) -> str | None:
    """The message of the ValueError at the root of an actor's failure, if one is (Ray keeps
    only text: an actor that died waiting on a failed one carries that one's traceback)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.findall(r"^ValueError: (.+)$", text, re.MULTILINE)
    return found[-1] if found else None


def _own(x):
    """`x` with every tensor in it copied to its own storage: a view pickles its whole base
    (a batch sliced from the stream would ship the stream with every task)."""
    if torch.is_tensor(x):
        return x.clone()
    if isinstance(x, EventBatch):
        return EventBatch(*(None if v is None else v.clone() for v in (
            x.src, x.dst, x.t, x.eid, x.edge_feat, x.label)))  # fmt: skip
    if isinstance(x, tuple | list):
        return type(x)(_own(v) for v in x)
    return x


def _retrying(recover, cause: Exception):
    """`recover(cause)`, and again with the new failure when another actor fails during it
    (bounded: recovery spends `cluster.max_recoveries`); `cause` itself raised means there
    was nothing to recover."""
    while True:
        try:
            return recover(cause)
        except ray.exceptions.RayError as exc:
            if exc is cause:
                raise
            log.warning("another failure during recovery (%s): recovering again", exc)
            cause = exc


def _group_failure(exc: Exception) -> bool:
    """Whether `exc` is a trainer's collective or rendezvous failing (torch.distributed's
    errors, and the RuntimeError gloo raises when a peer's connection breaks)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, dist.DistError):
        return True
    return isinstance(cause, RuntimeError) and "gloo" in str(cause)


def _actor(handle):
    """The actor behind a handle (a shard's `PartHandle`: its host)."""
    return handle.actor if isinstance(handle, PartHandle) else handle


def _actor_state(actor) -> str:
    """The GCS's state of `actor` ("ALIVE", "DEAD", ...). Ray offers it publicly only through
    the dashboard's state API (not always running), so this asks the GCS table directly."""
    from ray._private import state

    return state.actors(actor_id=_actor(actor)._actor_id.hex())["State"]


def _trainer_bounds(c) -> tuple[int, int]:
    """(min, max) trainers of a run: `cluster.trainers` as an int fixes both."""
    lo = getattr(c, "min_trainers", None) or c.trainers
    hi = getattr(c, "max_trainers", None) or c.trainers
    return lo, hi


def _shard_bounds(c) -> tuple[int, int]:
    """(min, max) shard actors of a run; P = max partitions."""
    lo = getattr(c, "min_shards", None) or c.shards
    hi = getattr(c, "max_shards", None) or c.shards
    return lo, hi


def _replicas(c) -> int:
    return getattr(c, "shard_replicas", 1)


def _spares(c) -> int:
    return getattr(c, "spare_trainers", 0)


def _poll_s(c) -> float:
    return getattr(c, "elastic_poll_s", 1.0)


def _draining_nodes() -> dict[str, int]:
    """{node id: deadline in ms since the epoch, 0 for none} of the nodes Ray is draining
    (`ray drain-node`, an autoscaler's preemption notice)."""
    from ray._private import state

    return state.state.get_draining_nodes()


def _slot_table(pg) -> dict:
    """The GCS's record of a placement group (its state, the node of each bundle)."""
    from ray.util import placement_group_table

    return placement_group_table(pg)


def _slot_node(pg, bundle: int = 0) -> str | None:
    """The node bundle `bundle` of a placement group is on (None while pending)."""
    return _slot_table(pg).get("bundles_to_node_id", {}).get(bundle)


class PendingLoss:
    """The loss of a submitted step; `value()` waits for it (`settle`, if given, first: it
    recovers the group and runs the step again when a trainer was lost, and points `refs`
    at the new answers)."""

    def __init__(self, refs: list, settle=None) -> None:
        self._refs, self._value, self._settle = refs, None, settle

    def value(self) -> float:
        if self._value is None:
            if self._settle is not None:
                self._settle(self)
            self._value = float(sum(ray.get(self._refs)))
        return self._value


class PlacementTimeout(RuntimeError):
    """The cluster did not offer the resources a group needs within the wait."""


class RayGroup:
    """P shard actors and W trainer actors of one run (Ray must be initialized)."""

    placement_wait_s = 120.0  # tests set it lower
    pipeline_depth = 4  # training steps submitted ahead of the oldest unfinished one
    progress_s = 0.5  # seconds between progress reads while a pass runs
    probe_s = 10.0  # a trainer that does not answer this long after a failure is hung
    name_wait_s = 30.0  # for a lost trainer's name to be free for its replacement
    replace_wait_s = 5.0  # for a replacement's slot, before a group above its min shrinks

    def __init__(
        self, config, num_nodes: int, edge_dim: int, expected_nodes: int | None = None
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("RayGroup: call ray.init (tidegraph.orchestrator.cluster) first")
        c = config.cluster
        self.config = config
        self.num_shards, self.num_trainers = c.shards, c.trainers
        self.namespace = config.run_name or "tidegraph"
        self.partitioner = build_partitioner(c.partitioner, c.shards)
        self.feature_gen = stream(config.seed, "features")  # stored-feature rounding
        self.balancer = SliceBalancer(config.sampler.fanouts, c.rebalance_tolerance)
        row_bytes = state_row_bytes(config, edge_dim)
        expected = num_nodes if expected_nodes is None else expected_nodes
        self.memory_placement = choose_memory_placement(c, expected, row_bytes)
        self.sharded = self.memory_placement == "sharded" and row_bytes > 0
        self.num_rows = 0
        self.ingests: list[tuple] = []  # (lo, hi, feature-rounding state) of every ingest
        self.replay_source = None  # (lo, hi) -> the stream's events [lo, hi)
        # () -> the newest checkpoint's group state (its shards' states and ingests) or
        # None: a lost shard starts from its snapshot there and replays only later ingests
        self.snapshot_source = None
        self.recoveries: list[dict] = []  # one record per trainer recovery
        self._stale: set[int] = set()  # trainers whose copy of a replica is not complete
        self._stale_shards: set[int] = set()  # shards rebuilt but not yet checked
        # with node state on the shards and no replica: what changed the shards, in order
        # (ingests, node-state updates as driver-owned copies, resets, loads), since the
        # last two states taken (checkpoints); a lost shard replays it from its snapshot
        self._journal: list[tuple] = []
        self._journal_base = 0  # the position of _journal[0] in the run's journal
        self._journal_cuts: list[int] = []  # positions at the states taken
        self.recoveries_left = config.cluster.max_recoveries
        self._inflight: collections.deque[PendingLoss] = collections.deque()
        self._pending: list = []  # (seq, updates of every slice) of the last step, not sent
        self._seq = 0  # numbers the node-state updates sent to trainers (applied once each)
        self._window: collections.deque = collections.deque()  # steps not known done
        self._next_step = 0  # the trainers' step count after the steps submitted
        cuda = config.device.startswith("cuda")
        # P shards, and with `cluster.shard_replicas` r > 1 r - 1 read-only replicas of each
        # (bundle P i + p: replica i of partition p), spread over nodes as Ray can
        self.num_copies = _replicas(c)
        # shard actors (hosts): min of them in the SPREAD group, the rest up to max in slots
        # of their own that Ray places as it finds room; P = max partitions are dealt over
        # the hosts there are and move between them as hosts come and go
        self.min_shards, self.max_shards = _shard_bounds(c)
        self.shard_target = self.max_shards
        self.shard_pg = placement_group(
            [{"CPU": c.shard_cpus}] * (self.min_shards * self.num_copies), strategy="SPREAD"
        )
        self.shard_spares: list[tuple] = []  # (placement group, bundle) with no host yet
        self.shard_joiners: dict[int, tuple] = {}  # id(slot's group): (slot, actor, answer)
        self.shard_resizes: list[dict] = []  # one record per change of the host count
        self._hosts_named = itertools.count()  # shard actors started later get unique names
        self.trainer_bundle = {"CPU": c.trainer_cpus, **({"GPU": 1} if cuda else {})}
        # a placement group per trainer (a slot), up to the most trainers the run may have:
        # Ray claims a new node's resources for the pending ones as they appear
        self.min_trainers, self.max_trainers = _trainer_bounds(c)
        self.target = self.max_trainers
        # the minimum first: slots beyond it, asked for at once, could take the room the
        # shards need (Ray may place later groups first when resources free up)
        self.slots = [self._slot() for _ in range(self.min_trainers)]
        placed = self._wait_placed(self.trainer_bundle)
        extra = [self._slot() for _ in range(self.max_trainers - self.min_trainers)]
        if extra:  # those Ray places at once start with the run; the rest stay pending
            ray.wait([pg.ready() for pg in extra], num_returns=len(extra), timeout=1.0)
            placed += [pg for pg in extra if _slot_table(pg).get("state") == "CREATED"]
            self.slots += extra
        try:
            self._start(config, num_nodes, edge_dim, cuda, placed)
        except ray.exceptions.RayError as exc:  # an actor failed in its constructor
            self.shutdown()
            cause = _value_error(exc)
            if cause is not None:  # bad configuration or data: the earliest error, named
                raise ValueError(cause) from None
            raise
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config, num_nodes: int, edge_dim: int, cuda: bool, placed: list) -> None:
        c = config.cluster
        raw = config.to_dict()
        opts = dict(namespace=self.namespace, lifetime=None)
        # on the driver's node (the head, under `ray job submit`): the trainers' store and
        # the membership must not go with a worker node that is drained or lost
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.coordinator = CoordinatorActor.options(
            name="tidegraph-coordinator", scheduling_strategy=here, **opts
        ).remote()
        self._shard_args = (edge_dim, cuda)
        self.shard_successors: dict[int, tuple] = {}  # p: (slot, actor, first answer)
        self.shard_moves: list[dict] = []  # one record per shard moved to another actor
        self._wanted_moves: set[int] = set()  # partitions an operator asked to move
        self._top_up_shards()
        if self.shard_spares:  # hosts in the slots placed by now start with the run
            ray.wait([pg.ready() for pg, _ in self.shard_spares],
                     num_returns=len(self.shard_spares), timeout=1.0)  # fmt: skip
        slots = [(self.shard_pg, i) for i in range(self.min_shards)]
        slots += [slot for slot in self.shard_spares if _slot_table(slot[0]).get("state")
                  == "CREATED"]  # fmt: skip
        self.shard_spares = [x for x in self.shard_spares if all(x is not y for y in slots)]
        # partition p is held by the actor behind `shards[p]`, in bundle `shard_slots[p][1]`
        # of placement group `shard_slots[p][0]` (the shards' SPREAD group, or a slot of its
        # own); the partitions are dealt round robin over the slots placed by now
        self.shards, self.shard_slots = [None] * c.shards, [None] * c.shards
        deal = [list(range(h, c.shards, len(slots))) for h in range(len(slots))]
        for slot, parts in zip(slots, deal, strict=True):
            host = self._new_host(parts, slot, f"tidegraph-shard-{parts[0]}")
            for q in parts:
                self.shards[q], self.shard_slots[q] = PartHandle(host, q), slot
        # replicas take every write a shard takes (ingests, node state), never a read
        self.replica_slots = [[(self.shard_pg, c.shards * i + p) for i in range(1, self.num_copies)]
                              for p in range(c.shards)]  # fmt: skip
        self.replicas = [[self._new_shard(p, slot, f"tidegraph-shard-{p}-r{i + 1}")
                          for i, slot in enumerate(self.replica_slots[p])]
                         for p in range(c.shards)]  # fmt: skip
        self.replica_successors: dict[int, list] = {}  # p: [(slot, actor, first answer)]
        self._trainer_args = (raw, edge_dim, cuda)
        self.num_nodes = num_nodes
        # trainer w is member `members[w]` (its actor's name) in placement group
        # `member_slots[members[w]]`; ranks are renumbered on a resize, members are not
        self.num_trainers = self.start_trainers = len(placed)
        self.members = list(range(self.num_trainers))
        self.member_slots = dict(enumerate(placed))
        self.spares = [pg for pg in self.slots if all(pg is not q for q in placed)]
        # a trainer started in a spare slot Ray placed, while the group trains: {id(slot):
        # (member, actor, its first answer)}; it joins at a step boundary once it is up
        self.joiners: dict[int, tuple] = {}
        self.next_member = self.num_trainers
        self.incarnations = [0] * self.num_trainers  # replacements of each rank so far
        self.trainers = [self._new_trainer(w) for w in range(self.num_trainers)]
        self.generation = -1
        self.update_log: tuple = (None, 0, ())  # (directory, every, steps to replay)
        self.resizes: list[dict] = []  # one record per resize
        self._stop_asked = False  # the trainers were asked to stop after a step (a resize)
        self._next_check = 0.0  # monotonic time of the next look at the membership
        self._connect()
        ray.get([s.ping.remote() for s in self._all_copies()])
        self._top_up()  # spare trainers (`cluster.spare_trainers`) start in the background
        if _spares(c):  # their slots are placed in moments when there is room
            ray.wait([pg.ready() for pg in self.spares], num_returns=len(self.spares),
                     timeout=2.0)  # fmt: skip
        self._joiners_up(_draining_nodes())
        self._publish()
        log.info(
            "ray group up: %d shards, %d trainers (%d..%d) in namespace %r, node state %s",
            c.shards, self.num_trainers, self.min_trainers, self.max_trainers, self.namespace,
            self.memory_placement,
        )  # fmt: skip

    def _new_shard(self, p: int, slot: tuple | None = None, name: str | None = None):
        """A shard actor holding partition `p` alone, in its slot (a placement group and
        bundle index; default: the partition's); its handle for `p`."""
        slot = self.shard_slots[p] if slot is None else slot
        return PartHandle(self._new_host([p], slot, name or f"tidegraph-shard-{p}"), p)

    def _new_host(self, parts: list[int], slot: tuple, name: str):
        """A shard actor holding partitions `parts` (empty ones), in `slot`."""
        pg, bundle = slot
        return ShardHostActor.options(
            name=name, num_cpus=self.config.cluster.shard_cpus, namespace=self.namespace,
            lifetime=None, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, bundle),
        ).remote(self._runtime(min(parts, default=0)),
                 {p: self._part_args(p) for p in parts})  # fmt: skip

    def _part_args(self, p: int) -> tuple[tuple, dict]:
        """(args, kwargs) of partition `p`'s `ShardCore` (its seeds are the partition's, so
        it samples and rounds the same on any actor)."""
        config = self.config
        edge_dim, cuda = self._shard_args
        return (p, config.cluster.shards), dict(
            edge_dim=edge_dim, feature_precision=config.data.feature_precision,
            strategy=config.sampler.strategy, seed=seed_for(config.seed, "sampler", p),
            feature_seed=seed_for(config.seed, "features", p),
            graph_device=config.graph_device, pin_memory=cuda,
            state_model=self._state_model(edge_dim) if self.sharded else None,
        )  # fmt: skip

    def _slot(self):
        """A placement group for one trainer (pending until Ray finds room for it)."""
        return placement_group([self.trainer_bundle], strategy="PACK")

    def _new_trainer(
        self, w: int, num_nodes: int | None = None, member: int | None = None, world=None
    ):
        """Trainer actor of rank `w` of `world` (default: the group's size), in its member's
        placement group (`member`: a new one, whose group is in `member_slots`), with tables
        for `num_nodes` nodes (default: as many as ingested)."""
        c = self.config.cluster
        raw, edge_dim, cuda = self._trainer_args
        member = self.members[w] if member is None else member
        where = PlacementGroupSchedulingStrategy(self.member_slots[member], 0)
        incarnation = self.incarnations[w] if w < len(self.incarnations) else 0
        deadline = time.monotonic() + self.name_wait_s
        while True:
            try:
                return TrainerActor.options(
                    name=f"tidegraph-trainer-{member}", num_cpus=c.trainer_cpus,
                    num_gpus=1 if cuda else 0, namespace=self.namespace, lifetime=None,
                    scheduling_strategy=where,
                ).remote(
                    self._runtime(w), raw, w, self.num_trainers if world is None else world,
                    self.shards, self.num_nodes if num_nodes is None else num_nodes,
                    edge_dim, self.sharded, incarnation,
                )  # fmt: skip
            except ray.exceptions.ActorAlreadyExistsError:
                # a lost trainer's name is released once the GCS marks it dead: bounded wait
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def _connect(self) -> None:
        """Every trainer joins the group of a new membership generation (a fresh prefix of
        the coordinator's store)."""
        self.generation += 1
        address = ray.get(self.coordinator.address.remote())
        ray.get([t.connect.remote(address, self.generation, self.coordinator, self.progress_s)
                 for t in self.trainers])  # fmt: skip
        if self.update_log[1] or self.update_log[2]:  # rank 0 (maybe a new one) writes it
            ray.get([t.set_update_log.remote(*self.update_log) for t in self.trainers])
        self._scale()

    def _scale(self) -> None:
        """Global batch and learning rate for the group's size (`cluster.scale_rule`); new
        members copied a replica's optimizer, and every member gets the rate again."""
        c, t = self.config.cluster, self.config.train
        rule = getattr(c, "scale_rule", "keep_batch")
        self.train_batch_size, lr = scaled(rule, t.batch_size, t.lr, self.start_trainers,
                                           self.num_trainers)  # fmt: skip
        if rule != "keep_batch":
            ray.get([m.set_lr.remote(lr) for m in self.trainers])
            self.lr = lr

    def set_update_log(self, directory: str | None, every: int, replay=()) -> None:
        """Log every `every`-th training step to `directory` (`recovery.updatelog`) and
        replay the steps in `replay` from it instead of computing them."""
        self.update_log = (directory, every, tuple(replay))
        ray.get([t.set_update_log.remote(*self.update_log) for t in self.trainers])

    def replay_stats(self) -> dict:
        """Trainer 0's steps replayed from the update log (and seconds), records logged."""
        return self._robust(lambda: ray.get(self.trainers[0].replay_stats.remote()))

    def _runtime(self, rank: int) -> dict:
        c = self.config
        return {"seed": c.seed, "rank": rank, "deterministic": c.deterministic,
                "threads": c.threads}  # fmt: skip

    def _state_model(self, edge_dim: int):
        from tidegraph.models.config import build_model

        with torch.random.fork_rng(devices=[]):
            snaps = self.config.sampler.num_snapshots
            return build_model(self.config.model, 0, edge_dim, num_snapshots=snaps)

    def _wait_placed(self, trainer_bundle: dict) -> list:
        """Bounded wait for the shards' placement group and at least `min_trainers` trainer
        slots (then briefly for the rest); the slots placed, in order. The log and the error
        name what is missing."""
        c = self.config.cluster
        deadline = time.monotonic() + self.placement_wait_s
        shards = self.shard_pg.ready()
        ready = {ref: pg for pg in self.slots for ref in [pg.ready()]}
        placed: list = []
        pending = [shards, *ready]
        first = True
        while time.monotonic() < deadline:
            timeout = 0.5 if shards not in pending and len(placed) >= self.min_trainers else 5
            timeout, first = (1.0 if first else timeout), False  # say soon what is missing
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=timeout)
            placed += [ready[ref] for ref in done if ref in ready]
            if shards not in pending and len(placed) >= self.min_trainers:
                return [pg for pg in self.slots if any(pg is q for q in placed)]
            log.info(
                "waiting for resources: %d of %d..%d trainers x %s placed, %d shard actors x "
                "{CPU: %s} %s; the cluster has %s available",
                len(placed), self.min_trainers, self.max_trainers, trainer_bundle,
                self.min_shards * self.num_copies, c.shard_cpus,
                "placed" if shards not in pending else "not placed",
                ray.available_resources(),
            )  # fmt: skip
        self.shutdown()
        raise PlacementTimeout(
            f"could not place {self.min_trainers} trainers x {trainer_bundle} and "
            f"{self.min_shards * self.num_copies} shard actors x {{'CPU': {c.shard_cpus}}} "
            f"within {self.placement_wait_s:.0f} s "
            f"({len(placed)} trainers placed); available: {ray.available_resources()}"
        )

    # ---- ingest -----------------------------------------------------------------------------

    def ingest(self, events: EventBatch, num_nodes: int, span: tuple | None = None) -> None:
        """Route `events` to the shards. `span`: their [lo, hi) positions in the stream, kept
        (with the feature-rounding stream's state) so that a lost shard can be rebuilt by
        routing the same batches again (`replay_source` reads them back)."""
        self.drain()  # steps under way read the shards: they finish before shards change
        if span is not None:
            self.ingests.append((int(span[0]), int(span[1]), self.feature_gen.get_state()))
            self._note("ingest", len(self.ingests) - 1)
        pieces = route_batch(self.partitioner, events, self.config.data.feature_precision,
                             self.feature_gen)  # fmt: skip
        self.balancer.ingest(events)
        try:
            ray.get([s.ingest.remote(x) for p, x in enumerate(pieces) for s in self._copies(p)])
        except ray.exceptions.RayActorError as exc:  # survivors have it; rebuilt ones too
            self.recover(exc)
        if len(events):
            self.num_rows = max(self.num_rows, int(events.eid.max()) + 1)
        self.num_nodes = max(self.num_nodes, num_nodes)
        self._refresh(num_nodes)

    def _refresh(
        self, num_nodes: int, trainers: list | None = None, recovering: bool = False
    ) -> None:
        """Tell trainers (all, or these) what shards now hold: node count, feature rows,
        placements, and the segments same-node trainers sample in place. `recovering`: called
        by a recovery, so a failure here goes back to it (never a recovery inside one)."""
        part = None if self.partitioner.kind == "hash" else self.partitioner.state_dict()

        def tell() -> None:  # again after a recovery: growing tables twice changes nothing
            segments = ray.get([s.segment_refs.remote() for s in self.shards])
            ray.get([t.ingested.remote(num_nodes, self.num_rows, part, segments)
                     for t in (self.trainers if trainers is None else trainers)])  # fmt: skip

        if recovering:
            tell()
        else:
            self._robust(tell)

    # ---- steps ------------------------------------------------------------------------------

    def train_step(
        self, ev: EventBatch, weight: torch.Tensor | None, neg_BQ: torch.Tensor, num_observe: int
    ) -> float:
        self._resize_if_due()
        if self.sharded:
            return self._sharded_step(ev, weight, neg_BQ, num_observe)
        if not self._inflight:  # where the trainers stand (after any change of the group)
            self._next_step = self._steps()
        step = {"args": (ev, weight, neg_BQ, num_observe), "before": self._take_pending(),
                "index": self._next_step}  # fmt: skip
        self._next_step += 1
        pending = PendingLoss([], self._settle)
        step["pending"] = pending
        self._submit(step)
        self._inflight.append(pending)
        self._window.append(step)
        while len(self._inflight) > self.pipeline_depth:  # bounded lookahead
            self._inflight.popleft().value()
        return pending

    def _submit(self, step: dict) -> None:
        """Send one training step (replicated node state, a task per step) to every trainer:
        its slices, and the node-state updates of the step before (`step["before"]`); its
        own updates become pending, for the next call."""
        ev, weight, neg_BQ, num_observe = step["args"]
        cut = step.get("cut")
        if cut is None or len(cut) != self.num_trainers:  # a new size after a recovery
            bounds = self.balancer.bounds(ev, neg_BQ, self.num_trainers)
            cut = step["cut"] = [_own(args) for args in train_slices(
                ev, weight, neg_BQ, num_observe, self.num_trainers, bounds)]  # fmt: skip
        # every trainer answers (the batch's loss, every slice's updates): rank 0's go on
        step["outs"] = [t.train_and_step.options(num_returns=2).remote(*args, *step["before"])
                        for t, args in zip(self.trainers, cut, strict=True)]  # fmt: skip
        self._settled_with(step, *step["outs"][0], self._seq)
        self._flush()
        self._pending = list(step["after"])
        self._seq += 1

    def _settled_with(self, step: dict, loss, updates, seq: int) -> None:
        """The step's loss and the updates the next step carries are these refs'."""
        step["pending"]._refs = [loss]
        step["after"] = [seq, ALL_SLICES, updates]  # the next step's `before`

    def _settle(self, pending: PendingLoss) -> None:
        """Wait for the steps submitted up to `pending`. When a trainer was lost, the group
        recovers (survivors' most advanced replica copied forward, `recover`) and every step
        in the window that the trainers do not hold is sent again, in order, each with the
        updates of the step before: trainers apply a batch of updates once (numbered), so a
        survivor that applied them already skips them. The steps' results are bitwise the
        fault-free run's. A step the group holds is answered for by any member that finished
        it (each returns every slice's updates); with none left that answers, it cannot be
        completed (`NoReplicaLeft`: the orchestrator restarts from the newest checkpoint)."""
        for _ in range(self.config.cluster.max_recoveries + 1):
            upto = next((i for i, s in enumerate(self._window) if s["pending"] is pending), None)
            if upto is None:
                return
            refs = [r for s in list(self._window)[: upto + 1] for o in s["outs"] for r in o]
            try:
                ray.get(refs)
            except ray.exceptions.RayError as exc:
                if not isinstance(exc, ray.exceptions.RayActorError) and not _group_failure(exc):
                    raise
                self._redo(exc)
                continue
            for _ in range(upto + 1):  # done: their updates went with the steps after
                self._window.popleft()
            return
        raise RuntimeError("trainer recovery: the retry budget is spent")

    def _redo(self, cause: Exception) -> None:
        """Recover after `cause` and send again the steps of the window the group does not
        hold (see `_settle`)."""
        with contextlib.suppress(type(cause)):  # another call met the loss and recovered
            self.recover(cause)
        done = self._steps()
        window = list(self._window)
        for step in window:
            if step["index"] < done:  # the group holds it: any member's answer is all of it
                for loss, updates in step["outs"]:
                    with contextlib.suppress(ray.exceptions.RayError):
                        ray.get([loss, updates])
                        self._settled_with(step, loss, updates, step["after"][0])
                        step["outs"] = [(loss, updates)]  # the lost member's are not waited for
                        break
                else:
                    raise NoReplicaLeft("no trainer that finished a step answered for it")
                continue
            previous = next((s for s in window if s["index"] == step["index"] - 1), None)
            if previous is not None:  # the step before was sent again, too
                step["before"] = previous["after"]
            self._pending = []  # each step carries the updates before it
            self._submit(step)
        log.warning("step recovery: %d steps of the window sent again from step %d",
                    sum(s["index"] >= done for s in window), done)  # fmt: skip

    def _sharded_step(self, ev, weight, neg_BQ, num_observe: int) -> PendingLoss:
        """A training step with node state on the shards (a task per step), recovered when
        a trainer or shard is lost: trainers change nothing until every collective of the
        step finished, so after a recovery the group either holds the step (a member was
        lost after the all-reduce: survivors stepped and replacements copy one) or not (it
        is run again); a shard copy lost while applying the step's updates is replaced by
        a replica, which applied them too (`cluster.shard_replicas`)."""
        for _ in range(self.config.cluster.max_recoveries + 1):
            steps = self._steps()
            bounds = self.balancer.bounds(ev, neg_BQ, self.num_trainers)
            slices = train_slices(ev, weight, neg_BQ, num_observe, self.num_trainers, bounds)
            outs = [t.train_and_step.options(num_returns=2).remote(*_own(args))
                    for t, args in zip(self.trainers, slices, strict=True)]  # fmt: skip
            try:
                ray.get([o[0] for o in outs])
            except ray.exceptions.RayError as exc:
                self.recover(exc)
                if self._steps() == steps:
                    continue  # nobody stepped: run the step again on the rebuilt group
                raise NoReplicaLeft(  # the orchestrator restarts from the newest checkpoint
                    "a trainer was lost after its group's all-reduce, with its slice's "
                    "node-state updates for the shards: the step cannot be completed"
                ) from exc
            try:
                self._apply_state([o[1] for o in outs])
            except ray.exceptions.RayError as exc:
                self.recover(exc)  # every copy was sent the updates; a replica takes over
            pending = PendingLoss([o[0] for o in outs])
            pending.value()
            return pending
        raise RuntimeError("trainer recovery: the retry budget is spent")

    def _steps(self) -> int:
        return self._robust(lambda: ray.get(self.trainers[0].call.remote("__getattribute__",
                                                                         "steps")))  # fmt: skip

    @property
    def runs_passes(self) -> bool:
        """Whole passes per task: with replicated node state, trainers exchange each step's
        updates among themselves (sharded state goes through the shards, step by step)."""
        return self.config.cluster.whole_passes and not self.sharded

    def train_pass(self, batches: list, progress=None) -> list[float]:
        """Every step of a training pass in one task per trainer; the steps' losses.
        `batches`: (events, weights, negatives, new events) per step; `progress(steps)` is
        called with the steps finished while the pass runs. A trainer lost midway is
        replaced from a survivor and the pass goes on from the survivors' last whole step
        (`recover`)."""

        def cut(batches: list) -> list:  # each trainer's slices of these batches
            per_trainer = [[] for _ in self.trainers]
            for ev, weight, neg, num_observe in batches:
                bounds = self.balancer.bounds(ev, neg, self.num_trainers)
                slices = train_slices(ev, weight, neg, num_observe, self.num_trainers, bounds)
                for w, args in enumerate(slices):
                    per_trainer[w].append(_own(args))
            return per_trainer

        return self._pass("train_pass", batches, cut, (), progress)

    def eval_pass(self, batches: list, observe: bool, progress=None) -> list:
        """Scores of every batch of an evaluation pass, one task per trainer."""

        def cut(batches: list) -> list:
            per_trainer = [[] for _ in self.trainers]
            for ev, neg in batches:
                for w, (lo, hi) in enumerate(self.balancer.bounds(ev, neg, self.num_trainers)):
                    per_trainer[w].append(_own((ev.select(slice(lo, hi)), neg[lo:hi])))
            return per_trainer

        return self._pass("eval_pass", batches, cut, (observe,), progress)

    def _pass(self, method: str, batches: list, cut, args: tuple, progress) -> list:
        """Run a pass (`method` of every trainer, with its slices of every batch, as
        `cut(batches)` gives them); rank 0's results, recovering from lost trainers as often
        as it takes, and resizing the group when asked to (the trainers stop after a step,
        and the rest of the pass is cut anew for the new group)."""
        self.drain()
        if not batches:
            return []
        self._resize_if_due(force=True, at=f"before a {method} of {len(batches)} steps")
        before = self._take_pending()
        results: list = []
        stalled = 0  # recoveries in a row after which the pass got no further
        while len(results) < len(batches):
            done = len(results)
            ray.get([self.coordinator.report.remote(0),
                     self.coordinator.request_stop.remote(False)])  # fmt: skip
            self._stop_asked = False
            per_trainer = cut(batches[done:])
            refs = [getattr(t, method).remote(s, *args, *before)
                    for t, s in zip(self.trainers, per_trainer, strict=True)]  # fmt: skip
            before = []  # applied by every survivor; a replacement copies one
            shifted = None if progress is None else (lambda n, d=done: progress(d + n))
            try:
                results += self._wait_pass(refs, shifted)[0]
            except ray.exceptions.RayError as exc:
                results += self.recover(exc)
                stalled = stalled + 1 if len(results) == done else 0
                if stalled >= 3:
                    raise RuntimeError(
                        f"trainers keep failing at step {done} of a {method} of "
                        f"{len(batches)} steps ({stalled} recoveries without progress); "
                        f"last lost: {self.recoveries[-1]['lost']}"
                    ) from exc
                continue
            if len(results) < len(batches):  # stopped early: resize, then go on
                self._resize_if_due(True, f"{method} step {len(results)} of {len(batches)}")
        return results

    # ---- elasticity ---------------------------------------------------------------------------

    def _plan(self, force: bool = False) -> tuple:
        """What the group should change now, looked at every `cluster.elastic_poll_s` (or
        now, `force`): the trainers' resize (`elastic.policy`: an operator's wanted count,
        trainers on draining nodes, spare slots Ray placed) and the partitions whose shard
        should move to the successor started for it (its node is draining, or an operator
        asked), once that successor is up, and the partitions with a new replica up; and the
        shard actors' change: (hosts up to join, hosts to leave, why) or None."""
        now = time.monotonic()
        if not force and now < self._next_check:
            return None, [], [], None
        self._next_check = now + _poll_s(self.config.cluster)
        wanted, moves, shards = ray.get([self.coordinator.take_wanted.remote(),
                                         self.coordinator.take_moves.remote(),
                                         self.coordinator.take_wanted_shards.remote()])  # fmt: skip
        if shards is not None and shards[0] != self.shard_target:
            log.info("%s wants %d shard actors (now %d)", shards[1], shards[0],
                     len(self._shard_hosts()))  # fmt: skip
            self.shard_target = shards[0]
            self._top_up_shards()
        bad = [p for p in moves if not 0 <= p < self.num_shards]
        if bad:
            log.warning("asked to move shards %s: there are shards 0..%d only", bad,
                        self.num_shards - 1)  # fmt: skip
        self._wanted_moves.update(p for p in moves if 0 <= p < self.num_shards)
        if wanted is not None and wanted[0] != self.target:
            log.info("%s wants %d trainers (now %d)", wanted[1], wanted[0], self.num_trainers)
            self.target = wanted[0]
            self._top_up()
        draining = _draining_nodes()
        ranks = {w: n for w, n in enumerate(self._member_nodes()) if n in draining}
        leaving, drained = self._shard_leavers(draining)
        joining = self._shard_joiners_up(draining)
        moves = self._successors_up(draining)
        decision = plan_resize(self.num_trainers, self.target, len(self._joiners_up(draining)),
                               ranks)  # fmt: skip
        reshard = None
        if leaving or joining:
            why = [f"{len(joining)} shard actor{'s' if len(joining) > 1 else ''} up"] if joining \
                else []  # fmt: skip
            if drained:
                why.append(f"{drained} on draining nodes")
            if len(leaving) > drained:
                why.append(f"target {self.shard_target} shard actors")
            reshard = (joining, leaving, "; ".join(why))
        return decision, moves, self._replicas_up(), reshard

    def _resize_if_due(self, force: bool = False, at: str = "between steps") -> None:
        """Resize and move shards now if the group should (at a step boundary, `at`:
        nothing is under way)."""
        decision, moves, adds, reshard = self._plan(force or self._stop_asked)
        self._stop_asked = False
        try:
            for p in adds:
                self._add_replicas(p)
            for p in moves:
                self._move_shard(p, at)
            if reshard is not None:
                self._reshard(*reshard, at)
            if decision is not None:
                self._resize(decision, at)
        except ray.exceptions.RayError as exc:  # a member lost meanwhile: recover instead
            self.recover(exc)

    # ---- shards moving between nodes ----------------------------------------------------------

    def move_shard(self, p: int, wait_s: float = 120.0) -> None:
        """Move partition `p` to a new shard actor wherever Ray has room (an operator's
        move; a draining node's shards move by themselves): its successor starts, copies
        the shard's state at a step boundary and takes its place."""
        self._wanted_moves.add(p)
        deadline = time.monotonic() + wait_s
        while p in self._wanted_moves:
            self.drain()
            self._resize_if_due(force=True, at="an operator's shard move")
            if time.monotonic() > deadline:
                raise PlacementTimeout(f"shard {p}: no successor up within {wait_s:.0f} s")
            time.sleep(0.01)

    def _copies(self, p: int) -> list:
        """Partition `p`'s shard and its replicas (every write goes to all of them)."""
        return [self.shards[p], *self.replicas[p]]

    def _all_copies(self) -> list:
        return [s for p in range(self.num_shards) for s in self._copies(p)]

    def _probe_replicas(self) -> list[tuple[int, int]]:
        """Replicas (partition, index) that are dead or do not answer within `probe_s`;
        they are dropped, and a successor for each starts in the background."""
        refs = [(p, i, r.ping.remote()) for p, reps in enumerate(self.replicas)
                for i, r in enumerate(reps)]  # fmt: skip
        ready, _ = ray.wait([x[2] for x in refs], num_returns=len(refs), timeout=self.probe_s)
        lost = []
        for p, i, ref in refs:
            try:
                if ref not in ready:
                    raise TimeoutError
                ray.get(ref)
            except (ray.exceptions.RayActorError, TimeoutError):
                lost.append((p, i))
        for p, i in sorted(lost, reverse=True):
            ray.kill(_actor(self.replicas[p].pop(i)))
            self.replica_slots[p].pop(i)
        for p in sorted({p for p, _ in lost}):
            self._start_replicas(p)
        return lost

    def _start_replicas(self, p: int) -> None:
        """Start successors so that partition `p` gets back to `shard_replicas` copies; each
        copies the shard at a step boundary once it is up (`_add_replicas`)."""
        wanted = self.num_copies - 1 - len(self.replicas[p])
        starting = self.replica_successors.setdefault(p, [])
        while len(starting) < wanted:
            slot = placement_group([{"CPU": self.config.cluster.shard_cpus}])
            serial = len(self.shard_moves) + sum(map(len, self.replica_successors.values()))
            name = f"tidegraph-shard-{p}-r{self.recoveries_left}-{serial}"
            actor = self._new_shard(p, (slot, 0), name=name)
            starting.append((slot, actor, actor.ping.remote()))
            log.info("shard %d: starting a replica to get back to %d copies", p,
                     self.num_copies)  # fmt: skip

    def _replicas_up(self) -> list[int]:
        """Partitions with a replica successor up (to be added at a step boundary)."""
        up = []
        for p, starting in self.replica_successors.items():
            refs = [x[2] for x in starting]
            if refs and ray.wait(refs, num_returns=1, timeout=0)[0]:
                up.append(p)
        return up

    def _add_replicas(self, p: int) -> None:
        """Replica successors of `p` that are up copy the shard (at a step boundary) and
        take writes from now on; one that failed to start is dropped and started again."""
        self.drain()
        self._flush()
        starting, keep = self.replica_successors.get(p, []), []
        for slot, actor, ref in starting:
            if not ray.wait([ref], timeout=0)[0]:
                keep.append((slot, actor, ref))
                continue
            try:
                ray.get(ref)
                ray.get(actor.load_state_dict.remote(self.shards[p].state_dict.remote()))
                held, had = ray.get([actor.report.remote(), self.shards[p].report.remote()])
                if held["events"] != had["events"]:
                    raise RuntimeError(f"replica of shard {p} holds {held['events']} events, "
                                       f"the shard {had['events']}")  # fmt: skip
            except ray.exceptions.RayActorError as exc:
                log.warning("a replica of shard %d failed to start (%s)", p, exc)
                ray.kill(_actor(actor))
                with contextlib.suppress(Exception):
                    remove_placement_group(slot)
                continue
            self.replicas[p].append(actor)
            self.replica_slots[p].append((slot, 0))
            log.info("shard %d: replica added (%d events); %d copies", p, held["events"],
                     1 + len(self.replicas[p]))  # fmt: skip
        self.replica_successors[p] = keep
        self._start_replicas(p)

    def _shard_nodes(self) -> list:
        """Node id of each partition's shard (from its slot, in the GCS)."""
        return [_slot_node(pg, i) for pg, i in self.shard_slots]

    def _successors_up(self, draining) -> list[int]:
        """Partitions whose successor shard is up. Starts a successor (in a slot of its own,
        which Ray places off draining nodes) for each partition on a draining node or asked
        to move; a successor that failed is dropped (and started again at the next look)."""
        up = []
        nodes = self._shard_nodes()
        elsewhere = any(n not in draining for n in nodes)  # hosts there take them over
        for p, node in enumerate(nodes):
            if (node not in draining or elsewhere) and p not in self._wanted_moves:
                continue
            successor = self.shard_successors.get(p)
            if successor is None:
                slot = placement_group([{"CPU": self.config.cluster.shard_cpus}])
                serial = len(self.shard_moves) + len(self.shard_successors) + 1
                actor = self._new_shard(p, (slot, 0), name=f"tidegraph-shard-{p}-{serial}")
                self.shard_successors[p] = (slot, actor, actor.ping.remote())
                log.info("shard %d on node %s: starting its successor to move to", p, node)
                continue
            if ray.wait([successor[2]], timeout=0)[0]:
                try:
                    ray.get(successor[2])
                    up.append(p)
                except ray.exceptions.RayError as exc:
                    log.warning("shard %d's successor failed to start (%s)", p, exc)
                    self._drop_successor(p)
        return up

    def _drop_successor(self, p: int) -> None:
        slot, actor, _ = self.shard_successors.pop(p)
        ray.kill(_actor(actor))
        with contextlib.suppress(Exception):
            remove_placement_group(slot)

    def _move_shard(self, p: int, at: str) -> None:
        """Partition `p` to its successor, at a step boundary: the successor copies the
        shard's state (events, features, sampler, node state it owns) and must hold as many
        events; trainers then send it their requests, and the old shard goes."""
        t0 = time.perf_counter()
        self.drain()
        self._flush()
        slot, new, _ = self.shard_successors[p]
        old = self.shards[p]
        ray.get(new.load_state_dict.remote(old.state_dict.remote()))
        held, had = ray.get([new.report.remote(), old.report.remote()])
        if held["events"] != had["events"]:
            self._drop_successor(p)
            raise RuntimeError(f"shard {p}'s successor holds {held['events']} events, the "
                               f"shard {had['events']}")  # fmt: skip
        del self.shard_successors[p]
        nodes = self._shard_nodes()
        old_slot, self.shard_slots[p] = self.shard_slots[p], (slot, 0)
        self.shards[p] = new
        self._point_trainers([p])
        self._refresh(self.num_nodes, recovering=True)
        self._release(old, old_slot)
        self._wanted_moves.discard(p)
        event = {"part": p, "from_node": nodes[p], "to_node": self._shard_nodes()[p],
                 "events": held["events"], "at": at, "seconds": time.perf_counter() - t0,
                 "time": time.time()}  # fmt: skip
        self.shard_moves.append(event)
        self._publish()
        log.warning("shard %d moved at %s from node %s to %s (%d events); %.2f s", p, at,
                    str(event["from_node"])[:12], str(event["to_node"])[:12], held["events"],
                    event["seconds"])  # fmt: skip

    def _point_trainers(self, parts: list[int], trainers: list | None = None) -> None:
        """Trainers (all, or these; joiners too) send partitions `parts`' requests to the
        shards' handles now."""
        members = self.trainers if trainers is None else trainers
        ray.get([t.replace_shard.remote(p, self.shards[p]) for t in members for p in parts])
        if trainers is None:
            for _, actor, _ in self.joiners.values():  # queued behind their constructors
                for p in parts:
                    actor.replace_shard.remote(p, self.shards[p])

    def _release(self, old: PartHandle, slot: tuple) -> None:
        """Partition `old.part` left host `old.actor`: a host left with none goes, and its
        slot with it (a bundle of the shards' SPREAD group stays reserved)."""
        try:
            left = ray.get(old.actor.drop_part.remote(old.part))
        except ray.exceptions.RayActorError:
            left = []
        if not left:
            self._release_host(old.actor, slot)

    # ---- elastic shard counts -----------------------------------------------------------------

    def _shard_hosts(self) -> dict[str, tuple]:
        """{host actor id: (actor, slot, its partitions)} of the partitions' shards."""
        hosts: dict[str, tuple] = {}
        for p, handle in enumerate(self.shards):
            key = handle.actor._actor_id.hex()
            hosts.setdefault(key, (handle.actor, self.shard_slots[p], []))[2].append(p)
        return hosts

    def resize_shards(self, count: int, who: str = "operator") -> None:
        """Set the wanted number of shard actors (within [min, max] shards) and change it
        as far as Ray has room now (fewer: at once; more: as their slots are placed)."""
        if not self.min_shards <= count <= self.max_shards:
            raise ValueError(f"shards must be within cluster min/max [{self.min_shards}, "
                             f"{self.max_shards}], got {count}")  # fmt: skip
        ray.get(self.coordinator.want_shards.remote(count, who))
        self.drain()
        self._resize_if_due(force=True)

    def _top_up_shards(self) -> None:
        """Keep a pending slot per shard actor the run lacks toward its target (Ray places
        them as room appears, and a host starts in each); drop those beyond it. Before the
        first actors start, the run has its minimum in the SPREAD group."""
        started = bool(getattr(self, "shards", None))
        have = len(self._shard_hosts()) if started else self.min_shards
        want = max(0, self.shard_target - have - len(self.shard_joiners))
        free = self._free_bundles() if started else []
        while len(self.shard_spares) < want:  # bundles of the SPREAD group no actor uses first
            slot = (self.shard_pg, free.pop(0)) if free else \
                (placement_group([{"CPU": self.config.cluster.shard_cpus}]), 0)  # fmt: skip
            self.shard_spares.append(slot)
        while len(self.shard_spares) > want:
            pg, _ = self.shard_spares.pop()
            if pg is not self.shard_pg:  # a bundle of the SPREAD group stays reserved
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)

    def _free_bundles(self) -> list[int]:
        """Bundles of the shards' SPREAD group that hold no shard actor, replica, spare slot
        or starting actor (an actor that left gave its bundle back to the run)."""
        taken = [*self.shard_slots, *(x for slots in self.replica_slots for x in slots),
                 *self.shard_spares, *(j[0] for j in self.shard_joiners.values())]  # fmt: skip
        used = {b for pg, b in taken if pg is self.shard_pg}
        return [b for b in range(self.min_shards * self.num_copies) if b not in used]

    def _shard_joiners_up(self, draining) -> list[tuple]:
        """Hosts started in spare shard slots that are up (to take partitions over at a
        step boundary). Starts one in each slot Ray placed; drops ones that failed."""
        for slot in list(self.shard_spares):
            table = _slot_table(slot[0])
            node = table.get("bundles_to_node_id", {}).get(slot[1])
            if table.get("state") != "CREATED" or node is None or node in draining:
                continue
            self.shard_spares.remove(slot)
            actor = self._new_host([], slot, f"tidegraph-shard-host-{next(self._hosts_named)}")
            self.shard_joiners[(id(slot[0]), slot[1])] = (slot, actor, actor.parts.remote())
            log.info("starting a shard actor on node %s to take partitions over", node)
        up = []
        for key, (slot, actor, ref) in list(self.shard_joiners.items()):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                ray.get(ref)
                up.append((slot, actor))
            except ray.exceptions.RayError as exc:
                log.warning("a shard actor starting to take partitions failed (%s)", exc)
                del self.shard_joiners[key]
                self._release_host(actor, slot)
        self._top_up_shards()
        return up

    def _shard_leavers(self, draining) -> tuple[list[str], int]:
        """Hosts that should hand their partitions over now: those on draining nodes (while
        a host elsewhere can take them), then the newest beyond the wanted count; and how
        many of them are draining."""
        hosts = self._shard_hosts()
        nodes = {key: _slot_node(*slot) for key, (_, slot, _) in hosts.items()}
        leave = [key for key in hosts if nodes[key] in draining]
        if len(leave) == len(hosts):  # nowhere to go: successors start (`_successors_up`)
            leave = []
        drained = len(leave)
        stay = [key for key in hosts if key not in leave]
        extra = len(stay) - self.shard_target
        if extra > 0:  # own slots first (the SPREAD group's bundles stay reserved), fewest parts
            order = sorted(stay, key=lambda k: (hosts[k][1][0] is self.shard_pg,
                                                len(hosts[k][2])))  # fmt: skip
            leave += order[:extra]
        return leave, drained

    def _reshard(self, joining: list[tuple], leaving: list[str], reason: str, at: str) -> None:
        """Move partitions so that hosts `leaving` hold none and `joining` ones (slot, actor)
        take their share (`elastic.policy.plan_parts`), at a step boundary: each partition's
        state is copied to its new host, which must hold as many events, then trainers send
        it their requests there and the old host drops it (and goes when it holds none)."""
        t0 = time.perf_counter()
        self.drain()
        self._flush()
        hosts = self._shard_hosts()
        old_count = len(hosts)
        sizes = dict(enumerate(r["events"] for r in ray.get(
            [s.report.remote() for s in self.shards])))  # fmt: skip
        new = {actor._actor_id.hex(): (actor, slot) for slot, actor in joining}
        moves = plan_parts({k: v[2] for k, v in hosts.items()}, sizes, set(leaving), list(new))
        target = {k: (v[0], v[1]) for k, v in hosts.items()} | new
        refs = [target[dst][0].add_part.remote(q, *self._part_args(q),
                                               self.shards[q].state_dict.remote())
                for q, _, dst in moves]  # fmt: skip
        held = ray.get(refs)
        for (q, _, _), got in zip(moves, held, strict=True):
            if got["events"] != sizes[q]:
                raise RuntimeError(f"partition {q} copied to another shard actor holds "
                                   f"{got['events']} events, the shard {sizes[q]}")  # fmt: skip
        nodes = self._shard_nodes()
        old = [(self.shards[q], self.shard_slots[q]) for q, _, _ in moves]
        for q, _, dst in moves:
            self.shards[q], self.shard_slots[q] = PartHandle(target[dst][0], q), target[dst][1]
        for slot, _ in joining:
            del self.shard_joiners[(id(slot[0]), slot[1])]
        self._point_trainers([q for q, _, _ in moves])
        self._refresh(self.num_nodes, recovering=True)
        for handle, slot in old:
            self._release(handle, slot)
        for key, (actor, slot) in new.items():  # more hosts than partitions: not needed
            if not any(dst == key for _, _, dst in moves):
                self._release_host(actor, slot)
        now = self._shard_nodes()
        for q, _, _ in moves:
            self.shard_moves.append({"part": q, "from_node": nodes[q], "to_node": now[q],
                                     "events": sizes[q], "at": at, "reason": reason,
                                     "time": time.time()})  # fmt: skip
        count = len(self._shard_hosts())
        event = {"from": old_count, "to": count, "moves": len(moves), "reason": reason,
                 "at": at, "seconds": time.perf_counter() - t0, "time": time.time()}  # fmt: skip
        self.shard_resizes.append(event)
        self._top_up_shards()
        self._publish()
        log.warning("shards at %s: %d -> %d actors (%s); %d partitions moved; %.2f s", at,
                    old_count, count, reason, len(moves), event["seconds"])  # fmt: skip

    def _release_host(self, actor, slot: tuple) -> None:
        ray.kill(actor)
        if slot[0] is not self.shard_pg:
            with contextlib.suppress(Exception):
                remove_placement_group(slot[0])

    def resize(self, trainers: int, who: str = "operator") -> None:
        """Set the wanted trainer count (within [min, max] trainers) and resize at once."""
        if not self.min_trainers <= trainers <= self.max_trainers:
            raise ValueError(
                f"trainers must be within cluster min/max [{self.min_trainers}, "
                f"{self.max_trainers}], got {trainers}"
            )
        ray.get(self.coordinator.want_trainers.remote(trainers, who))
        self.drain()
        self._resize_if_due(force=True)

    def _resize(self, d: ResizeDecision, at: str = "between steps") -> None:
        """Apply `d` at a step boundary: new members copy a replica (no checkpoint), members
        that leave are stopped and their slots given back, the rest are renumbered, and the
        group is rebuilt on a new generation. Slices follow the new size from the next step
        (the global batch is kept, so results do not depend on the size)."""
        t0 = time.perf_counter()
        self.drain()
        self._flush()  # node-state updates reach the current members before a copy is taken
        old, leave = self.num_trainers, set(d.leave)
        slots = self._joiners_up(_draining_nodes())[: d.join]
        if len(leave) == old and not slots:  # a joiner failed meanwhile: one stays
            leave.discard(min(leave))
        stay = [w for w in range(old) if w not in leave]
        world = len(stay) + len(slots)
        source = self.trainers[stay[0] if stay else min(leave)]
        new = [self.joiners[id(slot)][:2] for slot in slots]
        if new:  # they started while the group trained: now they copy a replica
            state = source.replica_state.remote()
            num_nodes = ray.get(source.nodes.remote())  # its tables' size, then its state
            ray.get([actor.call.remote("grow", num_nodes) for _, actor in new])
            ray.get([actor.load_replica.remote(state, []) for _, actor in new])
        for slot in slots:
            self.spares.remove(slot)
            del self.joiners[id(slot)]
        nodes = self._member_nodes()
        left = [{"rank": w, "member": self.members[w], "node": nodes[w]} for w in sorted(leave)]
        for w in sorted(leave):
            ray.kill(self.trainers[w])
            remove_placement_group(self.member_slots.pop(self.members[w]))
        self.trainers = [self.trainers[w] for w in stay] + [a for _, a in new]
        self.members = [self.members[w] for w in stay] + [m for m, _ in new]
        self.incarnations = [self.incarnations[w] for w in stay] + [0] * len(new)
        self.num_trainers = world
        ray.get([t.set_rank.remote(r, world) for r, t in enumerate(self.trainers)])
        if new:
            self._refresh(self.num_nodes, [a for _, a in new], recovering=True)
        self._connect()
        self._top_up()
        event = {
            "from": old, "to": world,
            "left": left,
            "joined": [m for m, _ in new], "reason": d.reason, "at": at,
            "generation": self.generation, "seconds": time.perf_counter() - t0,
            "time": time.time(),
        }  # fmt: skip
        self.resizes.append(event)
        self._publish()
        log.warning("resize at %s: %d -> %d trainers (%s); left %s, joined as members %s; "
                    "%.2f s", at, old, world, d.reason, event["left"], event["joined"],
                    event["seconds"])  # fmt: skip

    def _member_nodes(self) -> list:
        """Node id of each trainer's slot (from the GCS: no call to a busy trainer)."""
        return [_slot_node(self.member_slots[m]) for m in self.members]

    def _joiners_up(self, draining) -> list:
        """Spare slots whose trainer is up and may join. Starts a trainer in each spare
        slot Ray has placed (a process start takes seconds; the group trains meanwhile);
        drops one that failed or whose node is draining (its slot is replaced)."""
        up = []
        for slot in list(self.spares):
            table = _slot_table(slot)
            node = table.get("bundles_to_node_id", {}).get(0)
            joiner = self.joiners.get(id(slot))
            if node in draining or (joiner is None and table.get("state") != "CREATED"):
                if node in draining:
                    self._drop_spare(slot)
                continue
            if joiner is None:
                member, self.next_member = self.next_member, self.next_member + 1
                self.member_slots[member] = slot
                actor = self._new_trainer(self.num_trainers, member=member,
                                          world=self.num_trainers + 1)  # fmt: skip
                joiner = self.joiners[id(slot)] = (member, actor, actor.pid.remote())
                log.info("starting trainer (member %d) on node %s to join the group",
                         member, node)  # fmt: skip
            if ray.wait([joiner[2]], timeout=0)[0]:
                try:
                    ray.get(joiner[2])
                    up.append(slot)
                except ray.exceptions.RayError as exc:
                    log.warning("a trainer starting to join failed (%s); its slot is "
                                "replaced", exc)  # fmt: skip
                    self._drop_spare(slot)
        self._top_up()
        return up

    def _drop_spare(self, slot) -> None:
        """Give a spare slot back (and kill the trainer starting in it)."""
        joiner = self.joiners.pop(id(slot), None)
        if joiner is not None:
            ray.kill(joiner[1])
            self.member_slots.pop(joiner[0], None)
        self.spares.remove(slot)
        with contextlib.suppress(Exception):
            remove_placement_group(slot)

    def _top_up(self) -> None:
        """Keep one spare slot per trainer the group lacks toward its target (Ray places
        them as resources appear, and a trainer starts in each); drop spares beyond it."""
        want = max(0, self.target - self.num_trainers) + _spares(self.config.cluster)
        while len(self.spares) < want:
            self.spares.append(self._slot())
        while len(self.spares) > want:
            self._drop_spare(self.spares[-1])

    def _publish(self) -> None:
        """The membership, where operators (`tidegraph.jobs.resize`) read it."""
        self.coordinator.publish.remote({
            "trainers": self.num_trainers, "min": self.min_trainers, "max": self.max_trainers,
            "shards": self.num_shards, "shard_moves": len(self.shard_moves),
            "shard_actors": len(self._shard_hosts()), "shards_min": self.min_shards,
            "shards_max": self.max_shards, "shard_target": self.shard_target,
            "target": self.target, "spares": len(self.spares), "generation": self.generation,
            "resizes": len(self.resizes),
            "last_resize": self.resizes[-1] if self.resizes else None,
        })  # fmt: skip

    # ---- recovery -----------------------------------------------------------------------------

    def _probe(self) -> list[int]:
        """Ranks of trainers that are dead, or do not answer within `probe_s` (hung: in a
        collective that waits for a dead peer, say); those are killed."""
        refs = [t.pid.remote() for t in self.trainers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.probe_s)
        lost = []
        for w, ref in enumerate(refs):
            if ref not in ready:
                ray.kill(self.trainers[w])
                lost.append(w)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                lost.append(w)
        return lost

    def recover(self, cause: Exception) -> list:
        """`_recover` after `cause`, again as often as a further failure interrupts it
        (within the recovery budget)."""
        return _retrying(self._recover, cause)

    def _recover(self, cause: Exception) -> list:
        """Bring the group back after `cause` (a failed pass): rebuild lost shards, replace
        every lost trainer by a copy of the survivor that finished the most steps of the
        pass and bring survivors that finished fewer to it (`recovery.policy`), rebuild the
        trainer group on a new generation. No checkpoint is read and no finished step is
        repeated. Returns the source's results of the pass so far; raises `cause` when
        nothing was lost and it is no failure of the trainers' group (a collective or its
        rendezvous, say because a member was lost and replaced meanwhile: the group is
        then just rebuilt), `NoReplicaLeft` when no trainer survived."""
        t0 = time.perf_counter()
        # a trainer that was to copy a replica when recovery was interrupted is lost too
        lost = sorted(set(self._probe()) | self._stale)
        lost_shards = self._probe_shards()
        lost_replicas = self._probe_replicas()  # dropped; successors start in the background
        if not lost and not lost_shards and not lost_replicas and not _group_failure(cause):
            raise cause  # not a lost member: a real error
        if lost_shards:
            self._recover_shards(cause, lost_shards, tuple(lost))
        if len(lost) == len(self.trainers):
            raise NoReplicaLeft(
                f"all {len(lost)} trainers were lost; no replica to recover from"
            ) from cause
        self.recoveries_left -= 1
        if self.recoveries_left < 0:
            raise RuntimeError("trainer recovery: the retry budget is spent") from cause
        for w in lost:  # frees the name of one that died (a SIGKILLed actor keeps it)
            ray.kill(self.trainers[w])
        alive = [w for w in range(len(self.trainers)) if w not in lost]
        reports = dict(zip(alive, ray.get([self.trainers[w].recovery_report.remote()
                                           for w in alive]), strict=True))  # fmt: skip
        # where each stands: steps of the pass under way, or (a task per step) all its steps
        key = "done" if self.runs_passes else "steps"
        plan = plan_trainer_recovery(len(self.trainers), lost,
                                     {w: r[key] for w, r in reports.items()})  # fmt: skip
        source, done, behind = plan.source, plan.steps_done, list(plan.copy_to)
        state = self.trainers[source].replica_state.remote()
        results = ray.put(reports[source]["results"])
        # replacements start with the source's tables (an ingest may have failed before
        # every trainer grew them), load its state, then all grow to what shards hold
        num_nodes = ray.get(self.trainers[source].nodes.remote())
        self._stale = set(behind)
        spared, dropped = [], []
        for w in plan.replace:
            self.incarnations[w] += 1
            may_shrink = len(self.trainers) - len(dropped) > self.min_trainers
            got = self._replacement(w, num_nodes, may_shrink)
            if got is None:  # no room for a replacement in time: the group shrinks
                dropped.append(w)
                continue
            self.trainers[w], spare = got
            spared += [w] if spare else []
        copies = [self.trainers[w] for w in behind if w not in dropped]
        if dropped:
            self._drop_ranks(dropped, f"trainer {dropped} lost and no slot free for a "
                             f"replacement within {self.replace_wait_s:.0f} s")  # fmt: skip
            self._stale = {w for w, t in enumerate(self.trainers) if any(t is c for c in copies)}
        ray.get([actor.load_replica.remote(state, results) for actor in copies])
        self._refresh(self.num_nodes, recovering=True)
        self._stale = set()
        self._connect()
        event = {
            "lost": lost, "lost_shards": lost_shards, "source": source, "steps_done": done,
            "lost_replicas": [list(x) for x in lost_replicas],
            "copied_to": sorted(behind), "spares_used": spared, "dropped": dropped,
            "generation": self.generation, "seconds": time.perf_counter() - t0,
            "cause": type(cause).__name__,
        }  # fmt: skip
        self.recoveries.append(event)
        log.warning(
            "trainer recovery: lost %s; %d steps of the pass done; trainer %d copied to %s; "
            "group generation %d; %.2f s", lost, done, source, sorted(behind), self.generation,
            event["seconds"],
        )  # fmt: skip
        return reports[source]["results"]

    def _replacement(self, w: int, num_nodes: int, may_shrink: bool = False) -> tuple | None:
        """A trainer for the lost rank `w`, and whether it is a spare: one already up
        (`cluster.spare_trainers`, or one starting to join) takes the rank without a process
        start; else a new one starts in a new slot (the lost one's may be on a node that
        died, whose bundles Ray moves only once it declares the node dead). None: no slot
        was placed within `replace_wait_s` and the group may shrink (above its minimum)."""
        up = self._joiners_up(_draining_nodes())
        if not up:
            member = self.members[w]
            with contextlib.suppress(Exception):
                remove_placement_group(self.member_slots.pop(member))
            slot = self._slot()
            wait = self.replace_wait_s if may_shrink else self.placement_wait_s
            if not ray.wait([slot.ready()], timeout=wait)[0]:
                remove_placement_group(slot)
                if may_shrink:
                    return None
                raise PlacementTimeout(
                    f"no room for a replacement of trainer {w} x {self.trainer_bundle} within "
                    f"{wait:.0f} s (cluster min trainers {self.min_trainers}); available: "
                    f"{ray.available_resources()}"
                )
            self.member_slots[member] = slot
            return self._new_trainer(w, num_nodes=num_nodes), False
        slot = up[0]
        member, actor, _ = self.joiners.pop(id(slot))
        self.spares.remove(slot)
        with contextlib.suppress(Exception):  # the lost member's slot (maybe on a dead node)
            remove_placement_group(self.member_slots.pop(self.members[w]))
        self.members[w] = member
        ray.get([actor.set_rank.remote(w, self.num_trainers, self.incarnations[w]),
                 actor.call.remote("grow", num_nodes)])  # fmt: skip
        log.info("spare trainer (member %d) replaces rank %d", member, w)
        self._top_up()
        return actor, True

    def _drop_ranks(self, ranks: list[int], reason: str) -> None:
        """Take lost `ranks` out of the group (their slots are gone) and renumber the rest;
        a pending slot per missing trainer is asked for, to grow back when Ray places it."""
        old = self.num_trainers
        keep = [w for w in range(old) if w not in ranks]
        left = [{"rank": w, "member": self.members[w]} for w in ranks]
        self.trainers = [self.trainers[w] for w in keep]
        self.members = [self.members[w] for w in keep]
        self.incarnations = [self.incarnations[w] for w in keep]
        self.num_trainers = len(keep)
        ray.get([t.set_rank.remote(r, self.num_trainers) for r, t in enumerate(self.trainers)])
        self._top_up()
        event = {"from": old, "to": self.num_trainers, "left": left, "joined": [],
                 "reason": reason, "at": "recovery", "seconds": 0.0,
                 "time": time.time()}  # fmt: skip
        self.resizes.append(event)
        log.warning("resize in recovery: %d -> %d trainers (%s)", old, self.num_trainers, reason)

    def _probe_shards(self) -> list[int]:
        """Partitions whose shard actor is dead or does not answer within `probe_s` (that
        actor is killed: every partition it held is lost), and partitions rebuilt only in
        part when a recovery was interrupted (dropped by the actor holding them)."""
        refs = [s.ping.remote() for s in self.shards]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.probe_s)
        dead = set()
        for p, ref in enumerate(refs):
            try:
                if ref not in ready:  # hung
                    raise TimeoutError
                ray.get(ref)
            except (ray.exceptions.RayActorError, TimeoutError):
                dead.add(self.shards[p].actor._actor_id.hex())
        lost = []
        for p, handle in enumerate(self.shards):
            if handle.actor._actor_id.hex() in dead:
                ray.kill(handle.actor)  # a hung one, or free a dead one's name
                lost.append(p)
            elif p in self._stale_shards:
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.get(handle.actor.drop_part.remote(p))
                lost.append(p)
        return lost

    def _recover_shards(
        self, cause: Exception, lost: list[int] | None = None, lost_trainers: tuple = ()
    ) -> None:
        """Rebuild lost shards by routing every batch ingested so far again (the same
        batches, the same feature rounding): each gets exactly the events the log holds for
        its partition, checked by count. Trainers (but `lost_trainers`) are pointed at the
        new actors."""
        lost = self._probe_shards() if lost is None else lost
        if not lost:
            raise cause
        live = [t for w, t in enumerate(self.trainers) if w not in lost_trainers]
        promoted = [p for p in lost if self.replicas[p]]
        for p in promoted:  # a replica holds all the shard held: it takes its place
            self.shards[p] = self.replicas[p].pop(0)
            self.shard_slots[p] = self.replica_slots[p].pop(0)
            self._start_replicas(p)
        if promoted:
            ray.get([t.replace_shard.remote(p, self.shards[p]) for t in live for p in promoted])
            self.recoveries.append({"lost_shards": promoted, "promoted": promoted,
                                    "events": {p: ray.get(self.shards[p].report.remote())[
                                        "events"] for p in promoted}})  # fmt: skip
            log.warning("shard recovery: replicas promoted for %s", promoted)
        lost = [p for p in lost if p not in promoted]
        if not lost:
            self._refresh(self.num_nodes, live, recovering=True)
            return
        if self.replay_source is None:
            raise RuntimeError(f"shards {lost} were lost and no replay source is set") from cause
        self.recoveries_left -= 1
        if self.recoveries_left < 0:
            raise RuntimeError("shard recovery: the retry budget is spent") from cause
        t0 = time.perf_counter()
        self._stale_shards = set(lost)
        snap, start = self._snapshot()
        ops = [("ingest", k) for k in range(start, len(self.ingests))]
        if self.sharded:  # node state too: the journal since the snapshot, in order
            since = 0 if snap is None else snap.get("journal_pos", -1)
            if since < self._journal_base:
                raise RuntimeError(
                    f"shards {lost} were lost with the node state they own (cluster.memory "
                    "'sharded') and no replica (cluster.shard_replicas), and the journal of "
                    "node-state updates since their snapshot is gone: resume the run from "
                    "its last checkpoint"
                ) from cause
            ops = self._journal[since - self._journal_base :]
        where = self._rebuild_hosts(lost)
        # each lost partition as the checkpoint holds it (or empty), then the later ingests
        ray.get([actor.add_part.remote(p, *self._part_args(p),
                                       None if snap is None else snap["shards"][p])
                 for p, actor in where.items()])  # fmt: skip
        expected = dict.fromkeys(lost, 0)
        if snap is not None:
            expected = {p: snap["shards"][p]["num_events"] for p in lost}
        gen = torch.Generator()
        calls = []
        for kind, what in ops:  # each actor runs its calls in order
            if kind == "ingest":
                lo, hi, state = self.ingests[what]
                gen.set_state(state)
                events = self.replay_source(lo, hi)
                pieces = route_batch(self.partitioner, events,
                                     self.config.data.feature_precision, gen)  # fmt: skip
                for p in lost:
                    expected[p] += pieces[p].num_events
                    calls.append(self.shards[p].ingest.remote(pieces[p]))
            elif kind == "apply":
                calls += [self.shards[p].apply_state.remote(what) for p in lost]
            elif kind == "reset":
                calls += [self.shards[p].reset_state.remote() for p in lost]
            else:  # "load"
                parts = ray.get(what)
                calls += [self.shards[p].load_node_state_dict.remote(parts[p]) for p in lost]
        ray.get(calls)
        held = {p: ray.get(self.shards[p].report.remote())["events"] for p in lost}
        if held != expected:
            raise RuntimeError(f"rebuilt shards hold {held} events, the log has {expected}")
        self._stale_shards = set()
        ray.get([t.replace_shard.remote(p, self.shards[p]) for t in live for p in lost])
        self._refresh(self.num_nodes, live, recovering=True)  # replacements get them new
        actors = len({a._actor_id.hex() for a in where.values()})
        log.warning(
            "shard recovery: rebuilt %s on %d shard actors from %s and %d logged batches (%s "
            "events); %.2f s", lost, actors,
            "the checkpoint's snapshot" if snap is not None else "nothing",
            len(self.ingests) - start, held, time.perf_counter() - t0,
        )  # fmt: skip
        self.recoveries.append({"lost_shards": lost, "events": held, "snapshot": snap is not None,
                                "replayed_batches": len(self.ingests) - start,
                                "rebuilt_on": actors,
                                "seconds": time.perf_counter() - t0})  # fmt: skip
        self._top_up_shards()  # lost hosts' slots: hosts start there and take partitions back

    def _rebuild_hosts(self, lost: list[int]) -> dict:
        """{p: the actor that rebuilds lost partition p}. The surviving shard actors split
        the lost partitions among them (`elastic.policy.plan_parts`: each replays its share
        of the log at the same time, with no process to start); with none left, a new actor
        per lost one starts in its slot. The lost actors' slots are kept: Ray places them
        again (a lost node's on another), and new actors there take partitions over."""
        hosts = self._shard_hosts()
        gone = {key for key, (_, _, parts) in hosts.items() if set(parts) <= set(lost)}
        for key in gone:  # dead, or alive holding only partitions it had not finished
            ray.kill(hosts[key][0])
        survivors = {k: [q for q in parts if q not in lost] for k, (_, _, parts) in hosts.items()
                     if k not in gone}  # fmt: skip
        if not survivors or self.num_copies > 1:
            where = {}
            for key in gone:
                actor, slot, parts = hosts[key]
                name = f"tidegraph-shard-{parts[0]}-h{next(self._hosts_named)}"
                new = self._new_host([], slot, name)
                where.update(dict.fromkeys(parts, new))
                for q in parts:
                    self.shards[q] = PartHandle(new, q)
            return where
        lost_hosts = {key: hosts[key][2] for key in gone}
        moves = plan_parts(survivors | lost_hosts, {}, gone)
        where = {}
        for q, _, dst in moves:
            actor, slot, _ = hosts[dst]
            where[q] = actor
            self.shards[q], self.shard_slots[q] = PartHandle(actor, q), slot
        for key in gone:
            slot = hosts[key][1]
            if all(slot is not x for x in self.shard_spares):
                self.shard_spares.append(slot)
        return where

    def _snapshot(self) -> tuple[dict | None, int]:
        """The newest checkpoint's group state, if it is a prefix of this run's ingests (same
        spans), and how many ingests it covers; (None, 0) without one."""
        if self.snapshot_source is None:
            return None, 0
        snap = self.snapshot_source()
        if snap is None:
            return None, 0
        n = len(snap["ingests"])
        spans = [tuple(x[:2]) for x in snap["ingests"]]
        if n > len(self.ingests) or spans != [tuple(x[:2]) for x in self.ingests[:n]]:
            log.warning("shard recovery: the checkpoint's shards are not a prefix of this run's "
                        "ingests; replaying every batch")  # fmt: skip
            return None, 0
        return snap, n

    def _wait_pass(self, refs: list, progress) -> list:
        """The trainers' results of a pass; meanwhile `progress` gets the steps trainer 0
        reported, a trainer that failed raises at once (not after the others), and when the
        group should change size the trainers are asked to stop after a step."""
        checked: set = set()
        while True:
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.progress_s)
            ray.get([r for r in ready if r not in checked])  # raises the first failure
            checked.update(ready)
            if not pending:
                return ray.get(refs)
            if progress is not None:
                progress(ray.get(self.coordinator.progress.remote()))
            if not self._stop_asked and any(self._plan()):
                self._stop_asked = True
                self.coordinator.request_stop.remote(True)

    def eval_step(
        self, ev: EventBatch, neg_BQ: torch.Tensor, observe: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._resize_if_due()
        self.drain()  # training steps sent before (and recovered, if need be)
        outs = []
        before = self._take_pending()
        bounds = self.balancer.bounds(ev, neg_BQ, self.num_trainers)
        if before and any(hi == lo for lo, hi in bounds):
            self._pending = before  # a trainer without a slice gets them on their own
            self._flush()
            before = []
        start = batch_start(ev.t) if self.config.sampler.history == "batch" else None
        for trainer, (lo, hi) in zip(self.trainers, bounds, strict=True):
            if hi == lo:
                continue
            args = _own((ev.select(slice(lo, hi)), neg_BQ[lo:hi]))
            outs.append(trainer.eval_slice.options(num_returns=3).remote(
                *args, observe, start, *before
            ))  # fmt: skip
        if observe and not self.sharded:
            self._apply_state([o[2] for o in outs])
        try:
            pos = ray.get([o[0] for o in outs])
            neg = ray.get([o[1] for o in outs])
        except ray.exceptions.RayActorError as exc:
            # survivors applied `before` (their task's first act) and replacements copy one;
            # the step itself changed nothing yet (shards get its updates only below): run
            # it again
            self._pending = []
            self.recover(exc)
            return self.eval_step(ev, neg_BQ, observe)
        if observe and self.sharded:
            try:
                self._apply_state([o[2] for o in outs])
            except ray.exceptions.RayError as exc:
                self.recover(exc)  # every copy was sent the updates; a replica takes over
        return torch.cat(pos), torch.cat(neg)

    def drain(self) -> None:
        """Wait for every training step submitted so far."""
        while self._inflight:
            self._inflight.popleft().value()

    def _apply_state(self, updates: list) -> None:
        """Every slice's node-state updates: to every trainer with its next call (pending
        until then, in order before anything the trainer does next), or to every shard
        (waited for: trainers read shards next)."""
        if self.sharded:
            if self._journaling:  # copies on the driver's node: a trainer's node may go
                self._note("apply", ray.put(ray.get(list(updates))))
            ray.get([s.apply_state_of.remote(*updates) for s in self._all_copies()])
            return
        self._flush()
        self._pending = [self._seq, *updates]
        self._seq += 1

    def _take_pending(self) -> list:
        pending, self._pending = self._pending, []
        return pending

    def _flush(self) -> None:
        """Send pending node-state updates on their own (before a call that carries none)."""
        pending = self._take_pending()
        if pending:
            for trainer in self.trainers:
                trainer.apply_updates.remote(*pending)

    # ---- node state, rounds, reports ----------------------------------------------------------

    def _all(self, method: str, *args) -> list:
        """`TrainerCore.method(*args)` on every trainer."""
        self._flush()
        return self._robust(lambda: ray.get([t.call.remote(method, *args) for t in self.trainers]))

    def _robust(self, call):
        """`call()` (driver calls that read actors); when an actor is found lost, the group
        recovers (`recover`) and the call is made again, on the new actors."""
        for _ in range(self.config.cluster.max_recoveries + 1):
            try:
                return call()
            except ray.exceptions.RayActorError as exc:
                self.recover(exc)
        return call()

    def reset_state(self) -> None:
        self._all("reset_state")
        if self.sharded:
            self._note("reset", None)
            ray.get([s.reset_state.remote() for s in self._all_copies()])

    def node_state(self) -> dict:
        self._flush()
        if self.sharded:
            return {"shards": ray.get([s.node_state_dict.remote() for s in self.shards])}
        return self._robust(lambda: ray.get(self.trainers[0].call.remote("node_state")))

    def shard_states(self) -> list[dict]:
        """Every partition's `ShardCore.state_dict()`, by partition, as its shard actor holds
        it after the steps submitted so far (read only: for checks of what each holds)."""
        self.drain()
        self._flush()
        return self._robust(lambda: ray.get([s.state_dict.remote() for s in self.shards]))

    def load_node_state(self, state: dict) -> None:
        if self.sharded:
            parts = state["shards"]
            self._note("load", ray.put(parts) if self._journaling else None)
            ray.get([s.load_node_state_dict.remote(x) for p, x in enumerate(parts)
                     for s in self._copies(p)])  # fmt: skip
            return
        ref = ray.put(state)
        self._all("load_node_state", ref)

    def new_optimizers(self) -> None:
        self._all("new_optimizer")

    def restore_caches(self, eids: torch.Tensor) -> None:
        self._all("restore_cache", eids)

    def cache_stats(self) -> dict | None:
        self._flush()
        return self._robust(lambda: ray.get(self.trainers[0].cache_stats.remote()))

    def sampler_states(self) -> list:
        self.drain()
        return self._robust(lambda: ray.get([s.sampler_state.remote() for s in self.shards]))

    def load_sampler_states(self, states: list) -> None:
        self.drain()
        self._flush()
        ray.get([s.load_sampler_state.remote(x) for p, x in enumerate(states)
                 for s in self._copies(p)])  # fmt: skip

    def grad_values(self) -> int:
        return self._robust(lambda: ray.get(self.trainers[0].grad_values.remote()))

    def comm_totals(self) -> dict | None:
        """Trainer 0's gradient-compression totals (bytes per rank), None without it."""
        return self._robust(lambda: ray.get(self.trainers[0].comm_totals.remote()))

    def comm_state(self) -> dict | None:
        """Trainer 0's gradient-compression state (its `TrainerCore.state_dict()["comm"]`)."""
        return ray.get(self.trainers[0].call.remote("state_dict")).get("comm")

    def take_seconds(self) -> list[dict]:
        return self._all("take_seconds")

    def take_step_edges(self) -> list[list[int]]:
        return self._all("take_step_edges")

    def model_state(self) -> dict:
        self._flush()
        return self._robust(lambda: ray.get(self.trainers[0].model_state.remote()))

    def report(self, src: torch.Tensor, dst: torch.Tensor) -> dict:
        out = partition_report(src, dst, self.partitioner)
        reports = self._robust(lambda: ray.get([s.report.remote() for s in self.shards]))
        out["shard_events"] = [r["events"] for r in reports]
        return out

    def alive(self) -> tuple[int, int]:
        """(trainers, shards) whose actors the GCS reports alive (a killed actor's name can
        outlive it while handles to it exist, so the lookup is by actor id)."""

        def up(actor) -> bool:
            return _actor_state(actor) == "ALIVE"

        hosts = {key: up(actor) for key, (actor, _, _) in self._shard_hosts().items()}
        return sum(map(up, self.trainers)), sum(hosts[s.actor._actor_id.hex()] for s in self.shards)

    def placement(self) -> dict:
        """Node id of every shard and trainer actor (for operators and tests)."""
        actors = {f"tidegraph-shard-{p}": s for p, s in enumerate(self.shards)}
        actors.update({f"tidegraph-trainer-{w}": t for w, t in enumerate(self.trainers)})
        nodes = ray.get([a.node_id.remote() for a in actors.values()])
        return dict(zip(actors, nodes, strict=True))

    # ---- state --------------------------------------------------------------------------------

    @property
    def _journaling(self) -> bool:
        return self.sharded and self.num_copies == 1

    def _note(self, kind: str, what) -> None:
        """Journal one change of the shards (`_journal`)."""
        if self._journaling:
            self._journal.append((kind, what))

    def _cut_journal(self) -> int:
        """The journal's position now (a state is taken); entries older than the states
        taken before the last one are dropped (a rebuild starts from the newest checkpoint,
        or the one before if the newest was not written)."""
        pos = self._journal_base + len(self._journal)
        self._journal_cuts = [*self._journal_cuts[-1:], pos]
        drop = self._journal_cuts[0] - self._journal_base
        if drop > 0:
            del self._journal[:drop]
            self._journal_base += drop
        return pos

    def state_dict(self) -> dict:
        self.drain()
        return {
            "journal_pos": self._cut_journal(),
            "memory_placement": self.memory_placement,
            "partitioner": self.partitioner.state_dict(),
            "feature_gen": self.feature_gen.get_state(),
            "balancer": self.balancer.state_dict(),
            "ingests": list(self.ingests),
            "start_trainers": self.start_trainers,  # W0 of `cluster.scale_rule`
            "shards": self._robust(lambda: ray.get([s.state_dict.remote() for s in self.shards])),
            "trainers": self._all("state_dict"),
        }

    def load_state_dict(self, state: dict) -> None:
        self.drain()
        self._flush()
        check_placement(state, self.memory_placement)
        self.partitioner.load_state_dict(state["partitioner"])
        load_generator_state(self.feature_gen, state["feature_gen"], "feature rounding")
        self.balancer.load_state_dict(state["balancer"])
        self.ingests = list(state["ingests"])
        self._journal, self._journal_cuts = [], []
        self._journal_base = state.get("journal_pos", 0)
        ray.get([s.load_state_dict.remote(x) for p, x in enumerate(state["shards"])
                 for s in self._copies(p)])  # fmt: skip
        self.start_trainers = state.get("start_trainers", self.start_trainers)
        states = state["trainers"]
        if len(states) != self.num_trainers:  # saved at another size: replicas are equal
            log.info("state of %d trainers loaded into %d", len(states), self.num_trainers)
            states = [states[0]] * self.num_trainers
        ray.get([t.call.remote("load_state_dict", x) for t, x in zip(self.trainers, states,
                                                                     strict=True)])  # fmt: skip
        self._scale()
        self._refresh(0)

    def shutdown(self) -> None:
        """Kill this group's actors and release its placement groups (idempotent)."""
        joining = [j[1] for j in getattr(self, "joiners", {}).values()]
        joining += [j[1] for j in getattr(self, "shard_successors", {}).values()]
        joining += [a for reps in getattr(self, "replicas", []) for a in reps]
        joining += [j[1] for js in getattr(self, "replica_successors", {}).values() for j in js]
        joining += [j[1] for j in getattr(self, "shard_joiners", {}).values()]
        shards = [s for s in getattr(self, "shards", []) if s is not None]
        actors = [*getattr(self, "trainers", []), *shards, *joining]
        for actor in {id(a): a for a in map(_actor, actors)}.values():
            ray.kill(actor)
        if getattr(self, "coordinator", None) is not None:
            ray.kill(self.coordinator)
        groups = [
            getattr(self, "shard_pg", None),
            *(pg for pg, _ in getattr(self, "shard_slots", [])),
            *(j[0] for j in getattr(self, "shard_successors", {}).values()),
            *(j[0] for js in getattr(self, "replica_successors", {}).values() for j in js),
            *(pg for slots in getattr(self, "replica_slots", []) for pg, _ in slots),
            *(pg for pg, _ in getattr(self, "shard_spares", [])),
            *(j[0][0] for j in getattr(self, "shard_joiners", {}).values()),
            *getattr(self, "slots", []),
            *getattr(self, "member_slots", {}).values(),
            *getattr(self, "spares", []),
        ]
        for pg in {id(g): g for g in groups if g is not None}.values():
            with contextlib.suppress(Exception):  # removed already (a resize gave it back)
                remove_placement_group(pg)
        self.shard_pg, self.slots, self.member_slots, self.spares = None, [], {}, []
        self.joiners, self.shard_successors, self.replica_successors = {}, {}, {}
        self.shard_spares, self.shard_joiners = [], {}
        self.replicas = []
        self.trainers, self.shards, self.coordinator = [], [], None
