"""Single-process continuous learning (GNNFlow's evaluate-then-retrain loop) and offline runs.

`ContinualLearner` runs, for one `RunConfig`:
- phase 1 (`run_phase1`): ingest the first `train_fraction` of the stream; for `train.epochs`
  epochs reset node state and train over its first part in time order, then evaluate on its
  last `val_fraction` (recording those events in node state);
- then one `step()` per increment: ingest it, evaluate on it first (AP, AUC with one negative,
  MRR with `eval_negatives`), then retrain for `retrain_epochs` on it plus `replay_ratio` replayed
  old events per new event (uniform or importance-weighted), then measure forgetting as AP on a
  sample of older events. Each step's metrics are one JSON line in `out_dir/metrics.jsonl`.

Node state (TGN memory) during retraining: each epoch restarts from the state saved before the
increment's evaluation and replays the increment in time order, so memory never sees an event
twice or out of order; replayed old events are scored against the current memory without being
recorded in it (their neighbourhoods are still sampled at their own times, so no graph leakage).

Shards and trainers: the learner drives a `LocalGroup` of `cluster.shards` graph shards and
`cluster.trainers` data-parallel trainers in this process (P = W = 1 by default). It owns the
stream, the schedule cursor and the per-step randomness (negatives, replay choice, forgetting
probes, each a named seed stream, drawn per global step for the whole batch); the group owns
the graph, features, models and optimizers. W trainers at global batch B give what one gives at
B, up to float summation order.

State: `state_dict()` is one piece per owner ("orchestrator": cursor, generators, negative pool,
history; "group": partitioner, each shard, each trainer), each loadable alone, and a learner
built from the same config that loads it continues bitwise as the original would on CPU.

Determinism: a seed fixes every draw (model init, sampler, negatives, replay, forgetting
samples; generators other than the sampler's live on the host, so draws match across devices).
Deterministic kernels and thread counts are process-wide switches that entry points set with
`tidegraph.runtime.set_determinism`; the learner itself changes no global state.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from tidegraph.comm.gradsync import comm_record
from tidegraph.ops import resolved_slot_precision
from tidegraph.rng import load_generator_state, seed_for
from tidegraph.rng import stream as seed_stream
from tidegraph.storage.events import EventBatch
from tidegraph.storage.idmap import IdMap
from tidegraph.training.config import RunConfig
from tidegraph.training.data import Stream, stream_for
from tidegraph.training.evaluation import Evaluation
from tidegraph.training.group import LocalGroup
from tidegraph.training.history import EventHistory, windows
from tidegraph.training.metrics import average_precision
from tidegraph.training.pass_windows import run_pass
from tidegraph.training.progress import begin_pass, close_pass_bar, pass_bar
from tidegraph.training.records import RecordLog, cluster_record
from tidegraph.training.sampling import NegativeSampler, build_replay, node_degree
from tidegraph.training.schedule import Cursor, Schedule, Unit

__all__ = ["ContinualLearner"]

log = logging.getLogger(__name__)


class ContinualLearner:
    """Phase 1, then `step()` per increment; plain class, state in `state_dict()`."""

    def __init__(
        self,
        config: RunConfig,
        stream: Stream | None = None,
        group=None,
        event_log=None,
        live: bool = False,
    ) -> None:
        """`group`: a callable (config, num_nodes, edge_dim, expected_nodes=...) -> group;
        None: `LocalGroup` (the "local" backend; a run on Ray actors passes
        `tidegraph.orchestrator.make_group`, which builds the group `cluster.backend` names).
        `event_log`: an `EventLog` every ingested batch is made durable in before routing.
        `live`: the stream grows: `stream` is phase 1, and `append` adds increments."""
        self.event_log = event_log
        self.config = config
        self.device = torch.device(config.device)
        self.stream = stream or stream_for(config.data)
        if self.stream.idmap is None:  # a stream made without stream_of: its ids are dense
            self.stream.idmap = IdMap(self.stream.num_nodes)
        seed = config.seed
        c = config.continual
        # the window in memory; old events from the log, a bounded sample of them to replay
        self.history_events = EventHistory(self.stream, event_log, live, c.replay_capacity,
                                           seed_for(seed, "reservoir"), c.replay == "importance",
                                           self._block, c.window_events)  # fmt: skip
        # node tables start empty and grow with the nodes seen; the placement rule sizes node
        # state by the stream's node count
        make = group or _local_group(config)
        self.group = make(config, 0, self.stream.edge_dim, expected_nodes=self.stream.num_nodes)
        # a group that rebuilds lost shards routes the stream's batches again, read back from
        # the durable log (from memory for the block under way)
        self.group.replay_source = self.history_events.read
        self.num_nodes = 0  # one past the largest node id ingested
        self.slot_precision = resolved_slot_precision(config.model.slot_precision, self.device)
        log.info("attention slot projections in %s on %s", self.slot_precision, self.device)
        self.negatives = NegativeSampler(seed_for(seed, "negatives"))
        self.replay = build_replay(
            config.continual.replay, seed_for(seed, "replay"), config.continual.importance_floor
        )
        self.forget_gen = seed_stream(seed, "forgetting")
        t = config.train
        self.train_negatives, self.eval_negatives = t.train_negatives, t.eval_negatives
        self.tgb = config.eval.protocol == "tgb"
        self.evaluation = Evaluation(self)  # what evaluation units score against
        times = self.stream.spool if self.stream.spool is not None else self.events.t
        self.schedule = Schedule(times, config.continual, t.batch_size, t.epochs, live)
        self.val_start, self.phase1_end = self.schedule.val_start, self.schedule.phase1_end
        self.bounds = self.schedule.increments
        self.cursor = Cursor()
        self.pass_state: dict = {}  # accumulators of the pass under way (checkpointed)
        self.history: list[dict] = []
        self.rebatches: list[tuple[int, int]] = []  # (unit, train batch): `_follow_batch`
        self.records = RecordLog(config, self.group)  # metrics.jsonl

    # replica 0's pieces (all replicas are identical after every step)
    @property
    def model(self):
        return self.group.trainers[0].model

    @property
    def optimizer(self):
        return self.group.trainers[0].optimizer

    @property
    def edge_cache(self):
        return self.group.trainers[0].edge_cache

    @property
    def ingested(self) -> int:
        return self.cursor.ingested

    @property
    def offset(self) -> int:
        return self.cursor.increment

    @property
    def phase1_done(self) -> bool:
        return self.cursor.phase1_done

    # ---- public ---------------------------------------------------------------------------

    @property
    def num_increments(self) -> int:
        return len(self.bounds)

    @property
    def done(self) -> bool:
        return self.cursor.phase1_done and self.cursor.increment >= len(self.bounds)

    def run(self) -> dict:
        if not self.phase1_done:
            self.run_phase1()
        while not self.done:
            self.step()
        return self.summary()

    def run_phase1(self) -> dict:
        """Phase 1's units: ingest, then per epoch a training and a validation pass."""
        if self.cursor.phase1_done:
            raise RuntimeError("ContinualLearner.run_phase1: phase 1 is done")
        record = self._run_until("phase_end")
        self._follow_batch()
        return record

    def step(self) -> dict:
        """The next increment's units: ingest, evaluate, retrain; returns its metrics."""
        if not self.cursor.phase1_done:
            raise RuntimeError("ContinualLearner.step: run_phase1() first")
        if self.done:
            raise StopIteration("ContinualLearner.step: the stream is exhausted")
        record = self._run_until("increment_end")
        self._follow_batch()
        return record

    def _follow_batch(self) -> None:
        """After an increment: when the group's global training batch changed with its size
        (`cluster.scale_rule` linear or sqrt), the later increments train with it."""
        batch = self.group.train_batch_size
        if batch == self.schedule.train_batch or self.done:
            return
        log.info("training batches of %d events from the next increment (was %d)", batch,
                 self.schedule.train_batch)  # fmt: skip
        self.schedule.rebatch(self.cursor.unit, batch)
        self.rebatches.append((self.cursor.unit, batch))

    # ---- units ------------------------------------------------------------------------------

    def _run_until(self, kind: str) -> dict:
        while True:
            unit = self.schedule.unit(self.cursor.unit)
            if unit.kind in ("train", "eval") and unit.part == 0 and self._whole_passes():
                run_pass(self, unit)
                continue
            result = self.run_unit(unit)
            if unit.kind == kind:
                return result

    def _whole_passes(self) -> bool:
        """Whether the group runs a whole pass per call (Ray trainers that exchange node-state
        updates among themselves, so the driver sends a pass's batches once)."""
        return self.group.runs_passes

    def _windows(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """[lo, hi) cut in ranges of at most a window of events (`continual.window_events`)."""
        return windows(lo, hi, self.config.continual.window_events)

    def _train_inputs(self, u: Unit, ps: dict):
        """(events, weights, negatives, new events) of training unit `u`."""
        ev = self._events(u.lo, u.hi)
        weight, n_new = None, len(ev)
        if u.increment >= 0:  # retraining: the batch plus its share of the epoch's replay
            part = ps["replay_parts"][u.part]
            rep = self.history_events.pool().select(ps["replay_pos"][part])
            # replayed events carry no labels nor features: trainers read features by eid
            ev.edge_feat = ev.label = None
            weight = torch.cat([torch.ones(len(ev)), ps["replay_weight"][part]])
            ev = EventBatch.cat([ev, rep])
        return ev, weight, self.negatives.sample(len(ev), self.train_negatives), n_new

    def run_unit(self, u: Unit) -> dict | None:
        """Execute unit `u` (the cursor's next one) and advance the cursor past it."""
        if u != self.schedule.unit(self.cursor.unit):
            raise RuntimeError(f"run_unit: {u} is not the cursor's next unit")
        out = getattr(self, f"_unit_{u.kind}")(u, self.pass_state)
        self.cursor.unit += 1
        return out

    def _unit_ingest(self, u: Unit, ps: dict) -> None:
        ps.clear()
        ps["t0"] = time.perf_counter()
        self.ingest(u.lo, u.hi)
        if u.increment < 0:
            val_start, end = self.val_start, self.phase1_end
            record = {"phase": "phase1", "train_events": val_start, "val_events": end - val_start}
            record.update(cluster_record(self.group))
            part = self.group.partition(self.tally)
            record.update({f"partition_{k}": v for k, v in part.items() if k != "shard_events"})
            log.info("partition: %s", part)
            ps["record"] = record

    def _unit_reset(self, u: Unit, ps: dict) -> None:
        self.group.reset_state()

    def _unit_snapshot(self, u: Unit, ps: dict) -> None:
        ps["before"] = self.group.node_state()

    def _unit_train(self, u: Unit, ps: dict) -> None:
        begin_pass(ps, self.schedule, self.cursor.unit, u, self.config.progress)
        ev, weight, neg, n_new = self._train_inputs(u, ps)
        # a Ray group answers with a pending loss: its steps queue up at the trainers while
        # the driver prepares the next ones; losses are read at the end of the pass
        ps["losses"].append((self.group.train_step(ev, weight, neg, n_new), len(ev)))
        ps["loss_events"] += len(ev)
        self.cursor.step += 1
        pass_bar(ps, len(ev))

    def _unit_train_end(self, u: Unit, ps: dict) -> None:
        total = sum(_value(loss) * n for loss, n in ps.pop("losses"))
        ps["loss"] = total / max(ps["loss_events"], 1)
        ps["train_rate"] = close_pass_bar(ps, ps["loss_events"])

    def _unit_eval(self, u: Unit, ps: dict) -> None:
        begin_pass(ps, self.schedule, self.cursor.unit, u, self.config.progress)
        ev, neg = self.evaluation.inputs(u)
        with self.group.tracer.span("evaluation", events=len(ev)):
            p, n = self.group.eval_step(ev, neg, True)
        self.evaluation.scores(u, p, n, ps)
        pass_bar(ps, u.hi - u.lo)

    def _unit_eval_end(self, u: Unit, ps: dict) -> None:
        close_pass_bar(ps, u.hi - u.lo)
        metrics = self.evaluation.metrics(u, ps)
        if u.increment < 0:
            log.info("phase 1 epoch %d: loss %.4f val %s", u.epoch + 1, ps["loss"], _fmt(metrics))
            ps["record"].update(
                {"epoch": u.epoch + 1, "loss": ps["loss"], "train_events_per_s": ps["train_rate"]}
            )
            ps["record"].update({f"val_{k}": v for k, v in metrics.items()})
        else:
            ps["metrics"] = metrics
            ps["eval_s"] = time.perf_counter() - ps["t0"]

    def _unit_retrain_begin(self, u: Unit, ps: dict) -> None:
        if self.config.continual.fresh_optimizer:
            self.group.new_optimizers()
        ps["t_train"] = time.perf_counter()
        # GNNFlow's restoration: seed the feature caches with the round's edges
        self.group.restore_caches(torch.arange(u.lo, u.hi))  # eids are stream positions
        ps.update(loss=float("nan"), replayed=0)

    def _unit_restore(self, u: Unit, ps: dict) -> None:
        self.group.load_node_state(ps["before"])

    def _unit_replay(self, u: Unit, ps: dict) -> None:
        m = int(round(self.config.continual.replay_ratio * (u.hi - u.lo)))
        h = self.history_events
        changed = None  # the increment's events per node, for importance replay
        if self.config.continual.replay == "importance":
            changed = torch.zeros(0, dtype=torch.int64)
            for lo, hi in self._windows(u.lo, u.hi):
                changed = node_degree(changed, self._events(lo, hi), h.degree.numel())
        pos, weight = self.replay.select(h.pool(), changed, h.degree, m)
        n_batches = -(-(u.hi - u.lo) // self.schedule.train_batch)
        ps.update(replay_pos=pos, replay_weight=weight, replayed=int(pos.numel()))
        ps["replay_parts"] = torch.tensor_split(torch.arange(pos.numel()), n_batches)

    def _unit_phase_end(self, u: Unit, ps: dict) -> dict:
        record = ps.pop("record")
        for lo, hi in self._windows(0, self.phase1_end):
            self._learned(self._events(lo, hi))
        self.cursor.phase1_done = True
        self.history_events.forget()
        self._log(record)
        return record

    def _unit_increment_end(self, u: Unit, ps: dict) -> dict:
        c = self.config.continual
        k, start, end = u.increment, u.lo, u.hi
        train_s = time.perf_counter() - ps["t_train"]
        n_replay = ps["replayed"]
        record = {
            "phase": "increment",
            "increment": k,
            "events": end - start,
            "t_start": float(self._events(start, start + 1).t[0]),
            "t_end": float(self._events(end - 1, end).t[0]),
            **ps["metrics"],
            "loss": ps["loss"],
            "replayed": n_replay,
            "old_ap": self._old_ap(start),
            "eval_events_per_s": (end - start) / ps["eval_s"],
            "train_events_per_s": (end - start + n_replay) * c.retrain_epochs / max(train_s, 1e-9),
        }
        stats = self.group.cache_stats()
        if stats is not None:  # cumulative feature-cache figures, for metrics
            for key in ("hit_rate", "bytes_h2d", "lookup_seconds", "capacity"):
                record[f"edge_cache_{key}"] = stats[key]
        for lo, hi in self._windows(start, end):
            self._learned(self._events(lo, hi))
        self.cursor.increment += 1
        self.history_events.forget()
        ps.clear()
        self._log(record)
        return record

    def _learned(self, ev: EventBatch) -> None:
        """Events of a block just learned: old from now on (and TGB's history)."""
        self.history_events.learned(ev)
        self.evaluation.learned(ev)

    def append(self, events: EventBatch) -> None:
        """Events that arrived on a live stream: the next increment (eids continue the
        stream's positions); their external ids, as a source or the durable log (which holds
        external ids) gives them, become dense through the stream's id map."""
        lo = self.end
        events.eid = torch.arange(lo, lo + len(events))
        if self.stream.idmap.kind != "int":
            raise ValueError("append: a stream of string ids cannot grow (follow int ids)")
        events.src, events.dst = self.stream.idmap.map_events(events.src, events.dst)
        self.history_events.append(events)
        top = int(torch.maximum(events.src.max(), events.dst.max())) + 1
        self.stream.num_nodes = max(self.stream.num_nodes, top)
        self.schedule.add_increment(lo, self.end)

    def append_learned(self, lo: int, hi: int) -> None:
        """An increment learned before the checkpoint a run resumes from: its bounds only (its
        events are in the durable log, and old)."""
        self.history_events.append_learned(lo, hi)
        self.schedule.add_increment(lo, hi)

    # the window and what is kept of old events (`EventHistory`)
    events = property(lambda self: self.history_events.events)
    base = property(lambda self: self.history_events.base)
    end = property(lambda self: self.history_events.end)
    reservoir = property(lambda self: self.history_events.reservoir)
    tally = property(lambda self: self.history_events.tally)

    def _events(self, lo: int, hi: int) -> EventBatch:
        return self.history_events.read(lo, hi)

    def _block(self) -> tuple[int, int]:
        """The bounds of the block under way (phase 1, or the next increment; after the last,
        an empty block at the end): the events before it are old."""
        if not self.cursor.phase1_done:
            return 0, self.phase1_end
        if self.cursor.increment < len(self.bounds):
            return self.bounds[self.cursor.increment]
        end = self.bounds[-1][1] if self.bounds else self.phase1_end
        return end, end

    def summary(self) -> dict:
        """Mean metrics over increments, and forgetting: first AP minus AP now, per increment.

        No side effects on training: the probes draw from copies of the generators."""
        inc = [r for r in self.history if r["phase"] == "increment"]
        out = {"model": self.config.model.name, "dataset": self.stream.name}
        out.update(cluster_record(self.group))
        # gradient compression: the resolved `comm` settings and trainer 0's totals (bytes per
        # rank; every rank sends as much and decodes the same bits)
        out["comm"] = comm_record(self.config.comm, self.group.comm_state())
        out["partition"] = self.group.partition(self.tally)
        if inc:
            keys = ["ap", "auc", "mrr", "old_ap"]
            if self.tgb:  # MRR above is TGB's; its Hits@k too
                keys.append(f"hits@{self.config.eval.hits_k}")
                out["protocol"] = self.config.eval.tgb_record()
            for key in keys:
                out[key] = sum(r[key] for r in inc) / len(inc)
            saved = self.negatives.generator.get_state(), self.forget_gen.get_state()
            samplers = self.group.sampler_states()
            now = [self._ap_on(*self.bounds[r["increment"]]) for r in inc[:-1]]
            self.negatives.generator.set_state(saved[0])
            self.forget_gen.set_state(saved[1])
            self.group.load_sampler_states(samplers)
            drops = [r["ap"] - a for r, a in zip(inc[:-1], now, strict=True)]
            out["forgetting"] = sum(drops) / len(drops) if drops else 0.0
            # per increment: its AP when evaluated, on the same events at the end, the drop
            out["forgetting_per_increment"] = [
                {"increment": r["increment"], "ap": r["ap"], "ap_at_end": a, "drop": d}
                for r, a, d in zip(inc[:-1], now, drops, strict=True)
            ]
        if self.config.out_dir:
            path = Path(self.config.out_dir) / "summary.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=2))
        return out

    # ---- state ----------------------------------------------------------------------------

    def state_dict(self, store: str | None = None, own_store: str | None = None) -> dict:
        """{"orchestrator": ..., "group": {"partitioner", "shards", "trainers"}}; `store`: a
        checkpoint store the group's pieces write their large tensors to (refs in their
        place), where they can; `own_store`: the one this state is saved to (the replay
        reservoir's base is written there once)."""
        return {"orchestrator": self.orchestrator_state(own_store),
                "group": self.group.state_dict(store, own_store)}  # fmt: skip

    def load_state_dict(self, state: dict, store: str | None = None) -> None:
        """`store`: the group's shard and trainer states may hold refs to the checkpoint
        store there (`CheckpointStore.load(resolve=False)`), read where they are loaded."""
        self.group.load_state_dict(state["group"], store)
        self.load_orchestrator_state(state["orchestrator"])

    def orchestrator_state(self, store: str | None = None) -> dict:
        return {
            "cursor": self.cursor.state_dict(),
            "num_nodes": self.num_nodes,
            "negatives": self.negatives.state_dict(),
            "replay": self.replay.state_dict(),
            "forget_gen": self.forget_gen.get_state(),
            "history": [dict(r) for r in self.history],
            "rebatches": list(self.rebatches),
            "slot_precision": self.slot_precision,
            "idmap": self.stream.idmap.state_dict(),  # external -> dense node ids
            "old_events": self.history_events.state_dict(store),
            "tgb_seen": self.evaluation.seen.state_dict(),  # empty unless eval.protocol is tgb
            # the pass under way (not its progress bar; wall-clock stamps restart on load)
            "pass": {k: _resolved(v) for k, v in self.pass_state.items() if k != "bar"},
        }

    def load_orchestrator_state(self, state: dict) -> None:
        self.cursor.load_state_dict(state["cursor"])
        self.num_nodes = state["num_nodes"]
        self.negatives.load_state_dict(state["negatives"])
        self.replay.load_state_dict(state["replay"])
        load_generator_state(self.forget_gen, state["forget_gen"], "forgetting probe")
        self.history = [dict(r) for r in state["history"]]
        self.rebatches = [tuple(x) for x in state.get("rebatches", [])]
        for unit, batch in self.rebatches:  # the schedule the run trained by
            self.schedule.rebatch(unit, batch)
        if "idmap" in state:  # the checkpoint's map, bitwise (a rebuilt stream's is the same)
            self.stream.idmap = IdMap.from_state(state["idmap"])
        self.evaluation.load_seen(state.get("tgb_seen"))
        if "old_events" in state:
            self.history_events.load_state_dict(state["old_events"])
        else:  # a checkpoint from before the reservoir: counted again from the events
            blocks = [(0, self.phase1_end)] if self.cursor.phase1_done else []
            blocks += list(self.bounds[: self.cursor.increment])
            self.history_events.count_old(blocks, self.cursor.ingested, self.group.partitioner,
                                          self.num_nodes)  # fmt: skip
        self.history_events.forget()
        self.pass_state = dict(state.get("pass", {}))
        now = time.perf_counter()
        for key in ("t0", "t_pass", "t_train"):
            if key in self.pass_state:
                self.pass_state[key] = now
        saved = state.get("slot_precision", self.slot_precision)
        if saved != self.slot_precision:
            log.warning(
                "checkpoint was trained with %s slot projections, this process uses %s "
                "(model.slot_precision %r on %s): the run continues with other numerics",
                saved,
                self.slot_precision,
                self.config.model.slot_precision,
                self.device,
            )

    # ---- passes ---------------------------------------------------------------------------

    def ingest(self, start: int, end: int) -> None:
        """Events [start, end) to the durable log and the shards, a window at a time (those
        ingested already are skipped)."""
        for lo, hi in self._windows(max(start, self.cursor.ingested), end):
            self._ingest(lo, hi)

    def _ingest(self, lo: int, end: int) -> None:
        ev = self._events(lo, end)
        if self.event_log is not None:  # durable before any shard sees it, in external ids
            self.event_log.append(self._external(ev), lo, end)
        if len(ev):
            top = int(torch.maximum(ev.src.max(), ev.dst.max())) + 1
            self.num_nodes = max(self.num_nodes, top)
        with self.group.tracer.span("ingest", events=len(ev)):
            self.group.ingest(ev, self.num_nodes, span=(lo, end))
        self.history_events.ingested(ev, self.group.partitioner, self.num_nodes)
        self.negatives.add(ev.dst)
        self.cursor.ingested = end

    def _external(self, ev: EventBatch) -> EventBatch:
        """`ev` with the stream's external int ids (string ids stay dense: the checkpoint's
        id map names them)."""
        idmap = self.stream.idmap
        if idmap.kind != "int" or not idmap.mapped:
            return ev
        out = ev.select(slice(None))
        out.src, out.dst = idmap.external(ev.src), idmap.external(ev.dst)
        return out

    def _eval_events(self, ev: EventBatch) -> float:
        """AP on arbitrary (old) events without touching node state."""
        pos, neg = [], []
        b = self.config.train.batch_size
        for lo in range(0, len(ev), b):
            p, n = self._eval_batch(ev.select(slice(lo, lo + b)), observe=False)
            pos.append(p)
            neg.append(n[:, 0])
        return average_precision(torch.cat(pos), torch.cat(neg))

    def _eval_batch(self, ev: EventBatch, observe: bool) -> tuple[torch.Tensor, torch.Tensor]:
        neg = self.negatives.sample(len(ev), self.eval_negatives)
        with self.group.tracer.span("evaluation", events=len(ev)):
            return self.group.eval_step(ev, neg, observe)

    def _old_ap(self, end: int) -> float:
        n = self.config.continual.forget_sample
        if n == 0 or end == 0:
            return float("nan")
        pool = self.history_events.pool()  # events [0, end) while they fit, else a sample
        pos = torch.randperm(len(pool), generator=self.forget_gen)[:n].sort().values
        return self._eval_events(pool.select(pos))

    def _ap_on(self, start: int, end: int) -> float:
        n = self.config.continual.forget_sample or (end - start)
        pos = torch.randperm(end - start, generator=self.forget_gen)[:n].sort().values
        return self._eval_events(self._events(start, end).select(pos))

    def _log(self, record: dict) -> None:
        self.history.append(record)
        if record.get("phase") == "increment":
            log.info("increment %d: %s", record["increment"] + 1, _fmt(record))
        self.records.write(record)


def _value(loss) -> float:
    """A loss, waiting for it when a group returned it pending."""
    return loss.value() if hasattr(loss, "value") else loss


def _resolved(x):
    """A pass-state value with pending losses read (for a checkpoint)."""
    if isinstance(x, list) and all(isinstance(e, tuple) and len(e) == 2 for e in x):
        return [(_value(loss), n) for loss, n in x]
    return x


def _local_group(config):
    """The group factory when the caller gives none: `LocalGroup`. Groups of actors are built
    where Ray is imported (`tidegraph.orchestrator.make_group`), never here."""
    if config.cluster.backend != "local":
        raise ValueError(
            f"ContinualLearner: cluster.backend {config.cluster.backend!r} needs a group factory:"
            " pass group=tidegraph.orchestrator.make_group"
        )
    return LocalGroup


def _fmt(metrics: dict) -> str:
    keys = ("ap", "auc", "mrr", "old_ap", "eval_events_per_s", "train_events_per_s")
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
