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

State: `state_dict()` holds everything a later failure must restore (model with memory,
optimizer, sampler, negative and replay generators, torch's global generator, the graph, the
stream offset, the metric history), and a learner built from the same config that loads it
continues bitwise as the original would on CPU.

Determinism: a seed fixes every draw (model init, sampler, negatives, replay, forgetting
samples; generators other than the sampler's live on the host, so draws match across devices).
Kernels: the backward of row gathers and `index_add` accumulate in parallel (CPU threads or CUDA
atomics) in a nondeterministic order, so with `RunConfig.deterministic` (the default) the
learner calls `torch.use_deterministic_algorithms(True, warn_only=True)`, a process-wide switch
(without its NaN fill of new tensors, `torch.utils.deterministic.fill_uninitialized_memory`).
On CPU that makes two runs with the same seed and thread count bitwise identical (tested). On
CUDA it additionally needs `CUBLAS_WORKSPACE_CONFIG=:4096:8` in the environment; ops without a
deterministic CUDA kernel only warn, so CUDA runs are reproducible up to last-bit differences,
not guaranteed bitwise; sampling, negatives and replay choices stay identical there.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from tidegraph.models.config import build_model
from tidegraph.ops import resolved_slot_precision
from tidegraph.rng import load_generator_state
from tidegraph.sampling.sampler import TemporalSampler
from tidegraph.storage.cache import CachedFeatureStore
from tidegraph.storage.events import EventBatch
from tidegraph.storage.features import HostFeatureStore
from tidegraph.storage.graph import DynamicGraph
from tidegraph.training.config import RunConfig
from tidegraph.training.data import Stream, load_stream
from tidegraph.training.engine import LinkEngine
from tidegraph.training.metrics import average_precision, link_metrics
from tidegraph.training.optim import FlatAdam
from tidegraph.training.progress import Progress
from tidegraph.training.sampling import NegativeSampler, build_replay

__all__ = ["ContinualLearner", "increment_bounds"]

log = logging.getLogger(__name__)


class ContinualLearner:
    """Phase 1, then `step()` per increment; plain class, state in `state_dict()`."""

    def __init__(self, config: RunConfig, stream: Stream | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        d = config.data
        self.stream = stream or load_stream(
            d.dataset, d.max_events, format=d.format, quarantine=d.quarantine
        )
        self.events = self.stream.events
        if config.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            # deterministic mode also fills every new tensor with NaN to expose reads of
            # uninitialized memory: an extra write pass over each allocation (~5% of a TGN
            # step on CPU). Nothing here reads memory it did not write (the determinism test
            # would see it), so that debugging aid stays off.
            torch.utils.deterministic.fill_uninitialized_memory = False
        torch.manual_seed(config.seed)
        self.graph = DynamicGraph(device=config.graph_device)
        s = config.sampler
        snaps = s.num_snapshots
        self.sampler = TemporalSampler(
            self.graph,
            s.fanouts,
            s.strategy,
            num_snapshots=snaps,
            snapshot_window=s.snapshot_window if snaps > 1 else 0.0,
            seed=config.seed + 1,
            dedup=s.dedup,
        )
        self.model = build_model(
            config.model, self.stream.num_nodes, self.stream.edge_dim, num_snapshots=snaps
        ).to(self.device)
        self.slot_precision = resolved_slot_precision(config.model.slot_precision, self.device)
        log.info("attention slot projections in %s on %s", self.slot_precision, self.device)
        self.edge_cache = self._edge_features()
        self.model.edge_store = self.edge_cache
        self.optimizer = self._new_optimizer()
        self.negatives = NegativeSampler(config.seed + 2)
        self.replay = build_replay(
            config.continual.replay, config.seed + 3, config.continual.importance_floor
        )
        self.forget_gen = torch.Generator().manual_seed(config.seed + 4)
        self.engine = LinkEngine(
            self.model,
            self.sampler,
            self.optimizer,
            self.negatives,
            self.device,
            config.train.train_negatives,
            config.train.eval_negatives,
            config.train.eval_max_roots,
        )
        self.phase1_end = int(len(self.events) * config.continual.train_fraction)
        self.bounds = increment_bounds(self.events.t, self.phase1_end, config.continual)
        self.ingested = 0  # stream offset: events[:ingested] are in the graph
        self.offset = 0  # next increment
        self.phase1_done = False
        self.history: list[dict] = []

    # ---- public ---------------------------------------------------------------------------

    @property
    def num_increments(self) -> int:
        return len(self.bounds)

    @property
    def done(self) -> bool:
        return self.phase1_done and self.offset >= len(self.bounds)

    def run(self) -> dict:
        if not self.phase1_done:
            self.run_phase1()
        while not self.done:
            self.step()
        return self.summary()

    def run_phase1(self) -> dict:
        cfg = self.config
        end = self.phase1_end
        val_start = end - int(end * cfg.continual.val_fraction)
        self.ingest(0, end)
        record = {"phase": "phase1", "train_events": val_start, "val_events": end - val_start}
        for epoch in range(cfg.train.epochs):
            self.model.reset_state()
            rate, loss = self.train_pass(0, val_start, f"phase1 epoch {epoch + 1}")
            metrics = self.eval_pass(val_start, end, f"phase1 val {epoch + 1}", observe=True)
            log.info("phase 1 epoch %d: loss %.4f val %s", epoch + 1, loss, _fmt(metrics))
            record.update({"epoch": epoch + 1, "loss": loss, "train_events_per_s": rate})
            record.update({f"val_{k}": v for k, v in metrics.items()})
        self.phase1_done = True
        self._log(record)
        return record

    def step(self) -> dict:
        """Ingest, evaluate, retrain on the next increment; returns its metrics."""
        if not self.phase1_done:
            raise RuntimeError("ContinualLearner.step: run_phase1() first")
        if self.done:
            raise StopIteration("ContinualLearner.step: the stream is exhausted")
        k = self.offset
        start, end = self.bounds[k]
        c = self.config.continual
        t0 = time.perf_counter()
        self.ingest(start, end)
        before = self.model.node_state()
        metrics = self.eval_pass(start, end, f"increment {k + 1} eval", observe=True)
        eval_s = time.perf_counter() - t0
        if c.fresh_optimizer:
            self.optimizer = self._new_optimizer()
            self.engine.optimizer = self.optimizer
        t1 = time.perf_counter()
        if self.edge_cache is not None:  # GNNFlow's restoration: seed with the round's edges
            self.edge_cache.restore(self.events.eid[start:end])
        loss, n_replay = float("nan"), 0
        for epoch in range(c.retrain_epochs):
            self.model.load_node_state(before)
            loss, n_replay = self._retrain_pass(start, end, f"increment {k + 1} train {epoch + 1}")
        train_s = time.perf_counter() - t1
        record = {
            "phase": "increment",
            "increment": k,
            "events": end - start,
            "t_start": float(self.events.t[start]),
            "t_end": float(self.events.t[end - 1]),
            **metrics,
            "loss": loss,
            "replayed": n_replay,
            "old_ap": self._old_ap(start),
            "eval_events_per_s": (end - start) / eval_s,
            "train_events_per_s": (end - start + n_replay) * c.retrain_epochs / max(train_s, 1e-9),
        }
        if self.edge_cache is not None:  # cumulative feature-cache figures, for metrics
            stats = self.edge_cache.stats()
            for key in ("hit_rate", "bytes_h2d", "lookup_seconds", "capacity"):
                record[f"edge_cache_{key}"] = stats[key]
        self.offset += 1
        self._log(record)
        return record

    def summary(self) -> dict:
        """Mean metrics over increments, and forgetting: first AP minus AP now, per increment."""
        inc = [r for r in self.history if r["phase"] == "increment"]
        out = {"model": self.config.model.name, "dataset": self.stream.name}
        if inc:
            for key in ("ap", "auc", "mrr", "old_ap"):
                out[key] = sum(r[key] for r in inc) / len(inc)
            now = [self._ap_on(*self.bounds[r["increment"]]) for r in inc[:-1]]
            drops = [r["ap"] - a for r, a in zip(inc[:-1], now, strict=True)]
            out["forgetting"] = sum(drops) / len(drops) if drops else 0.0
        if self.config.out_dir:
            path = Path(self.config.out_dir) / "summary.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=2))
        return out

    # ---- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        cache = self.edge_cache
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "negatives": self.negatives.state_dict(),
            "replay": self.replay.state_dict(),
            "forget_gen": self.forget_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "graph": self.graph.state_dict(),
            "edge_features": None if cache is None else cache.store.state_dict(),
            "edge_cache": None if cache is None else cache.state_dict(),
            "ingested": self.ingested,
            "offset": self.offset,
            "phase1_done": self.phase1_done,
            "history": [dict(r) for r in self.history],
            "slot_precision": self.slot_precision,
        }

    def load_state_dict(self, state: dict) -> None:
        self.graph.load_state_dict(state["graph"])
        if self.edge_cache is not None:
            self.edge_cache.store.load_state_dict(state["edge_features"])
            self.edge_cache.load_state_dict(state["edge_cache"])
        params = self._param_ids()
        self.model.load_state_dict(state["model"])  # in place, unless a node table grew
        if params != self._param_ids():
            self.optimizer = self.engine.optimizer = self._new_optimizer()
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        self.negatives.load_state_dict(state["negatives"])
        self.replay.load_state_dict(state["replay"])
        load_generator_state(self.forget_gen, state["forget_gen"], "forgetting probe")
        torch.set_rng_state(state["torch_rng"].cpu())
        self.ingested = state["ingested"]
        self.offset = state["offset"]
        self.phase1_done = state["phase1_done"]
        self.history = [dict(r) for r in state["history"]]
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

    def _edge_features(self) -> CachedFeatureStore | None:
        """Edge features (when the stream has them): a host store that grows with the graph,
        behind a device cache the model reads through (pass-through on the CPU)."""
        if self.stream.edge_dim == 0:
            return None
        d = self.config.data
        store = HostFeatureStore(
            dim=self.stream.edge_dim,
            precision=d.feature_precision,
            pin_memory=self.device.type == "cuda",
            seed=self.config.seed + 5,
        )
        return CachedFeatureStore(
            store, ratio=d.feature_cache_ratio, policy=d.feature_cache_policy, device=self.device
        )

    def _new_optimizer(self) -> torch.optim.Optimizer:
        # fused Adam over one flat buffer: one kernel and no per-parameter Python per step
        params = [p for p in self.model.parameters() if p.requires_grad]
        return FlatAdam(params, lr=self.config.train.lr)

    def _param_ids(self) -> list[int]:
        return [id(p) for p in self.model.parameters()]

    def ingest(self, start: int, end: int) -> None:
        if end <= self.ingested:
            return
        ev = self.events.select(slice(max(start, self.ingested), end))
        g = self.graph.device
        self.graph.add_edges(ev.src.to(g), ev.dst.to(g), ev.t.to(g), ev.eid.to(g))
        if self.edge_cache is not None:  # rows = eids = stream positions
            self.edge_cache.append(ev.edge_feat)
        self.negatives.add(ev.dst)
        params = self._param_ids()
        self.model.grow(self.graph.num_nodes)
        if params != self._param_ids():
            # a learned node table grew into a new Parameter; Adam must track the new one
            log.info("node tables grew to %d nodes: new optimizer", self.graph.num_nodes)
            self.optimizer = self.engine.optimizer = self._new_optimizer()
        self.ingested = end

    def _batches(self, start: int, end: int):
        b = self.config.train.batch_size
        for lo in range(start, end, b):
            yield self.events.select(slice(lo, min(lo + b, end)))

    def train_pass(self, start: int, end: int, desc: str) -> tuple[float, float]:
        bar = Progress(end - start, desc, self.config.progress)
        total = 0.0
        for ev in self._batches(start, end):
            total += self.engine.train_batch(ev, observe=ev) * len(ev)
            bar.update(len(ev))
        return bar.close(), total / max(end - start, 1)

    def _retrain_pass(self, start: int, end: int, desc: str) -> tuple[float, int]:
        c = self.config.continual
        m = int(round(c.replay_ratio * (end - start)))
        pos, weight = self.replay.select(self.events, start, slice(start, end), m)
        n_batches = -(-(end - start) // self.config.train.batch_size)
        rep_parts = torch.tensor_split(torch.arange(pos.numel()), n_batches)
        bar = Progress(end - start + pos.numel(), desc, self.config.progress)
        total = 0.0
        for ev, part in zip(self._batches(start, end), rep_parts, strict=True):
            rep = self.events.select(pos[part])
            both = EventBatch.cat([ev, rep])
            w = torch.cat([torch.ones(len(ev)), weight[part]])
            total += self.engine.train_batch(both, w, observe=ev) * len(both)
            bar.update(len(both))
        bar.close()
        return total / max(end - start + pos.numel(), 1), int(pos.numel())

    def eval_pass(self, start: int, end: int, desc: str, observe: bool) -> dict:
        bar = Progress(end - start, desc, self.config.progress)
        pos, neg = [], []
        for ev in self._batches(start, end):
            p, n = self.engine.eval_batch(ev, observe=observe)
            pos.append(p)
            neg.append(n)
            bar.update(len(ev))
        bar.close()
        return link_metrics(torch.cat(pos), torch.cat(neg))

    def _eval_events(self, ev: EventBatch) -> float:
        """AP on arbitrary (old) events without touching node state."""
        pos, neg = [], []
        b = self.config.train.batch_size
        for lo in range(0, len(ev), b):
            p, n = self.engine.eval_batch(ev.select(slice(lo, lo + b)), observe=False)
            pos.append(p)
            neg.append(n[:, 0])
        return average_precision(torch.cat(pos), torch.cat(neg))

    def _old_ap(self, end: int) -> float:
        n = self.config.continual.forget_sample
        if n == 0 or end == 0:
            return float("nan")
        pos = torch.randperm(end, generator=self.forget_gen)[:n].sort().values
        return self._eval_events(self.events.select(pos))

    def _ap_on(self, start: int, end: int) -> float:
        n = self.config.continual.forget_sample or (end - start)
        pos = start + torch.randperm(end - start, generator=self.forget_gen)[:n].sort().values
        return self._eval_events(self.events.select(pos))

    def _log(self, record: dict) -> None:
        self.history.append(record)
        if record.get("phase") == "increment":
            log.info("increment %d: %s", record["increment"] + 1, _fmt(record))
        if self.config.out_dir:
            path = Path(self.config.out_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def increment_bounds(t: torch.Tensor, start: int, c) -> list[tuple[int, int]]:
    """[(start, end)] of each increment over events[start:], by count or by time window."""
    n = t.shape[0]
    if start >= n:
        return []
    if c.increment_window is not None:
        window = torch.floor((t[start:] - t[start]) / c.increment_window).long()
        _, counts = torch.unique_consecutive(window, return_counts=True)
        ends = (start + torch.cumsum(counts, 0)).tolist()
    else:
        size = c.increment_events or -(-(n - start) // c.num_increments)
        ends = list(range(start + size, n, size)) + [n]
    starts = [start] + ends[:-1]
    return list(zip(starts, ends, strict=True))


def _fmt(metrics: dict) -> str:
    keys = ("ap", "auc", "mrr", "old_ap", "eval_events_per_s", "train_events_per_s")
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
