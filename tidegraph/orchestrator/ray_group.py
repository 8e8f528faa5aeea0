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
import logging
import re
import time

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tidegraph.actors import CoordinatorActor, GraphShardActor, TrainerActor
from tidegraph.recovery.policy import NoReplicaLeft, plan_trainer_recovery
from tidegraph.rng import load_generator_state, seed_for, stream
from tidegraph.storage.events import EventBatch
from tidegraph.storage.partition import build_partitioner, partition_report
from tidegraph.training.balance import SliceBalancer
from tidegraph.training.group import check_placement, choose_memory_placement, state_row_bytes
from tidegraph.training.schedule import train_slices
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


def _actor_state(actor) -> str:
    """The GCS's state of `actor` ("ALIVE", "DEAD", ...). Ray offers it publicly only through
    the dashboard's state API (not always running), so this asks the GCS table directly."""
    from ray._private import state

    return state.actors(actor_id=actor._actor_id.hex())["State"]


class PendingLoss:
    """The loss of a submitted step; `value()` waits for it."""

    def __init__(self, refs: list) -> None:
        self._refs, self._value = refs, None

    def value(self) -> float:
        if self._value is None:
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

    def __init__(
        self, config, num_nodes: int, edge_dim: int, expected_nodes: int | None = None
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("RayGroup: call ray.init (tidegraph.orchestrator.cluster) first")
        c = config.cluster
        if config.sampler.strategy != "recent":
            raise ValueError(
                "sampler.strategy: 'uniform' is not supported with cluster.backend 'ray' yet "
                "(its draws would depend on which trainer asks first); use 'recent' or the "
                "local backend"
            )
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
        self.recoveries: list[dict] = []  # one record per trainer recovery
        self._stale: set[int] = set()  # trainers whose copy of a replica is not complete
        self._stale_shards: set[int] = set()  # shards rebuilt but not yet checked
        self.recoveries_left = config.cluster.max_recoveries
        self._inflight: collections.deque[PendingLoss] = collections.deque()
        self._pending: list = []  # node-state updates of the last step, not yet sent
        cuda = config.device.startswith("cuda")
        self.shard_pg = placement_group([{"CPU": c.shard_cpus}] * c.shards, strategy="SPREAD")
        trainer_bundle = {"CPU": c.trainer_cpus, **({"GPU": 1} if cuda else {})}
        self.trainer_pg = placement_group([trainer_bundle] * c.trainers, strategy="PACK")
        self._wait_placed(trainer_bundle)
        try:
            self._start(config, num_nodes, edge_dim, cuda, trainer_bundle)
        except ray.exceptions.RayError as exc:  # an actor failed in its constructor
            self.shutdown()
            cause = _value_error(exc)
            if cause is not None:  # bad configuration or data: the earliest error, named
                raise ValueError(cause) from None
            raise
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config, num_nodes: int, edge_dim: int, cuda: bool, trainer_bundle) -> None:
        c = config.cluster
        raw = config.to_dict()
        opts = dict(namespace=self.namespace, lifetime=None)
        self.coordinator = CoordinatorActor.options(name="tidegraph-coordinator", **opts).remote()
        self._shard_args = (edge_dim, cuda)
        self.shards = [self._new_shard(p) for p in range(c.shards)]
        self._trainer_args = (raw, edge_dim, cuda)
        self.num_nodes = num_nodes
        self.incarnations = [0] * c.trainers  # replacements of each rank so far
        self.trainers = [self._new_trainer(w) for w in range(c.trainers)]
        self.generation = -1
        self._connect()
        ray.get([s.ping.remote() for s in self.shards])
        log.info(
            "ray group up: %d shards, %d trainers in namespace %r, node state %s",
            c.shards, c.trainers, self.namespace, self.memory_placement,
        )  # fmt: skip

    def _new_shard(self, p: int):
        """Shard actor of partition `p`, in its bundle of the shards' placement group."""
        config, c = self.config, self.config.cluster
        edge_dim, cuda = self._shard_args
        return GraphShardActor.options(
            name=f"tidegraph-shard-{p}", num_cpus=c.shard_cpus, namespace=self.namespace,
            lifetime=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.shard_pg, p),
        ).remote(
            self._runtime(p), p, c.shards, edge_dim=edge_dim,
            feature_precision=config.data.feature_precision,
            strategy=config.sampler.strategy, seed=seed_for(config.seed, "sampler", p),
            feature_seed=seed_for(config.seed, "features", p),
            graph_device=config.graph_device, pin_memory=cuda,
            state_model=self._state_model(edge_dim) if self.sharded else None,
        )  # fmt: skip

    def _new_trainer(self, w: int, placed: bool = True, num_nodes: int | None = None):
        """Trainer actor of rank `w`, in its bundle of the trainers' placement group (or, not
        `placed`, wherever the cluster has a slot), with tables for `num_nodes` nodes
        (default: as many as ingested)."""
        c = self.config.cluster
        raw, edge_dim, cuda = self._trainer_args
        where = {}
        if placed:
            where["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.trainer_pg, w)
        deadline = time.monotonic() + self.name_wait_s
        while True:
            try:
                return TrainerActor.options(
                    name=f"tidegraph-trainer-{w}", num_cpus=c.trainer_cpus,
                    num_gpus=1 if cuda else 0, namespace=self.namespace, lifetime=None, **where,
                ).remote(
                    self._runtime(w), raw, w, c.trainers, self.shards,
                    self.num_nodes if num_nodes is None else num_nodes,
                    edge_dim, self.sharded, self.incarnations[w],
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

    def _runtime(self, rank: int) -> dict:
        c = self.config
        return {"seed": c.seed, "rank": rank, "deterministic": c.deterministic,
                "threads": c.threads}  # fmt: skip

    def _state_model(self, edge_dim: int):
        from tidegraph.models.config import build_model

        with torch.random.fork_rng(devices=[]):
            snaps = self.config.sampler.num_snapshots
            return build_model(self.config.model, 0, edge_dim, num_snapshots=snaps)

    def _wait_placed(self, trainer_bundle: dict) -> None:
        """Bounded wait for both placement groups; the error names what is missing."""
        c = self.config.cluster
        deadline = time.monotonic() + self.placement_wait_s
        pending = [self.shard_pg.ready(), self.trainer_pg.ready()]
        while pending and time.monotonic() < deadline:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=5.0)
            if pending:
                log.info(
                    "waiting for resources: %d trainers x %s and %d shards x {CPU: %s}; "
                    "the cluster has %s available",
                    c.trainers, trainer_bundle, c.shards, c.shard_cpus,
                    ray.available_resources(),
                )  # fmt: skip
        if pending:
            self.shutdown()
            raise PlacementTimeout(
                f"could not place {c.trainers} trainers x {trainer_bundle} and {c.shards} "
                f"shards x {{'CPU': {c.shard_cpus}}} within {self.placement_wait_s:.0f} s; "
                f"available: {ray.available_resources()}"
            )

    # ---- ingest -----------------------------------------------------------------------------

    def ingest(self, events: EventBatch, num_nodes: int, span: tuple | None = None) -> None:
        """Route `events` to the shards. `span`: their [lo, hi) positions in the stream, kept
        (with the feature-rounding stream's state) so that a lost shard can be rebuilt by
        routing the same batches again (`replay_source` reads them back)."""
        self.drain()  # steps under way read the shards: they finish before shards change
        if span is not None:
            self.ingests.append((int(span[0]), int(span[1]), self.feature_gen.get_state()))
        pieces = route_batch(self.partitioner, events, self.config.data.feature_precision,
                             self.feature_gen)  # fmt: skip
        self.balancer.ingest(events)
        try:
            ray.get([s.ingest.remote(x) for s, x in zip(self.shards, pieces, strict=True)])
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
        losses, updates = [], []
        before = self._take_pending()
        bounds = self.balancer.bounds(ev, neg_BQ, self.num_trainers)
        slices = train_slices(ev, weight, neg_BQ, num_observe, self.num_trainers, bounds)
        for trainer, args in zip(self.trainers, slices, strict=True):
            loss, upd = trainer.train_and_step.options(num_returns=2).remote(*_own(args), *before)
            losses.append(loss)
            updates.append(upd)
        self._apply_state(updates)
        pending = PendingLoss(losses)
        if self.sharded:  # shards were waited for: the step is done
            pending.value()
        self._inflight.append(pending)
        while len(self._inflight) > self.pipeline_depth:  # bounded lookahead
            self._inflight.popleft().value()
        return pending

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
        per_trainer = [[] for _ in self.trainers]
        for ev, weight, neg, num_observe in batches:
            bounds = self.balancer.bounds(ev, neg, self.num_trainers)
            slices = train_slices(ev, weight, neg, num_observe, self.num_trainers, bounds)
            for w, args in enumerate(slices):
                per_trainer[w].append(_own(args))
        return self._pass("train_pass", per_trainer, (), progress)

    def eval_pass(self, batches: list, observe: bool, progress=None) -> list:
        """Scores of every batch of an evaluation pass, one task per trainer."""
        per_trainer = [[] for _ in self.trainers]
        for ev, neg in batches:
            for w, (lo, hi) in enumerate(self.balancer.bounds(ev, neg, self.num_trainers)):
                per_trainer[w].append(_own((ev.select(slice(lo, hi)), neg[lo:hi])))
        return self._pass("eval_pass", per_trainer, (observe,), progress)

    def _pass(self, method: str, per_trainer: list, args: tuple, progress) -> list:
        """Run a pass (`method` of every trainer, its slices of every step); rank 0's
        results, recovering from lost trainers as often as it takes."""
        self.drain()
        before = self._take_pending()
        results: list = []
        stalled = 0  # recoveries in a row after which the pass got no further
        while True:
            done = len(results)
            ray.get(self.coordinator.report.remote(0))
            refs = [getattr(t, method).remote(s[done:], *args, *before)
                    for t, s in zip(self.trainers, per_trainer, strict=True)]  # fmt: skip
            before = []  # applied by every survivor; a replacement copies one
            shifted = None if progress is None else (lambda n, d=done: progress(d + n))
            try:
                return results + self._wait_pass(refs, shifted)[0]
            except ray.exceptions.RayError as exc:
                results += self.recover(exc)
                stalled = stalled + 1 if len(results) == done else 0
                if stalled >= 3:
                    raise RuntimeError(
                        f"trainers keep failing at step {done} of a {method} of "
                        f"{len(per_trainer[0])} steps ({stalled} recoveries without progress); "
                        f"last lost: {self.recoveries[-1]['lost']}"
                    ) from exc

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
        if not lost and not lost_shards and not _group_failure(cause):
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
        plan = plan_trainer_recovery(len(self.trainers), lost,
                                     {w: r["done"] for w, r in reports.items()})  # fmt: skip
        source, done, behind = plan.source, plan.steps_done, list(plan.copy_to)
        state = self.trainers[source].replica_state.remote()
        results = ray.put(reports[source]["results"])
        # replacements start with the source's tables (an ingest may have failed before
        # every trainer grew them), load its state, then all grow to what shards hold
        num_nodes = ray.get(self.trainers[source].nodes.remote())
        self._stale = set(behind)
        for w in plan.replace:
            self.incarnations[w] += 1
            self.trainers[w] = self._new_trainer(w, num_nodes=num_nodes)
        ray.get([self.trainers[w].load_replica.remote(state, results) for w in behind])
        self._refresh(self.num_nodes, recovering=True)
        self._stale = set()
        self._connect()
        event = {
            "lost": lost, "lost_shards": lost_shards, "source": source, "steps_done": done,
            "copied_to": sorted(behind),
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

    def _probe_shards(self) -> list[int]:
        """Partitions whose shard actor is dead or does not answer within `probe_s`."""
        refs = [s.ping.remote() for s in self.shards]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.probe_s)
        lost = []
        for p, ref in enumerate(refs):
            try:
                if ref not in ready or p in self._stale_shards:  # hung, or half rebuilt
                    raise TimeoutError
                ray.get(ref)
            except (ray.exceptions.RayActorError, TimeoutError):
                ray.kill(self.shards[p])  # a hung one, or free a dead one's name
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
        if self.sharded:
            raise RuntimeError(
                f"shards {lost} were lost with the node state they own (cluster.memory "
                "'sharded'); it cannot be rebuilt from the event log: resume the run from "
                "its last checkpoint"
            ) from cause
        if self.replay_source is None:
            raise RuntimeError(f"shards {lost} were lost and no replay source is set") from cause
        self.recoveries_left -= 1
        if self.recoveries_left < 0:
            raise RuntimeError("shard recovery: the retry budget is spent") from cause
        t0 = time.perf_counter()
        self._stale_shards = set(lost)
        for p in lost:
            self.shards[p] = self._new_shard(p)
        expected = dict.fromkeys(lost, 0)
        gen = torch.Generator()
        calls = []
        for lo, hi, state in self.ingests:
            gen.set_state(state)
            events = self.replay_source(lo, hi)
            pieces = route_batch(self.partitioner, events, self.config.data.feature_precision,
                                 gen)  # fmt: skip
            for p in lost:
                expected[p] += pieces[p].num_events
                calls.append(self.shards[p].ingest.remote(pieces[p]))
        ray.get(calls)
        held = {p: ray.get(self.shards[p].report.remote())["events"] for p in lost}
        if held != expected:
            raise RuntimeError(f"rebuilt shards hold {held} events, the log has {expected}")
        self._stale_shards = set()
        live = [t for w, t in enumerate(self.trainers) if w not in lost_trainers]
        ray.get([t.replace_shard.remote(p, self.shards[p]) for t in live for p in lost])
        self._refresh(self.num_nodes, live, recovering=True)  # replacements get them new
        log.warning(
            "shard recovery: rebuilt %s from %d logged batches (%s events); %.2f s",
            lost, len(self.ingests), held, time.perf_counter() - t0,
        )  # fmt: skip
        self.recoveries.append({"lost_shards": lost, "events": held,
                                "seconds": time.perf_counter() - t0})  # fmt: skip

    def _wait_pass(self, refs: list, progress) -> list:
        """The trainers' results of a pass; meanwhile `progress` gets the steps trainer 0
        reported, and a trainer that failed raises at once (not after the others)."""
        checked: set = set()
        while True:
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.progress_s)
            ray.get([r for r in ready if r not in checked])  # raises the first failure
            checked.update(ready)
            if not pending:
                return ray.get(refs)
            if progress is not None:
                progress(ray.get(self.coordinator.progress.remote()))

    def eval_step(
        self, ev: EventBatch, neg_BQ: torch.Tensor, observe: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        outs = []
        before = self._take_pending()
        bounds = self.balancer.bounds(ev, neg_BQ, self.num_trainers)
        if before and any(hi == lo for lo, hi in bounds):
            self._pending = before  # a trainer without a slice gets them on their own
            self._flush()
            before = []
        for trainer, (lo, hi) in zip(self.trainers, bounds, strict=True):
            if hi == lo:
                continue
            args = _own((ev.select(slice(lo, hi)), neg_BQ[lo:hi]))
            outs.append(trainer.eval_slice.options(num_returns=3).remote(
                *args, observe, *before
            ))  # fmt: skip
        if observe:
            self._apply_state([o[2] for o in outs])
        try:
            pos = ray.get([o[0] for o in outs])
            neg = ray.get([o[1] for o in outs])
        except ray.exceptions.RayActorError as exc:
            if self.sharded:  # shards may hold some of the step's updates: not recoverable
                raise
            # survivors applied `before` (their task's first act) and replacements copy one;
            # the step itself changed nothing yet: run it again
            self._pending = []
            self.recover(exc)
            return self.eval_step(ev, neg_BQ, observe)
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
            ray.get([s.apply_state_of.remote(*updates) for s in self.shards])
            return
        self._flush()
        self._pending = list(updates)

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
            ray.get([s.reset_state.remote() for s in self.shards])

    def node_state(self) -> dict:
        self._flush()
        if self.sharded:
            return {"shards": ray.get([s.node_state_dict.remote() for s in self.shards])}
        return self._robust(lambda: ray.get(self.trainers[0].call.remote("node_state")))

    def load_node_state(self, state: dict) -> None:
        if self.sharded:
            parts = state["shards"]
            ray.get([s.load_node_state_dict.remote(x) for s, x in zip(self.shards, parts,
                                                                      strict=True)])  # fmt: skip
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
        ray.get([s.load_sampler_state.remote(x) for s, x in zip(self.shards, states,
                                                                strict=True)])  # fmt: skip

    def grad_values(self) -> int:
        return self._robust(lambda: ray.get(self.trainers[0].grad_values.remote()))

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

        return sum(map(up, self.trainers)), sum(map(up, self.shards))

    def placement(self) -> dict:
        """Node id of every shard and trainer actor (for operators and tests)."""
        actors = {f"tidegraph-shard-{p}": s for p, s in enumerate(self.shards)}
        actors.update({f"tidegraph-trainer-{w}": t for w, t in enumerate(self.trainers)})
        nodes = ray.get([a.node_id.remote() for a in actors.values()])
        return dict(zip(actors, nodes, strict=True))

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        self.drain()
        return {
            "memory_placement": self.memory_placement,
            "partitioner": self.partitioner.state_dict(),
            "feature_gen": self.feature_gen.get_state(),
            "balancer": self.balancer.state_dict(),
            "ingests": list(self.ingests),
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
        ray.get([s.load_state_dict.remote(x) for s, x in zip(self.shards, state["shards"],
                                                             strict=True)])  # fmt: skip
        ray.get([t.call.remote("load_state_dict", x) for t, x in zip(self.trainers,
                                                                     state["trainers"],
                                                                     strict=True)])  # fmt: skip
        self._refresh(0)

    def shutdown(self) -> None:
        """Kill this group's actors and release its placement groups (idempotent)."""
        for actor in [*getattr(self, "trainers", []), *getattr(self, "shards", [])]:
            ray.kill(actor)
        if getattr(self, "coordinator", None) is not None:
            ray.kill(self.coordinator)
        for name in ("shard_pg", "trainer_pg"):
            pg = getattr(self, name, None)
            if pg is not None:
                remove_placement_group(pg)
                setattr(self, name, None)
        self.trainers, self.shards, self.coordinator = [], [], None
