"""Negative destinations, replay selection (each with its own seeded generator), and the
options of a trainer's neighbour requests.

Generators live on the host so draws are identical on CPU and CUDA runs; results are moved to
the training device by the caller.

Replay policies pick `m` old events (positions in a pool of old events: `ReplayReservoir`, a
uniform sample of the history of bounded size) and a loss weight for each:
- `UniformReplay` (GNNFlow): m distinct events uniformly, weight 1.
- `ImportanceReplay` (in the spirit of SEA-ER, structure-evolution-aware experience replay):
  an old event's score is how much its endpoints' neighbourhoods changed in the latest
  increment, s_e = mean over its two endpoints v of new_v / deg_v (new_v: v's events in the
  increment, deg_v: all of v's events so far). Draws are with replacement from
  p_e = (1 - floor) s_e / sum(s) + floor / n, and each draw is weighted 1 / (n p_e), so the
  weighted replay loss is an unbiased estimate of the uniform replay loss (the floor keeps every
  p_e > 0 and bounds the weights by 1 / floor).
"""

from __future__ import annotations

import torch

from tidegraph.rng import load_generator_state
from tidegraph.storage.checkpoint import CheckpointStore, pack_rows, put_state, unpack_rows
from tidegraph.storage.events import EventBatch

__all__ = [
    "ImportanceReplay",
    "NegativeSampler",
    "ReplayReservoir",
    "UniformReplay",
    "build_replay",
    "node_degree",
    "sample_options",
]


class NegativeSampler:
    """Uniform negative destinations from a pool of candidate ids (grown as the stream goes)."""

    def __init__(self, seed: int, pool: torch.Tensor | None = None) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.pool = torch.empty(0, dtype=torch.int64) if pool is None else pool.cpu().unique()

    def add(self, dst: torch.Tensor) -> None:
        self.pool = torch.unique(torch.cat([self.pool, dst.cpu()]))

    def sample(self, b: int, q: int) -> torch.Tensor:
        if self.pool.numel() == 0:
            raise ValueError("NegativeSampler: no candidate destinations yet")
        idx = torch.randint(self.pool.numel(), (b, q), generator=self.generator)
        return self.pool[idx]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "pool": self.pool.clone()}

    def load_state_dict(self, state: dict) -> None:
        load_generator_state(self.generator, state["generator"], "negative sampler")
        self.pool = state["pool"].to("cpu").clone()


