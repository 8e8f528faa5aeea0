"""A run's model and graph state for serving: a checkpoint, advanced read-only by the event log.

`RunSource(storage, run_name)` reads a run directory without writing to it: its checkpoints
and its durable event log. `ServedState(source)` loads the newest checkpoint (model, node
state, graph, id map) into a one-process group of the run's P partitions and one replica, and
`catch_up()` applies the events the log received since, file by file, as the learner's
evaluation pass does: each file is ingested into the graph whole, then recorded in node state
in batches of `train.batch_size` (every event of a batch reads the state before it), so that
after catching up the served state is the learner's state after evaluating those events, before
it retrains on them. Nothing trains here.

Queries never change state:
- `score(src, dst, t)`: link probabilities, as the learner's evaluation scores events, from
  the state as of the last event applied and the neighbours strictly before `t`;
- `topk(src, t, k, candidates)`: the k most likely destinations among `candidates` (default:
  every destination seen so far);
- `tgb_rank(src, dst, t, negatives, seed)`: TGB's protocol for one positive: its hist_rnd
  negatives (history: every event in the served graph, `tidegraph.training.tgb`), the rank of
  `dst` among them by TGB's rule, and every candidate's logit (for a top k);
- `embed(nodes, t)`: the nodes' embeddings at `t`.
Ids are the stream's external ids (the run's id map); an id the map does not hold is a new
node: no neighbours and fresh node state, as the learner would see it at its first event.
Times before the last event applied are refused (their answers would read later events); any
finite time at or after it is answered (the models are finite for any time gap: see
`models.time_encoding`). An answer is checked finite before it leaves: a non-finite one raises
`ModelOutputError` (a defect, never a value a response carries).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
import yaml

from tidegraph.models.registry import spec
from tidegraph.storage.checkpoint import CheckpointStore
from tidegraph.storage.eventlog import EventLog, open_fs
from tidegraph.storage.events import EventBatch
from tidegraph.storage.idmap import IdMap
from tidegraph.training.config import RunConfig
from tidegraph.training.group import LocalGroup
from tidegraph.training.metrics import link_metrics
from tidegraph.training.sampling import NegativeSampler
from tidegraph.training.tgb import SeenPairs, tgb_ranks

__all__ = ["ModelOutputError", "QueryError", "RunSource", "ServedState", "checked_run"]

log = logging.getLogger(__name__)


class QueryError(ValueError):
    """A request that cannot be answered as asked; the message names the field."""


class ModelOutputError(RuntimeError):
    """The model gave a non-finite answer (NaN or infinity) to a valid query: a defect of
    the model, reported as such instead of an answer JSON cannot carry."""


def _finite(x: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ModelOutputError(f"{what}: the model gave {bad} non-finite values (NaN or "
                               f"infinity) for a valid query; please report it")  # fmt: skip
    return x


class RunSource:
    """A run directory under `storage` (a path or a `pyarrow.fs` URI), read only."""

    def __init__(self, storage: str, run_name: str) -> None:
        self.fs, root = open_fs(storage)
        self.storage, self.run_name = storage, run_name
        self.path = f"{root.rstrip('/')}/{run_name}"
        info = self.fs.get_file_info(f"{self.path}/config.yaml")
        if info.type == pafs.FileType.NotFound:
            raise ValueError(f"serve: no run {run_name!r} under {storage} "
                             f"({self.path}/config.yaml does not exist)")  # fmt: skip
        self.checkpoints = CheckpointStore(self.fs, f"{self.path}/checkpoints")
        self.events = EventLog(f"{storage.rstrip('/')}/{run_name}", create=False)

    def config(self) -> dict:
        with self.fs.open_input_stream(f"{self.path}/config.yaml") as f:
            return yaml.safe_load(f.read())

    def latest(self) -> str | None:
        return self.checkpoints.latest()

    def edge_dim(self) -> int:
        """Edge-feature columns of the log (f0..f{F-1}); 0 without features or events."""
        files = self.events.files()
        if not files:
            return 0
        with self.fs.open_input_file(files[0][2]) as f:
            names = pq.read_schema(f).names
        return sum(1 for n in names if n[:1] == "f" and n[1:].isdigit())


def checked_run(storage: str, run_name: str) -> str:
    """`storage` (a local path made absolute: replicas may run in another directory) once it
    holds run `run_name` with a checkpoint; else a ValueError saying what is missing."""
    storage = storage if "://" in storage else os.path.abspath(storage)
    source = RunSource(storage, run_name)
    if source.latest() is None:
        raise ValueError(f"serve: run {run_name!r} has no checkpoint yet ({source.path}/"
                         "checkpoints); serve it once its first checkpoint is written")  # fmt: skip
    return storage


class ServedState:
    """Checkpoint `tag` (default: the newest) of `source`, on `device`; see the module."""

    def __init__(self, source: RunSource, tag: str | None = None, device: str = "cpu") -> None:
        t0 = time.perf_counter()
        self.source = source
        self.tag = tag or source.latest()
        if self.tag is None:
            raise ValueError(f"serve: run {source.run_name!r} has no checkpoint yet "
                             f"({source.path}/checkpoints)")  # fmt: skip
        state = source.checkpoints.load(self.tag, host=True)  # then onto `device`
        self.step = source.checkpoints.meta(self.tag).get("step")
        config = RunConfig.from_dict(state.get("config") or source.config())
        group_state = state["learner"]["group"]
        c = config.cluster  # one process: the run's partitions, one replica
        c.backend, c.trainers, c.min_trainers, c.max_trainers = "local", 1, 1, 1
        c.memory = group_state["memory_placement"]
        c.faults, c.spare_trainers = [], 0
        config.device, config.graph_device = device, device
        config.timeline, config.progress = 0, False
        self.config = config
        orch = state["learner"]["orchestrator"]
        self.idmap = IdMap.from_state(orch["idmap"])
        self.num_nodes = int(orch["num_nodes"])
        self.negatives = NegativeSampler(0)
        self.negatives.load_state_dict(orch["negatives"])  # the learner's draws (`catch_up`)
        self.group = LocalGroup(config, 0, source.edge_dim(), expected_nodes=self.num_nodes)
        self.group._load_common_state(group_state)
        for shard, s in zip(self.group.shards, group_state["shards"], strict=True):
            shard.load_state_dict(s)
        self.trainer = self.group.trainers[0]
        self.trainer.load_state_dict(group_state["trainers"][0])
        self.checkpoint_offset = self.offset = int(state["log_offset"])
        self.ingested_end = self.offset  # the graph holds the log's events before it
        self.batch = config.train.batch_size
        self.last_t = self._time_before(self.offset)
        self.loaded_s = time.perf_counter() - t0
        self.lock = threading.RLock()  # queries and catching up take turns
        self.broken: str | None = None  # a catch-up failed midway: rebuild from a checkpoint
        self.seen: SeenPairs | None = None  # TGB's history, read from the log when first asked
        if config.eval.protocol == "tgb" and config.mode == "continual":
            log.warning("serve: run %r evaluated increments by TGB's protocol; catching up "
                        "records the log's events against %d uniform negatives instead, so "
                        "node state after a catch-up is not the learner's to the bit",
                        source.run_name, config.train.eval_negatives)  # fmt: skip
        self._grow(self.num_nodes)
        self.pending()  # the first look at the log

    # ---- the log -------------------------------------------------------------------------

    def _time_before(self, offset: int) -> float:
        """The time of event `offset - 1` (-inf before any)."""
        if offset == 0:
            return float("-inf")
        return float(self.source.events.read(offset - 1, offset).t[0])

    def pending(self) -> list[tuple[int, int]]:
        """The log's files of events not applied yet, [(start, end)], without a gap; the
        look at the log is kept for `status` (the log's end, when the oldest of them was
        written)."""
        out, at, since = [], self.offset, None
        for lo, hi, _, when in self.source.events.listing():
            if hi <= at:
                continue
            if lo > at:
                break
            out.append((at, hi))
            since = when if since is None else since
            at = hi
        self.log_end, self.pending_since, self.looked = at, since, time.time()
        return out

    def catch_up(self, max_files: int | None = None, evaluate: bool = False) -> list:
        """Apply the log's events since the last applied (at most `max_files` files), each
        batch scored against `train.eval_negatives` negatives drawn as the learner draws them
        (node state records what the pass touched, negatives included, as the learner's
        evaluation does); with `evaluate`, returns per batch (pos logits, negative logits).
        The lock is released between batches. A failure midway marks the state `broken` (a
        file half applied cannot be applied again): serve a fresh one."""
        if self.broken:
            raise RuntimeError(f"ServedState: {self.broken}")
        scores = []
        q = self.config.train.eval_negatives
        for lo, hi in self.pending()[:max_files]:
            ev = self.source.events.read(lo, hi)
            try:
                with self.lock:
                    self._ingest(ev, lo, hi)
                for b in range(0, len(ev), self.batch):
                    part = ev.select(slice(b, b + self.batch))
                    with self.lock:
                        got = self.group.eval_step(part, self.negatives.sample(len(part), q), True)
                        self.offset = lo + b + len(part)
                        self.last_t = float(part.t[-1])
                    if evaluate:
                        scores.append(got)
            except BaseException as exc:
                self.broken = f"applying log events [{lo}, {hi}) failed: {exc!r}"
                raise
        return scores

    def _ingest(self, ev: EventBatch, lo: int, hi: int) -> None:
        """Log events [lo, hi) into the graph (their external ids mapped as the learner maps a
        live increment's: new ones in order of first appearance)."""
        if self.idmap.kind == "int":  # the identity below its bound; a run's later ids mapped
            ev.src, ev.dst = self.idmap.map_events(ev.src, ev.dst)
        if len(ev):
            top = int(torch.maximum(ev.src.max(), ev.dst.max())) + 1
            self.num_nodes = max(self.num_nodes, top)
        self.group.ingest(ev, self.num_nodes, span=(lo, hi))
        self.ingested_end = hi
        self.negatives.add(ev.dst)
        if self.seen is not None:
            self.seen.add(ev.src, ev.dst)
        self._grow(self.num_nodes)

    def _grow(self, num_nodes: int) -> None:
        """Room for node ids below `num_nodes` + 1: the one past them answers for new nodes
        (with node state on the shards, an empty row at its owner: partition 0 while a
        partitioner that places nodes as they arrive has not placed it)."""
        self.trainer.grow(num_nodes + 1)
        if self.group.state_shards is None:
            return
        new = torch.tensor([num_nodes])
        owner = int(self.group.partitioner.owner(new)[0]) if bool(self._placed(new)[0]) else 0
        self.group.state_shards[owner].node_state.add_nodes(new)

    def _placed(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each node has a partition: always, unless the partitioner places nodes
        as they arrive (LDG) and has not placed it."""
        placed = getattr(self.group.partitioner, "map", None)
        if placed is None:
            return torch.ones_like(ids, dtype=torch.bool)
        inside = ids < placed.shape[0]
        return inside & (placed[torch.where(inside, ids, 0)] >= 0)

    # ---- queries ---------------------------------------------------------------------------

    def nodes(self, ids, field: str) -> torch.Tensor:
        """Dense ids of external ids (a list of ints, or of strings for a run of string ids);
        new nodes (ids the map does not hold, beyond the served nodes, or without a place or
        a state row where partitions or shards hold them) get the id one past the served
        nodes. (A node below that the run has not seen keeps its id, as the learner would.)"""
        if self.idmap.kind == "str":
            if not all(isinstance(x, str) for x in ids):
                raise QueryError(f"{field}: this run's node ids are strings")
            dense, found = self.idmap.lookup_text(pa.array(ids, pa.large_string()))
        else:
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise QueryError(f"{field}: this run's node ids are integers")
            try:
                array = np.asarray(ids, dtype=np.int64)
            except OverflowError:
                raise QueryError(f"{field}: an id is out of the int64 range") from None
            dense, found = self.idmap.lookup(array)
        found &= (dense < self.num_nodes) & self._placed(dense)
        if self.group.state_shards is not None and bool(found.any()):  # a state row each
            owner = torch.full_like(dense, -1)
            owner[found] = self.group.partitioner.owner(dense[found])
            for p, shard in enumerate(self.group.state_shards):
                mine = owner == p
                found[mine] = shard.node_state.index.contains(dense[mine])
        return torch.where(found, dense, torch.full_like(dense, self.num_nodes))

    def times(self, t, n: int, field: str = "t") -> torch.Tensor:
        """Query times: one per row (or one for all), none before the last event applied."""
        ts = torch.as_tensor(t, dtype=torch.float64).reshape(-1)
        if ts.numel() == 1 and n != 1:
            ts = ts.expand(n)
        if ts.numel() != n:
            raise QueryError(f"{field}: {ts.numel()} times for {n} rows")
        if n and not bool(torch.isfinite(ts).all()):
            raise QueryError(f"{field}: times must be finite numbers")
        if n and float(ts.min()) < self.last_t:
            raise QueryError(f"{field}: {float(ts.min())!r} is before the served state (its last "
                             f"event is at {self.last_t!r}); ask about now or later")  # fmt: skip
        return ts.contiguous()

    def score(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Link probabilities of dense (src, dst) at times `t`."""
        ev = _queries(src, dst, t)
        with self.lock, self._new_node_placed():
            pos, _ = self.group.eval_step(ev, _none(len(ev)), observe=False)
        return _finite(torch.sigmoid(pos), "scores")

    def topk(
        self, src: int, t: float, k: int, candidates: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in `candidates`, probabilities) of the `k` likeliest destinations of
        dense `src` at `t` among dense `candidates` (None: every destination seen; a dense id
        may repeat: new nodes share one), best first; `eval_max_roots` roots a pass."""
        with self.lock, self._new_node_placed():
            cand = self.negatives.pool if candidates is None else candidates
            if not 1 <= k <= cand.numel():
                raise QueryError(f"k: must be in [1, {cand.numel()}] (the candidates), got {k}")
            logits = self._logits(src, t, cand)
        best = torch.topk(logits, k)
        return best.indices, torch.sigmoid(best.values)

    def _logits(self, src: int, t: float, cand: torch.Tensor) -> torch.Tensor:
        """Logits of dense `src` linking to each of dense `cand` at `t` (each distinct
        candidate scored once; `eval_max_roots` roots a pass)."""
        distinct, inverse = torch.unique(cand, return_inverse=True)
        ev = _queries(torch.tensor([src]), distinct[:1], torch.tensor([t], dtype=torch.float64))
        step = max(1, self.config.train.eval_max_roots - 2)
        logits = torch.cat([self.group.eval_step(ev, part.view(1, -1), observe=False)[1][0]
                            for part in distinct.split(step)])  # fmt: skip
        return _finite(logits, "scores")[inverse]

    def tgb_rank(
        self, src: int, dst: int, t: float, negatives: int | None = None, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(candidates, logits, rank): dense `dst` then its `negatives` (None: the run's
        `eval.negatives`) hist_rnd negatives for dense `src` at `t` (history: the distinct
        pairs of every event applied; destination range theirs and `dst`), each candidate's
        logit, and `dst`'s rank among the negatives by TGB's rule (1: above all of them)."""
        e = self.config.eval
        if dst >= self.num_nodes:
            raise QueryError("dst: a node the run has not seen; TGB's protocol ranks a known "
                             "destination against its negatives")  # fmt: skip
        with self.lock, self._new_node_placed():
            sampler = self._history().negatives(torch.tensor([dst]), negatives or e.negatives,
                                                e.hist_ratio, seed)  # fmt: skip
            neg, valid = sampler.sample(torch.tensor([src]), torch.tensor([dst]),
                                        torch.tensor([t], dtype=torch.float64))  # fmt: skip
            cand = torch.cat([torch.tensor([dst]), neg[0][valid[0]]])
            logits = self._logits(src, t, cand)
        rank = float(tgb_ranks(logits[:1], logits[1:].unsqueeze(0))[0])
        return cand, logits, rank

    def _history(self) -> SeenPairs:
        """The distinct (src, dst) pairs of every event in the graph: the log's events before
        the last file ingested ends (a catch-up ingests a file whole, then records it batch by
        batch), read once a window at a time, then kept up by `_ingest`."""
        if self.seen is None:
            seen, window, end = SeenPairs(), 1 << 20, self.ingested_end
            for lo in range(0, end, window):
                ev = self.source.events.read(lo, min(end, lo + window))
                src, dst = ev.src, ev.dst
                if self.idmap.kind == "int":  # the log's external ids, every one in the map
                    (src, _), (dst, _) = self.idmap.lookup(src), self.idmap.lookup(dst)
                seen.add(src, dst)
            self.seen = seen
        return self.seen

    def embed(self, nodes: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Embeddings [N, D] of dense `nodes` at times `t` (`eval_max_roots` roots a pass);
        QueryError for a model that encodes pairs jointly (its registry row: `embeds`)."""
        name = self.config.model.name
        if not spec(name).embeds:
            raise QueryError(f"embed: model {name} scores each (src, dst) pair jointly, so a "
                             f"node has no embedding alone; ask /score or /topk")  # fmt: skip
        step = self.config.train.eval_max_roots
        with self.lock, self._new_node_placed():
            parts = zip(nodes.split(step), t.split(step), strict=True)
            z = torch.cat([self.trainer.embed_roots(n, ts) for n, ts in parts])
        return _finite(z, "embeddings")

    @contextmanager
    def _new_node_placed(self):
        """A partitioner that places nodes as they arrive (LDG) places the id that answers
        for new nodes for the query's length (then forgets it: the learner places a node at
        its first event)."""
        part = self.group.partitioner
        placed = getattr(part, "map", None)
        if placed is None or placed.shape[0] > self.num_nodes:
            yield
            return
        grown = torch.cat([placed, torch.full((self.num_nodes + 1 - placed.shape[0],), -1)])
        grown[self.num_nodes] = 0
        part.map = grown
        try:
            yield
        finally:
            part.map = placed

    def external(self, dense: torch.Tensor) -> list:
        """External ids of dense ones."""
        out = self.idmap.external(dense)
        return out if isinstance(out, list) else out.tolist()

    def status(self) -> dict:
        """What is served: the checkpoint, the last event applied, the lag behind the log (as
        of the last look at the log: `pending`, every catch-up)."""
        end = max(self.log_end, self.offset)
        behind = end > self.offset and self.pending_since is not None
        return {
            "run": self.source.run_name,
            "checkpoint": self.tag,
            "checkpoint_step": self.step,
            "checkpoint_offset": self.checkpoint_offset,
            "applied_offset": self.offset,
            "last_event_time": None if self.offset == 0 else self.last_t,
            "log_offset": end,
            "lag_events": end - self.offset,
            # seconds since the oldest log file not applied yet was written
            "lag_seconds": max(0.0, time.time() - self.pending_since) if behind else 0.0,
            "log_checked_s_ago": time.time() - self.looked,
            "nodes": self.num_nodes,
            "candidates": int(self.negatives.pool.numel()),
            "model": self.config.model.name,
            "embedding_dim": int(self.trainer.model.dim),
        }


def evaluation_metrics(scores: list) -> dict:
    """AP, AUC and MRR of `catch_up(evaluate=True)`'s scores (the learner's link metrics)."""
    pos = torch.cat([p for p, _ in scores])
    neg = torch.cat([n for _, n in scores])
    return link_metrics(pos, neg)


def _none(n: int) -> torch.Tensor:  # no negatives
    return torch.empty(n, 0, dtype=torch.int64)


def _queries(src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor) -> EventBatch:
    """Query pairs as events that are not in the graph (eid -1: no recorded features)."""
    eid = torch.full_like(src, -1)
    return EventBatch(src.contiguous(), dst.contiguous(), t.contiguous(), eid)
