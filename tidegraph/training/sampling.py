"""Negative destinations, replay selection (each with its own seeded generator), and the
options of a trainer's neighbour requests.

Generators live on the host so draws are identical on CPU and CUDA runs; results are moved to
the training device by the caller.

Replay policies pick `m` old events (positions in [0, end)) and a loss weight for each:
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
from tidegraph.storage.events import EventBatch

__all__ = [
    "ImportanceReplay",
    "NegativeSampler",
    "UniformReplay",
    "build_replay",
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


class UniformReplay:
    """m distinct old events uniformly at random (all of them when m >= end)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def select(
        self, events: EventBatch, end: int, increment: slice, m: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [m'], weights [m']) of replayed events among events[:end]."""
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

    def scores(self, events: EventBatch, end: int, increment: slice) -> torch.Tensor:
        """s_e for events[:end] given the latest increment's events."""
        src, dst = events.src[:end], events.dst[:end]
        n_nodes = int(torch.maximum(events.src.max(), events.dst.max())) + 1
        upto = increment.stop
        deg = torch.bincount(
            torch.cat([events.src[:upto], events.dst[:upto]]), minlength=n_nodes
        ).double()
        inc_nodes = torch.cat([events.src[increment], events.dst[increment]])
        new = torch.bincount(inc_nodes, minlength=n_nodes).double()
        change = new / deg.clamp(min=1)
        return 0.5 * (change[src] + change[dst])

    def select(
        self, events: EventBatch, end: int, increment: slice, m: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if end == 0 or m == 0:
            return torch.empty(0, dtype=torch.int64), torch.empty(0)
        s = self.scores(events, end, increment)
        total = float(s.sum())
        uniform = torch.full_like(s, 1.0 / end)
        p = uniform if total == 0 else (1 - self.floor) * s / total + self.floor * uniform
        # inverse-CDF draws: torch.multinomial caps the categories at 2^24 old events
        cdf = torch.cumsum(p, 0)
        u = torch.rand(m, generator=self.generator, dtype=torch.float64) * cdf[-1]
        pos = torch.searchsorted(cdf, u, right=True).clamp_(max=end - 1)
        weight = (1.0 / (end * p[pos])).float()
        return pos, weight


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