class ReplayReservoir:
    """A uniform sample of at most `capacity` old events: Vitter's algorithm R, vectorized
    (the k-th event seen, counting from 0, takes a uniformly drawn slot of the first k + 1
    when that slot is below `capacity`; of a batch's events drawing the same slot, the later
    one holds it). Until `capacity` events were added, slot i holds the i-th event added, so
    replay over the reservoir draws what replay over the whole history would. Its events are
    the driver's only copy of old events: replay and forgetting probes draw from it, and its
    memory is bounded by `capacity` whatever the length of the run.

    Its state is laid out for incremental checkpoints (`storage.checkpoint`, which writes a
    chunk once): while filling, the events only grow at the end; once full, replacements
    fall on random slots, which would change every chunk, so the state is a base (the events
    as they were when the last compaction took place) and a patch, the replacements since
    then (slot and event, one packed row each, in order), which only grows at the end. When
    the patch reaches `capacity // 4` rows, the base is taken again and the patch emptied.
    While filling, the events are saved as packed rows too (one table growing at its end).
    Given the checkpoint store it is saved to (`state_dict(store)`), the base is written there
    once and leaves memory: later checkpoints reference it, and a state without a store (or
    for another) reads it back. Memory: 32 bytes an event, and at most 10 bytes an event for
    the patch (the base is held from a compaction to the next checkpoint only)."""

    def __init__(self, capacity: int, seed: int) -> None:
        self.capacity = capacity
        self.generator = torch.Generator().manual_seed(seed)
        self.events: EventBatch | None = None
        self.seen = 0  # events added so far
        self.base: EventBatch | None = None  # the events at the last compaction, until written
        self._written: tuple[str, dict] | None = None  # (store, refs) of the base written there
        self._patch: list[torch.Tensor] = []  # packed rows (slot, event) since the base
        self._patch_rows = 0
        self.compactions = 0

    @property
    def full(self) -> bool:
        """Whether replacements began (the state is a base and a patch)."""
        return self.base is not None or self._written is not None

    @property
    def size(self) -> int:
        return 0 if self.events is None else len(self.events)

    def add(self, events: EventBatch) -> None:
        """Events that became old (an increment, or phase 1, once learned), in stream order:
        which events (src, dst, t, eid) only. Their edge features are read by eid from the
        shards' feature stores, as every batch's are; labels are not used by learning."""
        events = EventBatch(events.src, events.dst, events.t, events.eid)
        n = len(events)
        room = min(n, self.capacity - self.size)
        if room > 0:  # filling: appended in order (copied: the caller's tensors stay theirs)
            head = events.select(slice(0, room))
            self.events = EventBatch.cat([head] if self.events is None else [self.events, head])
        if room < n:
            k = self.seen + room + torch.arange(n - room, dtype=torch.float64)
            u = torch.rand(n - room, generator=self.generator, dtype=torch.float64)
            slot = (u * (k + 1)).floor().long()
            taken = (slot < self.capacity).nonzero().squeeze(1)
            slot = slot[taken]
            order = torch.argsort(slot, stable=True)  # the same slot: the latest event wins
            last = torch.ones(order.numel(), dtype=torch.bool)
            last[:-1] = slot[order][1:] != slot[order][:-1]
            which, where = room + taken[order[last]], slot[order[last]]
            self._replace(where, events.select(which))
        self.seen += n

    def _replace(self, where: torch.Tensor, new: EventBatch) -> None:
        """Slots `where` (distinct) take events `new`, recorded in the patch."""
        if where.numel() == 0:
            return
        if not self.full:  # the first replacement: the events so far are the base
            self._compact()
        for name, mine in _columns(self.events):
            mine[where] = getattr(new, name)
        self._patch.append(pack_rows([where, *(col for _, col in _columns(new))]))
        self._patch_rows += int(where.numel())
        if self._patch_rows >= self.capacity // 4:
            self._compact()

    def _compact(self) -> None:
        """The events now become the base (never changed again: what `state_dict` returned
        stays as it was) and replacements go to a copy; the patch is emptied."""
        self.base, self._written = self.events, None
        self.events = EventBatch(**{name: col.clone() for name, col in _columns(self.base)})
        self._patch, self._patch_rows = [], 0
        self.compactions += 1

    def state_dict(self, store: str | None = None) -> dict:
        """The state; `store`: the checkpoint store (URI) it is saved to, where the base is
        written once and referenced from then on (refs in place of its tensors)."""
        ev = self.events
        if len(self._patch) > 1:  # one tensor: it grows at its end between checkpoints
            self._patch = [torch.cat(self._patch)]
        filling = ev is not None and not self.full
        return {"capacity": self.capacity, "seen": self.seen,
                "generator": self.generator.get_state(),
                # while filling, the events as packed rows; once full, the base and the patch
                "rows": pack_rows([col for _, col in _columns(ev)]) if filling else None,
                "dtypes": None if ev is None else [str(col.dtype) for _, col in _columns(ev)],
                "base": self._base_state(store) if self.full else None,
                "patch": self._patch[0] if self._patch else None}  # fmt: skip

    def _base_state(self, store: str | None) -> dict:
        """The base's columns: refs to chunks of `store`, written there the first time (the
        base then leaves memory), or tensors (no store; read back from where it was written
        when it is no longer held)."""
        if self.base is None:
            held, refs = self._written
            if store == held:
                return refs  # every checkpoint since the compaction references it: kept
            self.base = EventBatch(**CheckpointStore.at(held).resolve(refs))
            self._written = None
        if store is None:
            return dict(_columns(self.base))
        refs = put_state(store, dict(_columns(self.base)), inline=0)
        self.base, self._written = None, (store, refs)
        return refs

    def load_state_dict(self, state: dict) -> None:
        self.capacity, self.seen = state["capacity"], state["seen"]
        load_generator_state(self.generator, state["generator"], "replay reservoir")
        base = state.get("base")
        patch = state.get("patch")
        self._patch = [] if patch is None else [patch.to("cpu").clone()]
        self._patch_rows = 0 if patch is None else int(patch.shape[0])
        self._written = None
        if base is None:  # filling (or a checkpoint written before the patch)
            self.base = None
            rows, ev = state.get("rows"), state.get("events")  # events: before packed rows
            if rows is not None:
                dtypes = [getattr(torch, d.removeprefix("torch.")) for d in state["dtypes"]]
                self.events = EventBatch(*unpack_rows(rows.to("cpu"), dtypes))
            elif ev is not None:
                own = {k: None if v is None else v.to("cpu").clone() for k, v in ev.items()}
                self.events = EventBatch(**own)
            else:
                self.events = None
            return
        self.base = EventBatch(**{k: base[k].to("cpu").clone() for k in _COLUMNS})
        self.events = EventBatch(**{name: col.clone() for name, col in _columns(self.base)})
        if patch is not None:
            dtypes = [torch.int64] + [col.dtype for _, col in _columns(self.base)]
            slot, *values = unpack_rows(self._patch[0], dtypes)
            latest = torch.full((self.capacity,), -1, dtype=torch.int64)  # the last row wins
            latest.scatter_reduce_(0, slot, torch.arange(slot.numel()), reduce="amax")
            where = (latest >= 0).nonzero().squeeze(1)
            for (_, mine), col in zip(_columns(self.events), values, strict=True):
                mine[where] = col[latest[where]]


