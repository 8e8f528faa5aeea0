"""`RayGroup`: the shards and trainers of a run as Ray actors, with `LocalGroup`'s interface.

Placement: shards in a SPREAD placement group (one bundle of `cluster.shard_cpus` each, on
different nodes where there are several), trainers in a PACK group (one bundle of
`cluster.trainer_cpus`, and a GPU on CUDA, each); every bundle with the custom resources of
`cluster.shard_resources` / `trainer_resources`. The trainers rendezvous through a
store in the driver's process and sum gradients with an all-reduce inside the step; the driver
only routes events, hands out slices and passes each step's node-state updates (object refs,
never copied through the driver) to every trainer, or to every shard when shards hold node
state. Per trainer and step: one request per shard per hop to sample, one per shard for
features, and with sharded node state one or two per shard for state rows.

Ordering: calls from the driver to one actor run in order, so a trainer applies step s's
updates before it trains step s + 1, and the driver submits up to `pipeline_depth` steps ahead
(their losses are read later) so that preparing the next step overlaps training this one.
Shards are called by trainers too, so the driver waits for steps under way before it changes
shards (ingest), and waits for sharded node-state updates before the next step starts.

`RayGroup` is a facade: it builds the group and answers reads and state, and each concept is a
part of its own module, all acting on the one group's fields: `placement` (slots, actor
factories, GCS reads), `roster` (trainer members, spares, joiners, resizes), `shard_table`
(partitions, replicas, moves), `shard_hosts` (the shard-actor count), `pipeline` (ingests and
steps), `passes` (a pass per task),
`resizing` (the elastic loop), `recovering` (lost trainers), `shard_recovery` (lost partitions,
the journal). The decisions they act on are pure functions in `tidegraph.recovery` and
`tidegraph.elastic`, tested without Ray.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tidegraph.actors import CoordinatorActor
from tidegraph.actors.shard import PartHandle
from tidegraph.comm.collective import StoreHost
from tidegraph.orchestrator.passes import Passes
from tidegraph.orchestrator.pipeline import PendingLoss, StepPipeline, group_failure
from tidegraph.orchestrator.placement import (
    Placement,
    PlacementTimeout,
    actor_of,
    actor_state,
    draining_nodes,
    replica_count,
    shard_bounds,
    shard_bundle,
    slot_table,
    spare_count,
    trainer_bounds,
    trainer_bundle,
    trainer_gpu_share,
    value_error,
)
from tidegraph.orchestrator.recovering import TrainerRecovery
from tidegraph.orchestrator.resizing import Resizing
from tidegraph.orchestrator.roster import TrainerRoster
from tidegraph.orchestrator.shard_hosts import ShardHosts
from tidegraph.orchestrator.shard_recovery import ShardRecovery
from tidegraph.orchestrator.shard_table import ShardTable
from tidegraph.recovery.budget import RecoveryBudget
from tidegraph.recovery.policy import NoReplicaLeft
from tidegraph.storage.checkpoint import CheckpointStore
from tidegraph.timeline import clock_offset, shift
from tidegraph.training.groupcore import GroupCore

__all__ = ["NoReplicaLeft", "PlacementTimeout", "RayGroup"]

log = logging.getLogger(__name__)


class RayGroup(
    Placement,
    TrainerRoster,
    ShardTable,
    ShardHosts,
    StepPipeline,
    Passes,
    Resizing,
    TrainerRecovery,
    ShardRecovery,
    GroupCore,
):
    """P shard actors and W trainer actors of one run (Ray must be initialized)."""

    supports_update_log = True  # trainer actors write it (`recovery.updatelog`)

    placement_wait_s = 120.0  # tests set it lower
    pipeline_depth = 4  # training steps submitted ahead of the oldest unfinished one
    progress_s = 0.5  # seconds between progress reads while a pass runs
    probe_s = 10.0  # a trainer that does not answer this long after a failure is hung
    name_wait_s = 30.0  # for a lost trainer's name to be free for its replacement
    replace_wait_s = 5.0  # for a replacement's slot, before a group above its min shrinks
    connect_tries = 3  # first rendezvous attempts (each up to `Collective.rendezvous_s`)

    def __init__(
        self, config, num_nodes: int, edge_dim: int, expected_nodes: int | None = None
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("RayGroup: call ray.init (tidegraph.orchestrator.cluster) first")
        self._init_core(config, num_nodes, edge_dim, expected_nodes)
        c = config.cluster
        self.namespace = config.run_name or "tidegraph"
        self.num_rows = 0
        self.ingests: list[tuple] = []  # (lo, hi, feature-rounding state) of every ingest
        self._taken = self._dropped = 0  # ingests in the state last taken; states dropped
        self.replay_source = None  # (lo, hi) -> the stream's events [lo, hi)
        self._stale: set[int] = set()  # trainers whose copy of a replica is not complete
        self._stale_shards: set[int] = set()  # shards rebuilt but not yet checked
        # with node state on the shards and no replica: what changed the shards, in order
        # (ingests, node-state updates as driver-owned copies, resets, loads), since the
        # last two states taken (checkpoints); a lost shard replays it from its snapshot
        self._journal: list[tuple] = []
        self._journal_base = 0  # the position of _journal[0] in the run's journal
        self._journal_cuts: list[int] = []  # positions at the states taken
        self.recovery_budget = RecoveryBudget(config.cluster.max_recoveries)
        self._inflight: collections.deque[PendingLoss] = collections.deque()
        self._pending: list = []  # (seq, updates of every slice) of the last step, not sent
        self._seq = 0  # numbers the node-state updates sent to trainers (applied once each)
        self._window: collections.deque = collections.deque()  # steps not known done
        self._next_step = 0  # the trainers' step count after the steps submitted
        cuda = config.device.startswith("cuda")
        # P shards, and with `cluster.shard_replicas` r > 1 r - 1 read-only replicas of each
        # (bundle P i + p: replica i of partition p), spread over nodes as Ray can
        self.num_copies = replica_count(c)
        # shard actors (hosts): min of them in the SPREAD group, the rest up to max in slots
        # of their own that Ray places as it finds room; P = max partitions are dealt over
        # the hosts there are and move between them as hosts come and go
        self.min_shards, self.max_shards = shard_bounds(c)
        self.shard_target = self.max_shards
        self.shard_bundle = shard_bundle(c)  # every shard actor's slot: CPUs, resources
        self.shard_pg = placement_group(
            [self.shard_bundle] * (self.min_shards * self.num_copies), strategy="SPREAD"
        )
        self.shard_spares: list[tuple] = []  # (placement group, bundle) with no host yet
        self.shard_joiners: dict[int, tuple] = {}  # id(slot's group): (slot, actor, answer)
        self._hosts_named = itertools.count()  # shard actors started later get unique names
        # a placement group per trainer (a slot), up to the most trainers the run may have:
        # Ray claims a new node's resources for the pending ones as they appear
        self.min_trainers, self.max_trainers = trainer_bounds(c)
        self.trainer_gpus = (
            trainer_gpu_share(c, ray.cluster_resources().get("GPU", 0)) if cuda else 0.0
        )
        self.trainer_bundle = trainer_bundle(c, self.trainer_gpus)
        self.target = self.max_trainers
        # the minimum first: slots beyond it, asked for at once, could take the room the
        # shards need (Ray may place later groups first when resources free up)
        self.slots = [self._slot() for _ in range(self.min_trainers)]
        placed = self._wait_placed(self.trainer_bundle)
        extra = [self._slot() for _ in range(self.max_trainers - self.min_trainers)]
        if extra:  # those Ray places at once start with the run; the rest stay pending
            ray.wait([pg.ready() for pg in extra], num_returns=len(extra), timeout=1.0)
            placed += [pg for pg in extra if slot_table(pg).get("state") == "CREATED"]
            self.slots += extra
        try:
            self._start(config, num_nodes, edge_dim, cuda, placed)
        except ray.exceptions.RayError as exc:  # an actor failed in its constructor
            self.shutdown()
            cause = value_error(exc)
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
        # the trainers' store: in this process (on the driver's node, with its fate), or in
        # the coordinator where this driver runs outside the cluster (Ray Client)
        if ray.util.client.ray.is_connected():
            self.store, self.store_address = None, ray.get(self.coordinator.host_store.remote())
        else:
            self.store = StoreHost(ray.util.get_node_ip_address())
            self.store_address = self.store.address()
        self._shard_args = (edge_dim, cuda)
        self.shard_successors: dict[int, tuple] = {}  # p: (slot, actor, first answer)
        self._wanted_moves: set[int] = set()  # partitions an operator asked to move
        self._top_up_shards()
        if self.shard_spares:  # hosts in the slots placed by now start with the run
            ray.wait([pg.ready() for pg, _ in self.shard_spares],
                     num_returns=len(self.shard_spares), timeout=1.0)  # fmt: skip
        slots = [(self.shard_pg, i) for i in range(self.min_shards)]
        slots += [slot for slot in self.shard_spares if slot_table(slot[0]).get("state")
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
        self._trainer_args = (raw, edge_dim)
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
        self._stop_asked = False  # the trainers were asked to stop after a step (a resize)
        self._next_check = 0.0  # monotonic time of the next look at the membership
        self._first_connect()
        ray.get([s.ping.remote() for s in self._all_copies()])
        self._top_up()  # spare trainers (`cluster.spare_trainers`) start in the background
        if spare_count(c):  # their slots are placed in moments when there is room
            ray.wait([pg.ready() for pg in self.spares], num_returns=len(self.spares),
                     timeout=2.0)  # fmt: skip
        self._joiners_up(draining_nodes())
        self._publish()
        log.info(
            "ray group up: %d shards, %d trainers (%d..%d) in namespace %r, node state %s",
            c.shards, self.num_trainers, self.min_trainers, self.max_trainers, self.namespace,
            self.memory_placement,
        )  # fmt: skip

    def _first_connect(self) -> None:
        """The trainers' first rendezvous, again on a new generation when it timed out with
        every trainer alive (a loaded machine can keep one from joining within
        `Collective.rendezvous_s`; there is no recovery yet to retry it). Bounded."""
        for attempt in range(1, self.connect_tries + 1):
            try:
                return self._connect()
            except ray.exceptions.RayTaskError as exc:
                if not group_failure(exc) or attempt == self.connect_tries:
                    raise
                log.warning("trainer group rendezvous %d of %d failed (%s): joining again",
                            attempt, self.connect_tries, type(exc.cause).__name__)  # fmt: skip

    def _all(self, method: str, *args) -> list:
        """`TrainerCore.method(*args)` on every trainer."""
        self._flush()
        return self._robust(lambda: ray.get([t.call.remote(method, *args) for t in self.trainers]))

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

    def take_trace(self) -> list[dict]:
        """The driver's, trainers' and shards' timeline spans since the last call, on the
        driver's clock: an actor on another node is shifted by its clock's offset
        (`clock_offset`)."""
        if not self.config.timeline:
            return []
        self._flush()
        shards = self._all_copies()
        actors = [*self.trainers, *shards]
        parts = self._robust(lambda: ray.get(
            [t.call.remote("take_trace") for t in self.trainers]
            + [s.take_trace.remote() for s in shards]))  # fmt: skip
        if not self.on_driver_node():
            here = ray.get_runtime_context().get_node_id()
            for actor, events in zip(actors, parts, strict=True):
                if events and ray.get(actor.node_id.remote()) != here:
                    shift(events, clock_offset(lambda a=actor: ray.get(a.wall_us.remote()))[0])
        return self.tracer.take() + [e for part in parts for e in part]

    def model_state(self) -> dict:
        self._flush()
        return self._robust(lambda: ray.get(self.trainers[0].model_state.remote()))

    def _shard_events(self) -> list[int]:
        reports = self._robust(lambda: ray.get([s.report.remote() for s in self.shards]))
        return [r["events"] for r in reports]

    @property
    def shard_actors(self) -> int:
        """Actors holding the run's partitions."""
        return len(self._shard_hosts())

    def alive(self) -> tuple[int, int]:
        """(trainers, shards) whose actors the GCS reports alive (a killed actor's name can
        outlive it while handles to it exist, so the lookup is by actor id)."""

        def up(actor) -> bool:
            return actor_state(actor) == "ALIVE"

        hosts = {key: up(actor) for key, (actor, _, _) in self._shard_hosts().items()}
        return sum(map(up, self.trainers)), sum(hosts[s.actor._actor_id.hex()] for s in self.shards)

    def placement(self) -> dict:
        """Node id of every shard and trainer actor (for operators and tests)."""
        actors = {f"tidegraph-shard-{p}": s for p, s in enumerate(self.shards)}
        actors.update({f"tidegraph-trainer-{w}": t for w, t in enumerate(self.trainers)})
        nodes = ray.get([a.node_id.remote() for a in actors.values()])
        return dict(zip(actors, nodes, strict=True))

    def state_dict(self, store: str | None = None, saved_to: str | None = None) -> dict:
        """Every piece's state; `store` (a checkpoint store's URI every actor reaches): each
        shard and trainer writes its large tensors there and answers with refs, so the
        driver never holds the graph or the model replicas. Without one, `saved_to` (the
        store the driver saves this state to, which the actors may not reach): they put
        their state as they would there, and send the chunks it lacks for the driver to
        write (`checkpoint.gathered`), so what a checkpoint writes is the same either way
        (a graph's new edges, node-state rows changed) and nothing else travels."""
        self.drain()
        if store is None and saved_to is not None:
            shards = self._robust(
                lambda: self._written_here(saved_to, self.shards, _shard_gathered)
            )
        else:
            method, args = ("state_dict", ()) if store is None else ("state_chunks", (store,))
            shards = self._robust(
                lambda: ray.get([getattr(s, method).remote(*args) for s in self.shards])
            )  # fmt: skip
        self._taken = len(self.ingests)  # what `checkpointed` drops once this state is saved
        return {
            "journal_pos": self._cut_journal(),
            **self._common_state(),
            # every ingest's span; the feature-rounding state only of those a rebuild from
            # this checkpoint routes again (none yet: the older ones would add 5 KB an
            # ingest to every checkpoint, forever)
            "ingests": [(lo, hi, None) for lo, hi, _ in self.ingests],
            "start_trainers": self.start_trainers,  # W0 of `cluster.scale_rule`
            "shards": shards,
            "trainers": self._trainer_states(store, saved_to),
        }

    def _written_here(self, uri: str, actors: list, ask) -> list[dict]:
        """The states of `actors` put to the store at `uri` by the driver: `ask(actor, uri,
        have)` has each gather the chunks the store lacks (a ref of `(state, chunks)`), and
        the driver writes them."""
        store = CheckpointStore.at(uri)
        have = store.chunk_keys()
        states = []
        for state, chunks in ray.get([ask(a, uri, have) for a in actors]):
            store.write_chunks(chunks, have)
            states.append(state)
        return states

    def checkpointed(self) -> None:
        """The state last taken is saved: a lost shard is rebuilt from it (or a newer one)
        and the ingests after it, so the feature-rounding states of the ingests before it
        (5 KB each, one per ingest for the life of the run) go; their spans stay."""
        for i in range(self._dropped, self._taken):
            lo, hi, _ = self.ingests[i]
            self.ingests[i] = (lo, hi, None)
        self._dropped = max(self._dropped, self._taken)

    def _trainer_states(self, store: str | None, saved_to: str | None = None) -> list:
        """Every trainer's state; with a store, trainer 0 puts its chunks first, so the
        others find the replicas' shared ones written and write only what is theirs; without
        one but with `saved_to`, the same with the driver writing the chunks they send."""
        if store is None and saved_to is None:
            return self._all("state_dict")
        self._flush()

        def get() -> list:
            if store is None:
                first = self._written_here(saved_to, self.trainers[:1], _trainer_gathered)
                return first + self._written_here(saved_to, self.trainers[1:], _trainer_gathered)
            first = ray.get(self.trainers[0].call.remote("state_chunks", store))
            rest = [t.call.remote("state_chunks", store) for t in self.trainers[1:]]
            return [first, *ray.get(rest)]

        return self._robust(get)

    def on_driver_node(self) -> bool:
        """Whether every actor runs on the driver's node: no other node of the cluster is
        alive (asked of the GCS, not of the actors, which may be lost)."""
        here = ray.get_runtime_context().get_node_id()
        return {n["NodeID"] for n in ray.nodes() if n["Alive"]} == {here}

    def load_state_dict(self, state: dict, store: str | None = None) -> None:
        """`store`: the shards' and trainers' states may hold refs to the checkpoint store
        there; each actor reads its own (a checkpoint's bulk never passes through the
        driver)."""
        self.drain()
        self._flush()
        self._load_common_state(state)
        self.ingests = list(state["ingests"])
        self._taken = self._dropped = len(self.ingests)  # the checkpoint's: spans only
        self._journal, self._journal_cuts = [], []
        self._journal_base = state.get("journal_pos", 0)
        method, args = ("load_state_dict", ()) if store is None else ("load_chunks", (store,))
        ray.get([getattr(s, method).remote(x, *args) for p, x in enumerate(state["shards"])
                 for s in self._copies(p)])  # fmt: skip
        self.start_trainers = state.get("start_trainers", self.start_trainers)
        states = state["trainers"]
        if len(states) != self.num_trainers:  # saved at another size: replicas are equal
            log.info("state of %d trainers loaded into %d", len(states), self.num_trainers)
            states = [states[0]] * self.num_trainers
        ray.get([t.call.remote(method, x, *args) for t, x in zip(self.trainers, states,
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
        for actor in {id(a): a for a in map(actor_of, actors)}.values():
            ray.kill(actor)
        if getattr(self, "coordinator", None) is not None:
            ray.kill(self.coordinator)
        if getattr(self, "store", None) is not None:
            self.store.close()
            self.store = None
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


# `RayGroup._written_here`'s ask of a shard actor, and of a trainer actor (through its `call`)
def _shard_gathered(shard, uri: str, have: set):
    return shard.state_gathered.remote(uri, have)


def _trainer_gathered(trainer, uri: str, have: set):
    return trainer.call.remote("state_gathered", uri, have)
