"""One data-parallel replica: model, optimizer, feature cache and (replicated) node state.

`TrainerCore` is plain Python (the Ray actor wraps it unchanged). Per global step it trains or
evaluates its slice of the step's events and hands back what the group reduces:
- `train_slice` samples the slice's neighbourhoods (one request per shard per hop), fetches
  edge features (one request per shard), runs forward and backward, and returns the gradient
  (the flat gradient buffer of `FlatAdam`, of the slice's share of the global-batch loss:
  mean over the slice times slice size / global batch size, so the sum over slices is the
  global mean's gradient) and the node-state updates its events cause;
- `apply(reduced_grad, updates)` sets the reduced gradient, takes the optimizer step and applies
  the node-state updates of every slice (in slice order), so every replica stays identical;
- `eval_slice` scores its slice (chunked to bound memory) and returns the updates to apply.
Node state is read-only during a step: each slice reads what the previous step left.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from tidegraph.comm.buckets import ring_bytes
from tidegraph.models.base import TemporalModel, link_roots
from tidegraph.models.config import build_model
from tidegraph.sampling.keyed import step_key
from tidegraph.storage.cache import CachedFeatureStore
from tidegraph.storage.checkpoint import (
    CheckpointStore,
    DeltaTables,
    compact,
    gathered,
    put_state,
)
from tidegraph.storage.events import EventBatch
from tidegraph.timeline import Tracer, payload_bytes
from tidegraph.training.fetch import flat_blocks, join_edge_features
from tidegraph.training.optim import FlatAdam
from tidegraph.training.sampling import sample_options
from tidegraph.training.schedule import batch_start

__all__ = ["SliceResult", "TrainerCore"]

log = logging.getLogger(__name__)


class SliceResult(dict):
    """{"grad": flat gradient, "loss": slice's share of the batch loss, "updates": ...}."""


class TrainerCore:
    """Replica `rank`: `sampler` (a `MultiHopSampler`), `features` (edge-feature store or
    None), the model built from `config.model` with parameters from `init` (a generator)."""

    def __init__(
        self,
        config,
        num_nodes: int,
        edge_dim: int,
        sampler,
        features,
        rank: int = 0,
        init: torch.Generator | None = None,
        state_source=None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device(config.device)
        self.sampler = sampler
        snaps = config.sampler.num_snapshots
        with torch.random.fork_rng(devices=[]):
            if init is not None:
                torch.set_rng_state(init.get_state())
            self.model: TemporalModel = build_model(
                config.model, num_nodes, edge_dim, num_snapshots=snaps,
                fanouts=config.sampler.fanouts,
            ).to(self.device)  # fmt: skip
        # sharded node state: the model holds none of its own, each pass installs what it reads
        self.state_source = state_source
        self._deltas = DeltaTables()  # node-state tables written as changed rows
        self.model.external_state = state_source is not None
        d = config.data
        self.edge_cache = None
        if features is not None:
            self.edge_cache = CachedFeatureStore(
                features, ratio=d.feature_cache_ratio, policy=d.feature_cache_policy,
                device=self.device,
            )  # fmt: skip
        self.new_optimizer()
        self.steps = 0  # training steps taken (`train_and_step`, `apply`): the draw key's step
        # a member's vote, carried with its step's update exchange, and the group's (the
        # largest): 1 asks every member to stop after this step (a resize, see `elastic`)
        self.vote = self.group_vote = 0
        t = config.train
        self.train_negatives, self.eval_negatives = t.train_negatives, t.eval_negatives
        self.eval_max_roots = t.eval_max_roots
        # seconds per phase of training steps: sample, fetch (features, node state), compute
        # (forward, backward), allreduce, optimizer, apply (node-state updates), exchange
        # (trainers swapping node-state updates among themselves)
        self.seconds: dict[str, float] = defaultdict(float)
        # edges sampled by each training step's slice (the last ones; for balance reports)
        self.step_edges: collections.deque[int] = collections.deque(maxlen=100_000)
        self._sampled_edges = 0
        self.tracer = Tracer(f"trainer {rank}", config.timeline)
        self.evals = 0  # evaluation slices (the timeline's count of eval steps)

    # ---- parameters -------------------------------------------------------------------------

    def new_optimizer(self) -> None:
        # fused Adam over one flat buffer: one kernel and no per-parameter Python per step
        params = [p for p in self.model.parameters() if p.requires_grad]
        t = self.config.train
        self.optimizer = FlatAdam(params, lr=t.lr, rule=t.optimizer, warmup_steps=t.warmup_steps)
        self._hook_params(params)

    def _hook_params(self, params: list) -> None:
        """A hook per parameter (the optimizer's order) saying, during backward, that its
        gradient is final: a step's gradient all-reduce under way (`comm.overlap`) sends
        each bucket once its parameters are done."""
        for handle in getattr(self, "_grad_hooks", []):
            handle.remove()
        self._round = None
        self._grad_hooks = [p.register_post_accumulate_grad_hook(functools.partial(
            self._grad_final, i)) for i, p in enumerate(params)]  # fmt: skip

    def _grad_final(self, index: int, _param) -> None:
        if self._round is not None:
            self._round.ready(index)

    def _param_ids(self) -> list[int]:
        return [id(p) for p in self.model.parameters()]

    def grow(self, num_nodes: int) -> None:
        """Make room for node ids below `num_nodes` (node tables and state); a table that grew
        into a new Parameter is re-homed into the optimizer with its moments kept."""
        params = self._param_ids()
        self.model.grow(num_nodes)
        if params != self._param_ids():
            log.debug("node tables grew to %d nodes: optimizer state grown", num_nodes)
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer.regrow(params)
            self._hook_params(params)

    # ---- one step ---------------------------------------------------------------------------

    def _forward(
        self,
        ev: EventBatch,
        neg_BQ: torch.Tensor,
        observe: EventBatch | None = None,
        start: float | None = None,
        step: int = -1,
    ):
        """`start`: the global batch's start (`sampler.history: batch` sees only what
        precedes it); `step`: the training step whose key `uniform` draws use (-1:
        evaluation), the same in every replica (`tidegraph.sampling.keyed`)."""
        t0 = time.perf_counter()
        roots, ts = link_roots(ev.src, ev.dst, neg_BQ, ev.t)
        blocks, observe, t1 = self._inputs(roots, ts, observe, start, step)
        t2 = time.perf_counter()
        d = self.device
        scores = self.model.score(ev.src.to(d), ev.dst.to(d), neg_BQ.to(d), ev.t.to(d), blocks)
        t3 = time.perf_counter()
        self._phase("sample", t0, t1, roots=len(roots), edges=self._sampled_edges)
        self._phase("fetch", t1, t2)
        self._phase("compute", t2, t3, "forward", events=len(ev))
        return scores, observe

    def _inputs(self, roots, ts, observe, start, step: int):
        """The blocks sampled for `roots` at `ts` on this device, with their edge features
        (and `observe`'s) fetched and the node state they read installed; and when sampling
        ended (perf_counter)."""
        options = sample_options(self.config.sampler, self.model, start)
        key = step_key(self.config.seed, step)
        blocks = self.sampler.sample(roots, ts, key=key, **options)
        self._sampled_edges = sum(int(b.mask.sum()) for b in flat_blocks(blocks))
        blocks = _blocks_to(blocks, self.device)
        t1 = time.perf_counter()
        observe = join_edge_features(self.edge_cache, blocks, observe)
        if self.state_source is not None:
            self.state_source.install(self.model, roots, blocks)
        return blocks, observe, t1

    @torch.no_grad()
    def embed_roots(self, ids: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
        """Embeddings [N, D] (on the host) of nodes `ids` at times `ts`, as an evaluation
        pass computes them: node state read, never changed."""
        if self.model.training:
            self.model.eval()
        blocks, _, _ = self._inputs(ids, ts, None, self._start(None, ts), -1)
        z = self.model.embed_roots(ids.to(self.device), ts.to(self.device), blocks)
        self.model.discard()
        return z.float().cpu()

    def train_slice(
        self,
        ev: EventBatch,
        weight: torch.Tensor | None,
        neg_BQ: torch.Tensor,
        num_observe: int,
        global_size: int,
        start: float | None = None,
        exchange=None,
    ) -> SliceResult:
        """Gradient of this slice's share of the global-batch loss; its first `num_observe`
        events are new in time order and are recorded in node state. `start`: the earliest
        time of the global batch's new events (`schedule.train_slices`; None: this slice's
        own, which is the batch's with one trainer). `exchange`, if given, is called with
        the loss and the node-state updates before backward, and what it returns is the
        result's "updates"."""
        if not self.model.training:  # Module.train() walks every submodule: once per pass
            self.model.train()
        self.tracer.begin(self.steps)
        observe = ev.select(slice(0, num_observe)) if num_observe else None
        start = self._start(start, ev.t[:num_observe])
        (pos, negl), observe = self._forward(ev, neg_BQ, observe, start, self.steps)
        self.step_edges.append(self._sampled_edges)
        loss_e = F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos), reduction="none")
        loss_e = loss_e + F.binary_cross_entropy_with_logits(
            negl, torch.zeros_like(negl), reduction="none"
        ).mean(1)
        if weight is not None:
            loss_e = loss_e * weight.to(loss_e.device)
        loss = loss_e.mean()
        if len(ev) != global_size:  # this slice's share of the global mean
            loss = loss * (len(ev) / global_size)
        if observe is not None:
            observe = observe.to(self.device)
        # a function of the forward pass alone: taken before backward, so that a group can
        # exchange the updates while the gradient is computed
        t0 = time.perf_counter()
        updates = self.model.take_updates(observe)
        t1 = time.perf_counter()
        sent = payload_bytes(updates) if exchange is not None and self.tracer.on else None
        if exchange is not None:
            updates = exchange(float(loss.detach()), updates)
        t2 = time.perf_counter()
        self._phase("apply", t0, t1, "updates")
        if exchange is not None:  # bytes: this rank's updates (each peer receives them)
            self._phase("exchange", t1, t2, start="gather", **({"bytes": sent} if sent else {}))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._phase("compute", t2, time.perf_counter(), "backward", events=len(ev))
        return SliceResult(
            grad=self.optimizer.flat_grad, loss=float(loss.detach()), updates=updates
        )

    def train_and_step(
        self,
        ev: EventBatch,
        weight: torch.Tensor | None,
        neg_BQ: torch.Tensor,
        num_observe: int,
        global_size: int,
        collective,
        gather: bool = False,
        start: float | None = None,
    ) -> tuple[float, dict | list | None]:
        """A whole data-parallel step in a group of trainers: this slice's gradient, summed
        over the group by `collective` (an empty slice contributes zeros), then the optimizer
        step. Returns the slice's loss and node-state updates; `apply_updates` with every
        slice's updates completes the step. With `gather`, the batch's loss (the slices'
        losses summed in rank order) and the updates of every slice (in rank order) are
        returned instead, exchanged over `collective` during backward. `start`: the global
        batch's start (`train_slice`).

        Every collective of the step finishes before anything of this replica changes (the
        optimizer step comes last): a replica whose group fails mid-step keeps the state of
        the step before, one that returned holds the whole step (see `recovery`)."""
        t_step = time.perf_counter()
        self.tracer.begin(self.steps)
        exchange = None
        if gather:
            exchange = lambda loss, u: collective.all_gather_tensors_async(  # noqa: E731
                (loss, u, self.vote), self.device
            )
        grad = collective.gradient(self.optimizer.flat_grad, self.steps, self.optimizer.sizes,
                                   getattr(self, "grad_sync", None))  # fmt: skip
        grad = collective.begin_gradient(grad)  # with comm.overlap: buckets leave in backward
        self._round = grad.round
        try:
            if len(ev):
                result = self.train_slice(ev, weight, neg_BQ, num_observe, global_size, start,
                                          exchange)  # fmt: skip
                loss, updates = result["loss"], result["updates"]
            else:
                self.optimizer.zero_grad()
                loss, updates = 0.0, None if exchange is None else exchange(0.0, None)
        finally:
            self._round = None
        t0 = time.perf_counter()
        self.grad_sync = collective.allreduce_sum_(grad).sync
        t1 = time.perf_counter()
        if gather:
            parts = updates.wait()
            loss = float(sum(part[0] for part in parts))
            updates = [part[1] for part in parts]
            self.group_vote = max(part[2] for part in parts)
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        if self.tracer.on:
            self._trace_allreduce(t0, t1, collective)
        self.seconds["allreduce"] += t1 - t0
        self._phase("exchange", t1, t2, start="wait")
        self._phase("optimizer", t2, t3)
        self.tracer.add(
            "step", t_step, t3, world=collective.world, events=len(ev), global_size=global_size
        )
        self.steps += 1
        return loss, updates

    def apply(self, reduced_grad: torch.Tensor, updates: list) -> None:
        """Optimizer step with the reduced gradient, then every slice's node-state updates
        (which shards apply instead when they hold the node state)."""
        flat = self.optimizer.flat_grad
        t0 = time.perf_counter()
        if reduced_grad is not flat:
            flat.copy_(reduced_grad)
        self.optimizer.step()
        self.steps += 1
        self._phase("optimizer", t0, time.perf_counter())
        self.apply_updates(updates)

    @torch.no_grad()
    def eval_slice(
        self, ev: EventBatch, neg_BQ: torch.Tensor, observe: bool, start: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
        """(pos logits [B], negative logits [B, Q]) on the host, and the node-state updates of
        recording `ev` (None unless `observe`); chunked so one forward has at most
        `eval_max_roots` roots. `start`: the earliest time of the global batch (`train_slice`;
        None: this slice's)."""
        if self.model.training:
            self.model.eval()
        self.tracer.begin(self.evals, "eval")
        self.evals += 1
        q = neg_BQ.shape[1]
        step = max(1, self.eval_max_roots // (2 + q))
        pos_parts, neg_parts = [], []
        start = self._start(start, ev.t)
        for lo in range(0, len(ev), step):
            part = ev.select(slice(lo, lo + step))
            (pos, negl), _ = self._forward(part, neg_BQ[lo : lo + step], None, start)
            pos_parts.append(pos.float().cpu())
            neg_parts.append(negl.float().cpu())
            if observe:
                self.model.fold()  # later chunks read it; the events are recorded at the end
            else:
                self.model.discard()
        updates = None
        if observe:
            recorded = join_edge_features(self.edge_cache, [], ev) if len(ev) else ev
            updates = self.model.take_updates(recorded.to(self.device))
        return torch.cat(pos_parts), torch.cat(neg_parts), updates

    def _start(self, given: float | None, t_new: torch.Tensor) -> float | None:
        """The batch's start for `sampler.history: batch`: `given`, else the earliest of this
        slice's new events' times `t_new` (unused with `history: event`)."""
        if given is not None or self.config.sampler.history != "batch":
            return given
        return batch_start(t_new)

    # ---- node state -------------------------------------------------------------------------

    def apply_updates(self, updates: list) -> None:
        t0 = time.perf_counter()
        if self.state_source is None:
            self.model.apply_updates(updates)
        self._phase("apply", t0, time.perf_counter())

    def abort_step(self) -> None:
        """Forget a step that failed midway (its group lost a member): the forward pass's
        pending node-state rows and the gradient; the state of the last whole step stays."""
        self.model.discard()
        self.optimizer.zero_grad()

    def _phase(self, key: str, t0: float, t1: float, span: str | None = None, **args) -> None:
        """Count `t1 - t0` seconds to phase `key` and, if this step is traced, record the
        span (named `span`, else `key`; see `tidegraph.timeline`)."""
        self.seconds[key] += t1 - t0
        if self.tracer.on:
            self.tracer.add(span or key, t0, t1, **args)

    def _trace_allreduce(self, t0: float, t1: float, collective) -> None:
        """The gradient all-reduce's span: bytes this rank sent, what fp32 would have sent,
        each bucket's bits; with `comm.overlap` a span per bucket from its send to its end."""
        world = collective.world
        fp32 = ring_bytes(self.optimizer.flat_grad.numel() * 4, world)
        stats = getattr(self.grad_sync, "last_stats", None)
        if stats is None or stats.step != self.steps:
            self.tracer.add("allreduce", t0, t1, bytes=fp32, bytes_fp32=fp32, bits=[32],
                            world=world)  # fmt: skip
            return
        self.tracer.add("allreduce", t0, t1, bytes=stats.bytes_sent, bytes_fp32=stats.bytes_fp32,
                        bits=list(stats.bits), world=world, early=stats.early)  # fmt: skip
        for i, (s0, s1, nbytes, bits) in enumerate(stats.buckets):
            self.tracer.add("allreduce bucket", s0, s1, "bucket", bucket=i, bytes=nbytes,
                            bits=bits)  # fmt: skip

    def take_trace(self) -> list[dict]:
        """Spans recorded since the last call (`tidegraph.timeline`)."""
        return self.tracer.take()

    def take_seconds(self) -> dict[str, float]:
        """Seconds per step phase since the last call (and start counting anew)."""
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out

    def take_step_edges(self) -> list[int]:
        """Sampled edges of each training slice since the last call."""
        out = list(self.step_edges)
        self.step_edges.clear()
        return out

    def reset_state(self) -> None:
        self.model.reset_state()

    def node_state(self) -> dict:
        return self.model.node_state()

    def load_node_state(self, state: dict) -> None:
        self.model.load_node_state(state)

    def restore_cache(self, eids: torch.Tensor) -> None:
        """GNNFlow's restoration: seed the feature cache with the round's edges."""
        if self.edge_cache is not None:
            self.edge_cache.restore(eids)

    def _scratch_keys(self, state: dict) -> set[str]:
        """Keys of `state` (the model's state dict) that hold node-state tables which are
        only a pass's scratch copy (sharded placement: the shards own node state)."""
        if self.state_source is None:
            return set()
        ptrs = {t.data_ptr() for t in self.model.state_tables().values()}
        return {k for k, v in state.items() if v.data_ptr() in ptrs}

    def model_state(self) -> dict:
        """The model's state without node-state scratch tables (sharded placement)."""
        state = self.model.state_dict()
        scratch = self._scratch_keys(state)
        return {k: v for k, v in state.items() if k not in scratch}

    # ---- state ------------------------------------------------------------------------------

    def state_chunks(self, store: str) -> dict:
        """`state_dict()` with its large tensors written to the checkpoint store at `store`
        and refs in their place: a checkpoint's bulk written where it is held. Replicated
        node-state tables are written as the rows changed since the last checkpoint over
        what earlier ones wrote (`DeltaTables`), when the model tracks them."""
        state = self.state_dict()
        model = state["model"]
        have = CheckpointStore.at(store).chunk_keys()  # one listing for every put here
        tables = {t.data_ptr() for t in self.model.state_tables().values() if t.numel()}
        keys = [k for k, v in model.items() if v.numel() and v.data_ptr() in tables]
        if keys:
            tables = {k: model[k] for k in keys}
            model.update(self._deltas.put_tables(store, tables, self.model, have))
        return put_state(store, state, have=have)

    def state_gathered(self, store: str, have: set[str]) -> tuple[dict, dict]:
        """`state_chunks(store)` for a store this process does not reach, and the chunks to
        write there (`checkpoint.gathered`: the caller writes them)."""
        return gathered(lambda: self.state_chunks(store), have)

    def state_dict(self) -> dict:
        cache = self.edge_cache
        # gradient compression (`comm:`): this rank's `GradSync` (bits, residuals, totals), a
        # state dict loaded but not used yet, or None (no compressed step taken)
        sync = getattr(self, "grad_sync", None)
        return {
            "rank": self.rank,
            "steps": self.steps,
            # in storages of their own: a view of the flat parameter buffer would carry all of
            # it wherever the state goes (to the driver, into a checkpoint)
            "model": compact(self.model_state()),
            "optimizer": compact(self.optimizer.state_dict()),
            "edge_cache": None if cache is None else cache.state_dict(),
            "features": None if cache is None else cache.store.state_dict(),
            "comm": sync.state_dict() if hasattr(sync, "state_dict") else sync,
        }

    def load_chunks(self, state: dict, store: str) -> None:
        """`load_state_dict` of a state whose large tensors are refs to the checkpoint store
        at `store` (read here, where they are held: not through the driver)."""
        self.load_state_dict(CheckpointStore.at(store).resolve(state))

    def load_state_dict(self, state: dict) -> None:
        self._deltas.forget()  # node-state tables replaced: written whole next time
        params = self._param_ids()
        # in place, unless a node table grew; without node-state tables when shards hold them
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        scratch = self._scratch_keys(self.model.state_dict())
        if unexpected or set(missing) - scratch:
            raise ValueError(
                f"TrainerCore.load_state_dict: model state does not fit this model (missing "
                f"{sorted(set(missing) - scratch)}, unexpected {sorted(unexpected)})"
            )
        if params != self._param_ids():
            self.new_optimizer()
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state.get("steps", 0)
        self.grad_sync = state.get("comm")  # made live by the collective at the next step
        if self.edge_cache is not None:
            self.edge_cache.store.load_state_dict(state["features"])
            self.edge_cache.load_state_dict(state["edge_cache"])


def _blocks_to(blocks: list, device: torch.device) -> list:
    if blocks and isinstance(blocks[0], list):
        return [_blocks_to(b, device) for b in blocks]
    return [b if _on(b.dst_ids, device) else b.to(device) for b in blocks]


def _on(x: torch.Tensor, device: torch.device) -> bool:
    """Whether `x` is on `device`; "cuda" without an index means the current device (tensors
    always carry one, and torch.device("cuda") != torch.device("cuda:0"))."""
    if x.device.type != device.type:
        return False
    if device.index is None and device.type == "cuda":
        return x.device.index == torch.cuda.current_device()
    return device.index is None or x.device.index == device.index