_COLUMNS = ("src", "dst", "t", "eid")  # which event: all the reservoir keeps


def _columns(ev: EventBatch) -> list[tuple[str, torch.Tensor]]:
    return [(name, getattr(ev, name)) for name in _COLUMNS]


class UniformReplay:
    """m distinct old events uniformly at random from `pool` (all of them when m >= its size)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def select(
        self, pool: EventBatch, changed: torch.Tensor | None, degree: torch.Tensor, m: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in `pool` [m'], weights [m']) of replayed events; `changed`: every
        node's events in the latest increment (`node_degree` of it), `degree`: every node's
        events so far (both unused here)."""
        end = len(pool)
        m = min(m, end)
        pos = torch.randperm(end, generator=self.generator)[:m]
        return pos, torch.ones(m, dtype=torch.float32)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        load_generator_state(self.generator, state["generator"], "replay")


class ImportanceReplay(UniformReplay):
    """Structure-evolution-weighted draws with unbiasing weights (see the module docstring)."""

    def __init__(self, seed: int, floor: float = 0.1) -> None:
        super().__init__(seed)
        self.floor = floor

    @staticmethod
    def scores(pool: EventBatch, changed: torch.Tensor, degree: torch.Tensor) -> torch.Tensor:
        """s_e for the events of `pool` given every node's events in the latest increment
        `changed` and every node's event count so far `degree` (the increment included)."""
        change = changed.double() / degree.double().clamp(min=1)
        return 0.5 * (change[pool.src] + change[pool.dst])

    def select(
        self, pool: EventBatch, changed: torch.Tensor | None, degree: torch.Tensor, m: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = len(pool)
        if end == 0 or m == 0:
            return torch.empty(0, dtype=torch.int64), torch.empty(0)
        s = self.scores(pool, changed, degree)
        total = float(s.sum())
        uniform = torch.full_like(s, 1.0 / end)
        p = uniform if total == 0 else (1 - self.floor) * s / total + self.floor * uniform
        # inverse-CDF draws: torch.multinomial caps the categories at 2^24 old events
        cdf = torch.cumsum(p, 0)
        u = torch.rand(m, generator=self.generator, dtype=torch.float64) * cdf[-1]
        pos = torch.searchsorted(cdf, u, right=True).clamp_(max=end - 1)
        weight = (1.0 / (end * p[pos])).float()
        return pos, weight


def node_degree(degree: torch.Tensor, events: EventBatch, num_nodes: int) -> torch.Tensor:
    """`degree` (events per node) with `events` counted, grown to `num_nodes` entries."""
    counts = torch.bincount(torch.cat([events.src, events.dst]), minlength=num_nodes)
    out = torch.zeros(max(counts.numel(), degree.numel()), dtype=torch.int64)
    out[: degree.numel()] = degree
    out[: counts.numel()] += counts
    return out


def build_replay(kind: str, seed: int, floor: float = 0.1) -> UniformReplay:
    if kind == "uniform":
        return UniformReplay(seed)
    if kind == "importance":
        return ImportanceReplay(seed, floor)
    raise ValueError(f"continual.replay must be 'uniform' or 'importance', got {kind!r}")


# `root_dedup: auto` deduplicates a batch's roots when at most this share of them are distinct
# (an e-mail stream: ~0.84; Wikipedia and CollegeMsg: ~1.0). The sampler looks at every batch:
# the decision is a function of the batch alone, so a run's bits (deduplication changes float
# summation order in backward) do not depend on how its batches were cut among trainers, nor
# on a resize or a recovery that copied another trainer's state
AUTO_ROOT_DEDUP = 0.9


def sample_options(config, model, batch_start: float | None) -> dict:
    """`t_cap` and `dedup_roots` of a trainer's `sample` request, from `config` (a
    `SamplerConfig`): with `history: batch` roots see only edges before `batch_start`, the
    earliest time of the global batch's new events (None: none new, as in a batch of replayed
    events alone: their own times); `root_dedup` applies to models whose embeddings allow it
    (`root_dedup`)."""
    dedup = {"always": 1.0, "never": None}.get(config.root_dedup, AUTO_ROOT_DEDUP)
    if not model.root_dedup or (config.root_dedup == "auto" and config.strategy != "recent"):
        dedup = None
    cap = batch_start if config.history == "batch" else None
    return {"t_cap": cap, "dedup_roots": dedup}
