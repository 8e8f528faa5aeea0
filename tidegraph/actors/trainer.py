"""`TrainerActor`: a `TrainerCore` in its own process, wired to shard actors and to its group."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import ray
import torch

from tidegraph.actors.segments import SegmentView
from tidegraph.actors.shard import RemoteShard
from tidegraph.comm.collective import Collective
from tidegraph.recovery.updatelog import UpdateLog, read_step
from tidegraph.rng import seed_for
from tidegraph.runtime import set_determinism
from tidegraph.storage.partition import build_partitioner
from tidegraph.timeline import wall_us
from tidegraph.training.config import RunConfig
from tidegraph.training.group import build_trainer

__all__ = ["ALL_SLICES", "TrainerActor"]

# marks a `before` of (seq, ALL_SLICES, every slice's updates as one list)
ALL_SLICES = "all-slices"

log = logging.getLogger(__name__)


class _Trainer:
    def __init__(
        self, runtime: dict, config: dict, rank: int, world: int, shards: list,
        num_nodes: int, edge_dim: int, sharded: bool, incarnation: int = 0,
    ) -> None:  # fmt: skip
        """`incarnation`: how many trainers of this rank were lost before this one."""
        set_determinism(**runtime)
        self.incarnation = incarnation
        self.num_nodes = num_nodes  # node ids the tables have room for
        self.config = RunConfig.from_dict(config)
        c = self.config.cluster
        self.rank, self.world = rank, world
        self.sharded = sharded
        self.partitioner = build_partitioner(c.partitioner, c.shards)
        proxies = [RemoteShard(h) for h in shards]
        # shards on this node are sampled here, over their segments in the object store
        here = ray.get_runtime_context().get_node_id()
        nodes = ray.get([h.node_id.remote() for h in shards])
        self.views = {
            p: self._view(p) for p, node in enumerate(nodes) if node == here and c.local_sampling
        }  # fmt: skip
        self.proxies = proxies
        hop_samplers = [self.views.get(p, proxy) for p, proxy in enumerate(proxies)]
        self.core = build_trainer(
            self.config, rank, proxies, self.partitioner.owner, num_nodes, edge_dim, sharded,
            gather=_gather, hop_samplers=hop_samplers,
        )  # fmt: skip
        self.collective = None
        self.coordinator = None
        self._asked = None  # rank 0's last report: whether the driver asks the group to stop
        self.pass_results: list = []
        self.applied_seq = -1  # the driver's number of the last node-state updates applied
        self.update_log: UpdateLog | None = None  # rank 0 writes it (`set_update_log`)
        self.replay_dir, self.replay_steps = None, frozenset()
        self.replayed, self.replay_s = 0, 0.0

    def set_update_log(self, directory: str | None, every: int, replay=()) -> None:
        """Log every `every`-th training step to `directory` (rank 0; 0: no log), and take
        the steps in `replay` from the log there instead of computing them."""
        if self.update_log is not None:
            self.update_log.close()
        self.update_log = None
        if directory is not None and every > 0 and self.rank == 0:
            self.update_log = UpdateLog(directory, every)
        self.replay_dir, self.replay_steps = directory, frozenset(replay)

    def set_lr(self, lr: float) -> None:
        """The learning rate from now on (`cluster.scale_rule` after a resize), also for
        optimizers made later."""
        self.core.config.train.lr = lr
        for group in self.core.optimizer.param_groups:
            group["lr"] = lr

    def replay_stats(self) -> dict:
        """Steps replayed from the update log and their seconds; records written, bytes."""
        out = {"replayed": self.replayed, "replay_s": self.replay_s}
        if self.update_log is not None:
            self.update_log.flush()
            out.update(logged=self.update_log.records, log_bytes=self.update_log.bytes)
        return out

    def _replay(self, step: int) -> tuple:
        """Step `step` from its update-log record: the optimizer steps with the logged
        gradient; returns the logged loss and node-state updates (applied by the caller)."""
        t0 = time.perf_counter()
        record = read_step(self.replay_dir, step)
        core = self.core
        core.optimizer.flat_grad.copy_(record["grad"])
        core.optimizer.step()
        core.steps += 1
        self.replayed += 1
        self.replay_s += time.perf_counter() - t0
        return record["loss"], record["updates"]

    def set_rank(self, rank: int, world: int, incarnation: int | None = None) -> None:
        """Become rank `rank` of `world` (a resize renumbers the members, a spare takes a
        lost trainer's rank as its `incarnation`-th replacement; `connect` next)."""
        self.rank, self.world = rank, world
        self.core.rank = rank
        self.core.tracer.name = f"trainer {rank}"
        if incarnation is not None:
            self.incarnation = incarnation

    def connect(
        self, address: tuple[str, int], generation: int, coordinator=None, every_s: float = 0.5
    ) -> int:
        """Join the trainer group of `generation` (all ranks call this together);
        `coordinator`: where rank 0 reports a pass's progress, every `every_s` seconds."""
        self.report_s = every_s
        timeout = self.config.cluster.collective_timeout_s
        self.collective = Collective(address, generation, self.rank, self.world, timeout,
                                     comm=self.config.comm, seed=self.config.seed)  # fmt: skip
        self.coordinator = coordinator if self.rank == 0 else None
        return self.rank

    def _progress(self, steps: int, last: float) -> float:
        """Report `steps` finished to the coordinator if the last report is old enough, and
        take up the driver's request to stop (the answer to a report, read without waiting)
        as this member's vote for the next step."""
        if self.coordinator is None:
            return last
        if self._asked is not None and ray.wait([self._asked], timeout=0)[0]:
            self.core.vote, self._asked = int(ray.get(self._asked)), None
        now = time.monotonic()
        if now - last < self.report_s:
            return last
        self._asked = self.coordinator.report.remote(steps)
        return now

    def _apply_before(self, before: tuple) -> None:
        """`before`: () or (seq, the updates of every slice of one step): node-state
        updates the driver numbered, applied once each (a step run again after a recovery
        carries the updates a survivor may have applied already: it skips them)."""
        if before and before[0] > self.applied_seq:
            parts = before[1:]
            if parts[:1] == (ALL_SLICES,):  # one trainer's copy of every slice's updates
                parts = parts[1]
            self.core.apply_updates(list(parts))
            self.applied_seq = before[0]

    def _begin_pass(self, before: tuple) -> float:
        self._apply_before(before)
        self.pass_results, self._asked = [], None
        self.core.vote = self.core.group_vote = 0
        return time.monotonic()

    def _stopping(self, group_vote: int) -> bool:
        """Whether the group agreed to stop after this step (every member saw the same
        votes in the step's exchange); a stopped pass returns the steps done so far."""
        if not group_vote:
            return False
        self.core.vote = self.core.group_vote = 0
        return True

    def _view(self, part: int) -> SegmentView:
        return SegmentView(self.config.sampler.strategy,
                           seed_for(self.config.seed, "sampler", part))  # fmt: skip

    def replace_shard(self, part: int, handle) -> None:
        """Use the rebuilt shard `part` (`handle`): requests go to it, and it is sampled in
        place when it lives on this node (its segments arrive with the next `ingested`)."""
        self.proxies[part].handle = handle
        here = ray.get_runtime_context().get_node_id()
        if ray.get(handle.node_id.remote()) == here and self.config.cluster.local_sampling:
            self.views[part] = self._view(part)
        else:
            self.views.pop(part, None)
        self.core.sampler.shards[part] = self.views.get(part, self.proxies[part])

    def ingested(
        self, num_nodes: int, num_rows: int, partition: dict | None, segments: list | None = None
    ) -> None:
        """After shards ingested a batch: grow node tables, know the new feature rows, for a
        stateful partitioner the new node placements, and same-node shards' segments."""
        for p, view in self.views.items():
            if segments is not None:
                view.update(segments[p])
        if partition is not None:
            self.partitioner.load_state_dict(partition)
        if self.core.edge_cache is not None:
            self.core.edge_cache.store.set_num_rows(num_rows)
        self.core.grow(num_nodes)
        self.num_nodes = max(self.num_nodes, num_nodes)

    def train_and_step(
        self, ev, weight, neg, num_observe: int, global_size: int, start, *before
    ):  # fmt: skip
        """A slice of `schedule.train_slices` (`start`: the global batch's start); `before`:
        the previous step's node-state updates of every slice, applied first (one task per
        step instead of two; `_apply_before`). With replicated node state and several
        trainers the slices' losses and updates are exchanged within the step (before the
        optimizer steps), so every trainer returns the batch's loss and every slice's
        updates: any one that finished the step holds all of it (`RayGroup._redo`)."""
        self._apply_before(before)
        gather = self.world > 1 and not self.sharded
        with self._leaving_on_error():  # peers in the step's collectives fail at once
            loss, updates = self.core.train_and_step(
                ev, weight, neg, num_observe, global_size, self._armed(self.collective),
                gather, start,
            )  # fmt: skip
        self._fault("after_step", self.core.steps - 1)
        return loss, updates if gather or self.sharded else [updates]

    def train_pass(self, slices: list, *before) -> list[float] | None:
        """Every step of a training pass: per step this trainer's slice, the all-reduce, the
        optimizer step, then the node-state updates of all slices, gathered from the group
        in rank (= slice) order with the slices' losses. Rank 0 returns the batches'
        losses; every rank keeps them in `pass_results` (a survivor reports them when the
        group lost a member midway, see `recovery_report`). When the group votes to stop
        (the driver resizes it), the pass ends after that step with the losses so far."""
        reported = self._begin_pass(before)
        gather = self.world > 1
        with self._leaving_on_error():
            for ev, weight, neg, num_observe, global_size, start in slices:
                step = self.core.steps
                if step in self.replay_steps:
                    loss, updates = self._replay(step)
                else:
                    collective = self._armed(self.collective)
                    loss, updates = self.core.train_and_step(
                        ev, weight, neg, num_observe, global_size, collective, gather, start
                    )
                    updates = updates if gather else [updates]
                    if self.update_log is not None and self.update_log.wants(step):
                        self.update_log.record(step, self.core.optimizer.flat_grad, updates,
                                               loss)  # fmt: skip
                self.core.apply_updates(updates)
                self._fault("after_step", self.core.steps - 1)
                self.pass_results.append(loss)
                reported = self._progress(len(self.pass_results), reported)
                if self._stopping(self.core.group_vote if gather else self.core.vote):
                    break
        return self.pass_results if self.rank == 0 else None

    def eval_pass(self, slices: list, observe: bool, *before) -> list | None:
        """Every batch of an evaluation pass: the (pos, neg) scores of every slice, gathered
        with the slices' node-state updates (applied after each batch with `observe`). Rank
        0 returns the batches' scores; every rank keeps them in `pass_results`; it stops
        early like `train_pass`."""
        reported = self._begin_pass(before)
        with self._leaving_on_error():
            for ev, neg in slices:
                start = self._batch_start(ev)
                if len(ev):
                    pos, negl, updates = self.core.eval_slice(ev, neg, observe, start)
                else:
                    pos, negl, updates = None, None, None
                t0 = time.perf_counter()
                parts = self._gather((pos, negl, updates, self.core.vote))
                self.core.tracer.add("exchange", t0, time.perf_counter())
                if observe:
                    self.core.apply_updates([u for _, _, u, _ in parts])
                self.pass_results.append(_scores(parts))
                reported = self._progress(len(self.pass_results), reported)
                if self._stopping(max(v for *_, v in parts)):
                    break
        return self.pass_results if self.rank == 0 else None

    def _batch_start(self, ev) -> float | None:
        """With `sampler.history: batch` and several trainers, the earliest time of the
        evaluation batch this slice is part of (a collective: a slice knows only its own
        events); otherwise None (a slice's own start is its batch's)."""
        if self.world == 1 or self.config.sampler.history != "batch":
            return None
        own = float(ev.t.min()) if len(ev) else float("inf")
        start = min(self._gather(own))
        return None if start == float("inf") else start

    @contextlib.contextmanager
    def _leaving_on_error(self):
        """A step that fails here (a shard lost mid-request, say) leaves the trainer group,
        so the peers waiting for it in a collective fail at once instead of at the timeout;
        the driver rebuilds the group when it recovers."""
        try:
            yield
        except BaseException:
            if self.collective is not None:
                self.collective.close()
            raise

    def _fault(self, at: str, step: int) -> None:
        """Die here if `cluster.faults` says so (SIGKILL: no cleanup, like a lost node)."""
        for fault in self._faults():
            if (fault["step"], fault["at"]) == (step, at):
                log.warning("fault injected: trainer %d dies at %s of step %d", self.rank, at,
                            step)  # fmt: skip
                os.kill(os.getpid(), signal.SIGKILL)

    def _faults(self) -> list[dict]:
        """The faults for this rank and incarnation (a replacement does not die again of
        its predecessor's fault)."""
        me = (self.rank, self.incarnation)
        return [f for f in self.config.cluster.faults
                if (f["trainer"], f.get("incarnation", 0)) == me]  # fmt: skip

    def _armed(self, collective):
        """`collective`, dying before its all-reduce if a fault is due there this step; the
        "forward" fault fires now."""
        self._fault("forward", self.core.steps)
        due = any((f["step"], f["at"]) == (self.core.steps, "allreduce") for f in self._faults())
        return _DiesBeforeAllreduce(collective, self) if due else collective

    def _gather(self, obj) -> list:
        """Every trainer's `obj` of this step, in rank order (a collective)."""
        if self.world == 1:
            return [obj]
        return self.collective.all_gather_tensors(obj, self.core.device)

    def recovery_report(self) -> dict:
        """What this trainer finished of the pass its group was running when it lost a
        member: the results of its whole steps (their count is where it stands); the
        failed step's partial work is dropped."""
        self.core.abort_step()
        return {"done": len(self.pass_results), "results": self.pass_results,
                "steps": self.core.steps}  # fmt: skip

    def replica_state(self) -> dict:
        """Everything a replacement needs to be this replica: parameters, optimizer,
        replicated node state, feature cache, the last node-state updates applied."""
        return {"core": self.core.state_dict(), "applied_seq": self.applied_seq}

    def nodes(self) -> int:
        return self.num_nodes

    def load_replica(self, state: dict, results: list) -> None:
        """Become a copy of a replica that stands `len(results)` steps into the pass."""
        self.core.abort_step()
        self.core.load_state_dict(state["core"])
        self.applied_seq = state["applied_seq"]
        self.pass_results = list(results)

    def pid(self) -> int:
        return os.getpid()

    def wall_us(self) -> float:
        return wall_us()

    def eval_slice(self, ev, neg, observe: bool, start, *before):
        """`start`: the global batch's start (`sampler.history: batch`; None: the slice's)."""
        self._apply_before(before)
        return self.core.eval_slice(ev, neg, observe, start)

    def apply_updates(self, *before) -> None:
        """`before` as `_apply_before` takes it."""
        self._apply_before(before)

    def call(self, method: str, *args):
        """Any other `TrainerCore` method (state, node state, optimizer, cache)."""
        return getattr(self.core, method)(*args)

    def local_shards(self) -> list[int]:
        """Shards this trainer samples in place (same node)."""
        return sorted(self.views)

    def comm_totals(self) -> dict | None:
        """Gradient compression's totals (bytes this rank sent, ...), None without it."""
        return _comm_totals(self.core)

    def grad_values(self) -> int:
        return self.core.optimizer.flat.numel()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def cache_stats(self) -> dict | None:
        cache = self.core.edge_cache
        return None if cache is None else cache.stats()

    def model_state(self) -> dict:
        return self.core.model_state()


def _gather(answers: list) -> list:
    """Wait for the object refs among `answers` at once; local answers pass through."""
    refs = [a for a in answers if isinstance(a, ray.ObjectRef)]
    got = iter(ray.get(refs)) if refs else iter(())
    return [next(got) if isinstance(a, ray.ObjectRef) else a for a in answers]


TrainerActor = ray.remote(_Trainer)


def _scores(parts: list) -> tuple:
    """One batch's (pos, neg) scores from the slices' (pos, neg, updates), in slice order."""
    kept = [(p, n) for p, n, *_ in parts if p is not None]
    return torch.cat([p for p, _ in kept]).cpu(), torch.cat([n for _, n in kept]).cpu()


class _DiesBeforeAllreduce:
    """A collective whose all-reduce kills the process first (fault injection)."""

    def __init__(self, collective, trainer: _Trainer) -> None:
        self._collective, self._trainer = collective, trainer

    def allreduce_sum_(self, x):
        self._trainer._fault("allreduce", self._trainer.core.steps)
        return self._collective.allreduce_sum_(x)

    def __getattr__(self, name: str):
        return getattr(self._collective, name)


def _comm_totals(core) -> dict | None:
    sync = getattr(core, "grad_sync", None)
    return sync.totals() if hasattr(sync, "totals") else None
