"""A dynamic feature cache (on the GPU, or any device) in front of a `FeatureStore`.

`CachedFeatureStore` keeps up to `capacity` rows of the store on its device, in the store's
encoded form (so int8/fp16 rows also cost less to move and to keep). All bookkeeping is
vectorized: an id -> slot table, a slot -> id table and per-slot counters (access count, last
and first access tick); victims are chosen with one `topk` per request, never a loop per id.

Semantics (what the tests hold it to):
- `get(ids)` returns exactly the store's rows for `ids` (duplicates and empty requests
  included), as float32 on the cache's device. Hits and misses count distinct ids per request
  (a duplicated miss is fetched once); LFU counters add the id's multiplicity.
- Admission on a miss never evicts an id the same request touched, so a request with at most
  `capacity` distinct ids leaves them all cached (except under `static` and `recency`, which
  decide by their own rule). With more distinct misses than free room only the best ones are
  admitted (most repeated, then newest id), the rest are served without being cached.
- Policies, by what is evicted first: `lru` the least recently touched; `fifo` the earliest
  admitted; `lfu` the least often touched (ties: least recently); `recency` the smallest id,
  and a miss is admitted only when its id is larger than the victim's (edge ids grow with time,
  so this keeps the newest edges: temporal samplers favour them); `static` never changes on a
  miss, its contents are chosen by `restore` (the most touched ids of pre-sampled batches).
- `restore(ids)` re-seeds the cache at the start of a retraining round with the ids the round
  will touch first (earliest first; by touch count for `lfu` and `static`).
- Contents persist across calls, rounds and growth; given a `ratio`, capacity follows
  `ratio * store.num_rows` as the store grows. Writes go through the cache (`put`, `append`)
  so cached copies stay equal to the store; `admit_on_write` also caches what is written (the
  newest edges' features arrive with their events, so they cost no extra transfer in a trainer).
- `enabled=False` (the default on a machine without CUDA when no device is named) makes it a
  pass-through with capacity 0: same code path, every id a miss. Naming `device="cpu"` with
  `enabled=True` caches on the CPU, which is how the eviction logic is tested without a GPU.
- `demote(ids)` is a hint that ids will not be read soon: they go first (after empty slots)
  unless read again. `RecentWindowTracker` finds such ids for a `recent` sampler: edges no
  longer among the k newest of either endpoint can never be sampled again.
- Stats: hits, misses, bytes copied from the store to the cache device (`bytes_h2d`; on a CPU
  cache these are host copies), host wall time of `get` (on CUDA without a final sync).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import torch

from tidegraph.storage.features import EncodedRows, FeatureStore, decode
from tidegraph.storage.idmap import check_ids

__all__ = ["POLICIES", "CacheConfig", "CachedFeatureStore", "RecentWindowTracker"]

log = logging.getLogger(__name__)

POLICIES = ("lru", "lfu", "fifo", "recency", "static")
_EMPTY_KEY = -(2**63)
_PROTECTED_KEY = 2**63 - 1
_TICK_BITS = 32
_ID_BITS = 40
_ARRAYS = ("slot_ids", "count", "last", "first", "demoted", "data", "scale")


@dataclass(kw_only=True)
class CacheConfig:
    """Size, policy and placement of a `CachedFeatureStore` (give capacity or ratio)."""

    capacity: int | None = None  # rows
    ratio: float | None = None  # capacity = ceil(ratio * store.num_rows), growing with it
    policy: str = "lru"
    device: str | None = None  # None: "cuda" when available, else "cpu"
    enabled: bool | None = None  # None: cache on CUDA, pass through on CPU
    admit_on_write: bool = False  # put/append also cache the rows written

    def __post_init__(self) -> None:
        if (self.capacity is None) == (self.ratio is None):
            raise ValueError("CacheConfig: give exactly one of capacity and ratio")
        if self.capacity is not None and (int(self.capacity) != self.capacity or self.capacity < 0):
            raise ValueError(
                f"CacheConfig.capacity must be a non-negative integer, got {self.capacity}"
            )
        if self.ratio is not None and not (self.ratio >= 0 and math.isfinite(self.ratio)):
            raise ValueError(f"CacheConfig.ratio must be a finite number >= 0, got {self.ratio}")
        if self.policy not in POLICIES:
            raise ValueError(f"CacheConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.device is not None:
            try:
                kind = torch.device(self.device).type
            except RuntimeError as err:
                raise ValueError(f"CacheConfig.device: {err}") from None
            if kind == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"CacheConfig.device is {self.device!r}, but CUDA is absent")

    def resolved_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def resolved_enabled(self) -> bool:
        if self.enabled is not None:
            return self.enabled
        return self.resolved_device().type == "cuda"


class CachedFeatureStore(FeatureStore):
    """A `FeatureStore` that serves rows from a device cache and fetches misses from `store`."""

    def __init__(self, store: FeatureStore, config: CacheConfig | None = None, **overrides):
        self.store = store
        self.config = replace(config, **overrides) if config else CacheConfig(**overrides)
        self.dim = store.dim
        self.precision = store.precision
        self.device = self.config.resolved_device()
        self.enabled = self.config.resolved_enabled()
        self._tick = 0
        self._capacity = 0
        self._used = 0  # slots at and after this one have never been filled since allocation
        self._id_to_slot = torch.full((0,), -1, dtype=torch.int64, device=self.device)
        self._allocate(0)
        self.reset_stats()
        log.info(
            "feature cache: policy %s on %s, %s", self.config.policy, self.device,
            "enabled" if self.enabled else "pass-through (capacity 0)",
        )  # fmt: skip

    # ---- FeatureStore -------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return self.store.num_rows

    @property
    def capacity(self) -> int:
        """Slots currently available (follows the store's size when given as a ratio)."""
        return self._capacity

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows [len(ids), dim] on the cache's device, equal to the store's rows."""
        start = time.perf_counter()
        ids = check_ids(ids, "CachedFeatureStore.get").to(self.device)
        self._sync_capacity()
        self._tick += 1
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        out = torch.empty((uniq.shape[0], self.dim), dtype=torch.float32, device=self.device)
        if uniq.numel():
            self._serve(uniq, counts, out)
        self._stats["requests"] += 1
        self._stats["rows"] += int(ids.shape[0])
        self._stats["lookup_seconds"] += time.perf_counter() - start
        return out[inverse]

    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write through to the store; cached copies are refreshed from it."""
        ids = check_ids(ids, "CachedFeatureStore.put")
        self.store.put(ids, rows)
        self._after_write(ids)

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        ids = self.store.append(rows)
        self._after_write(ids)
        return ids

    # ---- rounds -------------------------------------------------------------------------------

    def restore(self, ids: torch.Tensor) -> None:
        """Re-seed with the ids a round touches first (for `static`: its whole contents)."""
        ids = check_ids(ids, "CachedFeatureStore.restore").to(self.device)
        self._sync_capacity()
        self._tick += 1
        ids = ids[ids < self.store.num_rows]  # the store's default rows are never cached
        chosen, counts = _rank_for_restore(ids, self._capacity, self.config.policy)
        if self.config.policy == "static":
            self._clear()
        if chosen.numel() == 0:
            return
        self._grow_index(int(chosen.max()) + 1)
        slot = self._id_to_slot[chosen]
        cached = slot >= 0
        self._touch(slot[cached], counts[cached])
        missing = chosen[~cached]
        rows = self._fetch(missing, "bytes_h2d_restore")
        self._admit(missing, counts[~cached], rows, protected=slot[cached], force=True)

    def invalidate(self, ids: torch.Tensor | None = None) -> None:
        """Drop `ids` (all when None) from the cache, e.g. after writing the store directly."""
        if ids is None:
            self._clear()
            return
        ids = check_ids(ids, "CachedFeatureStore.invalidate").to(self.device)
        ids = ids[ids < self._id_to_slot.shape[0]]
        slot = self._id_to_slot[ids]
        slot = slot[slot >= 0]
        self._slot_ids[slot] = -1
        self._id_to_slot[ids] = -1

    def demote(self, ids: torch.Tensor) -> int:
        """Hint that `ids` will not be read again soon: cached ones are evicted first (after
        empty slots) unless read before then. Returns how many cached ids were demoted."""
        ids = check_ids(ids, "CachedFeatureStore.demote").to(self.device)
        ids = ids[ids < self._id_to_slot.shape[0]]
        slot = self._id_to_slot[ids]
        slot = slot[slot >= 0]
        self._demoted[slot] = True
        self._stats["demoted"] += int(slot.shape[0])
        return int(slot.shape[0])

    def resize(self, *, capacity: int | None = None, ratio: float | None = None) -> None:
        """Change the size; shrinking keeps the slots the policy values most."""
        self.config = replace(self.config, capacity=capacity, ratio=ratio)
        self._sync_capacity()

    def cached_ids(self) -> torch.Tensor:
        """Ids held now, sorted."""
        ids = self._slot_ids[: self._capacity]
        return ids[ids >= 0].sort().values

    # ---- metrics ------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        s = dict(self._stats)
        looked_up = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / looked_up if looked_up else 0.0
        s["bytes_h2d"] = s["bytes_h2d_miss"] + s["bytes_h2d_write"] + s["bytes_h2d_restore"]
        s["capacity"] = self._capacity
        s["size"] = int((self._slot_ids[: self._capacity] >= 0).sum())
        return s

    def reset_stats(self) -> None:
        self._stats = dict.fromkeys(
            ("hits", "misses", "requests", "rows", "evictions", "demoted", "bytes_h2d_miss",
             "bytes_h2d_write", "bytes_h2d_restore"),
            0,
        )  # fmt: skip
        self._stats.update(lookup_seconds=0.0, fetch_seconds=0.0)

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        c = self._capacity
        cpu = lambda x: x[:c].cpu().clone() if x is not None else None
        arrays = {name: cpu(x) for name, x in zip(_ARRAYS, self._arrays(), strict=True)}
        return {"tick": self._tick, "capacity": c, **arrays, "stats": dict(self._stats)}

    def load_state_dict(self, state: dict) -> None:
        c = state["capacity"]
        self._allocate(c)
        for name, x in zip(_ARRAYS, self._arrays(), strict=True):
            if x is not None:
                x[:c] = state[name].to(self.device)
        self._capacity = c
        self._used = c
        self._tick = state["tick"]
        self._stats = dict(state["stats"])
        self._rebuild_index()
        self._sync_capacity()

    # ---- lookup -------------------------------------------------------------------------------

    def _serve(self, uniq: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> None:
        """Fill `out` with the rows of the distinct ids `uniq` (sorted); admit misses.

        Only ids the store holds are cached; others (the store answers them with its default
        row) are fetched every time, and a pass-through cache keeps no id table at all, so a
        huge id never sizes the table."""
        size = min(int(uniq[-1]) + 1, self.store.num_rows) if self._capacity else 0
        self._grow_index(size)
        known = uniq < size
        slot = torch.full_like(uniq, -1)
        if size:
            slot = torch.where(known, self._id_to_slot[uniq.clamp(max=size - 1)], slot)
        hit = slot >= 0
        hit_slots = slot[hit]
        out[hit] = decode(self._rows_at(hit_slots))
        self._touch(hit_slots, counts[hit])
        miss = ~hit
        miss_ids = uniq[miss]
        start = time.perf_counter()
        rows = self._fetch(miss_ids, "bytes_h2d_miss")
        out[miss] = decode(rows)
        self._stats["fetch_seconds"] += time.perf_counter() - start
        if self.config.policy != "static" and size:
            admit = known[miss]
            self._admit(miss_ids[admit], counts[miss][admit], _take(rows, admit), hit_slots)
        self._stats["hits"] += int(hit_slots.shape[0])
        self._stats["misses"] += int(miss_ids.shape[0])

    def _fetch(self, ids: torch.Tensor, counter: str) -> EncodedRows:
        """Encoded rows of `ids` from the store, on the cache's device."""
        rows = self.store.fetch(ids.cpu()).to(self.device, non_blocking=True)
        self._stats[counter] += rows.nbytes
        return rows

    def _rows_at(self, slots: torch.Tensor) -> EncodedRows:
        scale = self._scale[slots] if self._scale is not None else None
        return EncodedRows(self._data[slots], scale)

    def _touch(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        self._count[slots] += counts
        self._last[slots] = self._tick
        self._demoted[slots] = False  # read again: the hint was wrong

    def _admit(
        self,
        ids: torch.Tensor,
        counts: torch.Tensor,
        rows: EncodedRows | None,
        protected: torch.Tensor,
        force: bool = False,
    ) -> None:
        """Place up to `capacity - len(protected)` of `ids` (distinct, uncached) in slots;
        `rows` None: fetch only the rows admitted (writes that were not read)."""
        room = self._capacity - int(protected.shape[0])
        n = min(int(ids.shape[0]), room)
        if n <= 0:
            return
        pick = self._best_candidates(ids, counts, n)
        victims, victim_keys = self._victims(n, protected)
        if self.config.policy == "recency" and not force:
            # candidates newest first against victims oldest first: the admitted form a prefix
            ok = (ids[pick] > victim_keys) | (victim_keys == _EMPTY_KEY)
            pick, victims, victim_keys = pick[ok], victims[ok], victim_keys[ok]
        if rows is None:
            rows = self._fetch(ids[pick], "bytes_h2d_write")
        else:
            rows = _take(rows, pick)
        self._place(ids[pick], counts[pick], rows, victims, victim_keys)

    def _victims(self, n: int, protected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """n slots to fill, in eviction order, and their keys (never-filled slots first)."""
        if self._used + n <= self._capacity:  # still filling up: no need to rank anything
            victims = torch.arange(self._used, self._used + n, device=self.device)
            self._used += n
            return victims, torch.full_like(victims, _EMPTY_KEY)
        keys = self._eviction_keys()
        keys[protected] = _PROTECTED_KEY
        victim_keys, victims = torch.topk(keys, n, largest=False, sorted=True)
        self._used = self._capacity  # every never-filled slot ranks first, so all were taken
        return victims, victim_keys

    def _best_candidates(self, ids: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
        """Positions of the n candidates to admit first: newest id (recency), else most
        repeated then newest; sorted best first."""
        score = ids.clone()
        if self.config.policy != "recency":
            score += counts.clamp(max=2**22) << _ID_BITS
        return torch.topk(score, n, largest=True, sorted=True).indices

    def _place(
        self,
        ids: torch.Tensor,
        counts: torch.Tensor,
        rows: EncodedRows,
        victims: torch.Tensor,
        victim_keys: torch.Tensor,
    ) -> None:
        old = self._slot_ids[victims]
        self._id_to_slot[old[old >= 0]] = -1
        self._stats["evictions"] += int((victim_keys != _EMPTY_KEY).sum())
        self._slot_ids[victims] = ids
        self._id_to_slot[ids] = victims
        self._data[victims] = rows.data
        if self._scale is not None:
            self._scale[victims] = rows.scale
        self._count[victims] = counts
        self._last[victims] = self._tick
        self._first[victims] = self._tick
        self._demoted[victims] = False

    def _eviction_keys(self) -> torch.Tensor:
        """Per slot, smaller is evicted first; empty slots come before any other."""
        c = self._capacity
        ids = self._slot_ids[:c]
        policy = self.config.policy
        if policy == "lru":
            key = self._last[:c].clone()
        elif policy == "fifo":
            key = self._first[:c].clone()
        elif policy == "lfu":
            key = (self._count[:c].clamp(max=2**30) << _TICK_BITS) + self._last[:c]
        else:
            key = ids.clone()
        key.masked_fill_(self._demoted[:c], _EMPTY_KEY + 1)
        return key.masked_fill_(ids < 0, _EMPTY_KEY)

    # ---- writes -------------------------------------------------------------------------------

    def _after_write(self, ids: torch.Tensor) -> None:
        """Refresh cached copies of written ids; with admit_on_write, cache the others."""
        ids = torch.unique(ids.to(self.device))
        self._sync_capacity()
        if ids.numel() == 0 or self._capacity == 0:
            return
        self._tick += 1
        self._grow_index(int(ids[-1]) + 1)
        slot = self._id_to_slot[ids]
        cached = slot >= 0
        stale = slot[cached]
        if stale.numel():
            rows = self._fetch(ids[cached], "bytes_h2d_write")
            self._data[stale] = rows.data
            if self._scale is not None:
                self._scale[stale] = rows.scale
        if self.config.admit_on_write and self.config.policy != "static":
            fresh = ids[~cached]
            self._admit(fresh, torch.ones_like(fresh), None, protected=stale)

    # ---- sizing -------------------------------------------------------------------------------

    def _target_capacity(self) -> int:
        if not self.enabled:
            return 0
        if self.config.capacity is not None:
            return int(self.config.capacity)
        return math.ceil(self.config.ratio * self.store.num_rows)

    def _sync_capacity(self) -> None:
        target = self._target_capacity()
        if target > self._slot_ids.shape[0]:
            self._reallocate(max(target, 2 * self._slot_ids.shape[0]))
        elif target < self._capacity:
            self._shrink(target)
        self._capacity = target

    def _allocate(self, slots: int) -> None:
        dev = self.device
        self._slot_ids = torch.full((slots,), -1, dtype=torch.int64, device=dev)
        self._count = torch.zeros(slots, dtype=torch.int64, device=dev)
        self._last = torch.zeros(slots, dtype=torch.int64, device=dev)
        self._first = torch.zeros(slots, dtype=torch.int64, device=dev)
        self._demoted = torch.zeros(slots, dtype=torch.bool, device=dev)
        probe = self.store.fetch(torch.zeros(0, dtype=torch.int64))
        self._data = torch.zeros((slots, self.dim), dtype=probe.data.dtype, device=dev)
        self._scale = None
        if probe.scale is not None:
            self._scale = torch.zeros(slots, dtype=probe.scale.dtype, device=dev)

    def _reallocate(self, slots: int) -> None:
        """Grow the slot arrays to `slots`, keeping contents (slot numbers do not change)."""
        c = self._capacity
        keep = self._arrays()
        self._allocate(slots)
        for old_t, new_t in zip(keep, self._arrays(), strict=True):
            if old_t is not None:
                new_t[:c] = old_t[:c]

    def _shrink(self, target: int) -> None:
        """Keep the `target` slots with the largest eviction keys, compacted to the front."""
        order = torch.topk(self._eviction_keys(), target, largest=True, sorted=False).indices
        gone = self._capacity - target
        kept = [a[order] if a is not None else None for a in self._arrays()]
        self._allocate(target)
        for new, value in zip(self._arrays(), kept, strict=True):
            if value is not None:
                new[:target] = value
        self._capacity = target
        self._used = target
        self._stats["evictions"] += gone
        self._rebuild_index()

    def _arrays(self) -> list[torch.Tensor | None]:
        """The per-slot arrays, in `_ARRAYS` order."""
        return [getattr(self, "_" + name) for name in _ARRAYS]

    def _clear(self) -> None:
        ids = self._slot_ids[: self._capacity]
        self._id_to_slot[ids[ids >= 0]] = -1
        self._slot_ids.fill_(-1)
        self._used = 0

    def _grow_index(self, size: int) -> None:
        if size <= self._id_to_slot.shape[0]:
            return
        grown = torch.full(
            (max(size, 2 * self._id_to_slot.shape[0]),), -1, dtype=torch.int64, device=self.device
        )
        grown[: self._id_to_slot.shape[0]] = self._id_to_slot
        self._id_to_slot = grown

    def _rebuild_index(self) -> None:
        ids = self._slot_ids[: self._capacity]
        occupied = (ids >= 0).nonzero().squeeze(1)
        top = int(ids.max()) + 1 if occupied.numel() else 0
        self._id_to_slot = torch.full((top,), -1, dtype=torch.int64, device=self.device)
        self._id_to_slot[ids[occupied]] = occupied


def _take(rows: EncodedRows, pos: torch.Tensor) -> EncodedRows:
    return EncodedRows(rows.data[pos], rows.scale[pos] if rows.scale is not None else None)


def _rank_for_restore(
    ids: torch.Tensor, capacity: int, policy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (at most `capacity`) distinct ids to seed with and their touch counts: earliest
    first occurrence first, or most touched first for `lfu` and `static`."""
    uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    pos = torch.arange(ids.shape[0], device=ids.device)
    first = torch.full_like(uniq, ids.shape[0]).scatter_reduce(0, inverse, pos, "amin")
    order = torch.argsort(first)
    if policy in ("lfu", "static"):
        order = order[torch.argsort(counts[order], descending=True, stable=True)]
    order = order[:capacity]
    return uniq[order], counts[order]


class RecentWindowTracker:
    """Finds edges a `recent` sampler with fanout <= `window` can no longer return.

    Such a sampler only returns, for a root, some of its `window` newest edges before the
    root's time; as roots' times only grow, an edge that has `window` newer edges at each of
    its endpoints is never sampled again, so its features can leave the cache first
    (`CachedFeatureStore.demote`). Give edges in stream order, as the graph receives them
    (within a batch, ties in time keep their order; a batch older than earlier ones makes the
    hint inexact, never the cache wrong). Per node a ring of its `window` newest eids; per
    edge the number of endpoint lists it is still live in. Vectorized per batch.
    """

    def __init__(self, window: int, add_reverse: bool = True, device: str = "cpu") -> None:
        if int(window) != window or window < 1:
            raise ValueError(
                f"RecentWindowTracker: window must be a positive integer, got {window}"
            )
        self.window = int(window)
        self.add_reverse = add_reverse
        self.device = torch.device(device)
        self._ring = torch.full((0, self.window), -1, dtype=torch.int64, device=self.device)
        self._degree = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._live = torch.zeros(0, dtype=torch.int8, device=self.device)

    def add_edges(
        self, src: torch.Tensor, dst: torch.Tensor, eid: torch.Tensor, t: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Record a batch of edges; returns the (sorted) eids that just left every window."""
        src, dst, eid = (check_ids(x, "RecentWindowTracker.add_edges") for x in (src, dst, eid))
        src, dst, eid = (x.to(self.device) for x in (src, dst, eid))
        if t is not None:  # stable: ties keep their order
            order = torch.sort(t.to(self.device), stable=True).indices
            src, dst, eid = src[order], dst[order], eid[order]
        if eid.numel() == 0:
            return eid
        node, entry = self._entries(src, dst, eid)
        self._grow(int(node.max()) + 1, int(eid.max()) + 1)
        self._live[eid] = 0
        self._live.index_add_(0, entry, torch.ones_like(entry, dtype=torch.int8))
        leaving = self._update_rings(node, entry)
        self._live.index_add_(0, leaving, torch.full_like(leaving, -1, dtype=torch.int8))
        leaving = torch.unique(leaving)
        return leaving[self._live[leaving] == 0]

    def _entries(self, src, dst, eid) -> tuple[torch.Tensor, torch.Tensor]:
        """(node, eid) list entries in insertion order, as the graph stores them."""
        if not self.add_reverse:
            return src, eid
        return torch.stack([src, dst], 1).flatten(), eid.repeat_interleave(2)

    def _update_rings(self, node: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        """Push entries into their nodes' rings; returns eids pushed out (one per list left)."""
        k = self.window
        order = torch.sort(node, stable=True).indices
        node, entry = node[order], entry[order]
        nodes, first, count = _groups(node)
        rank = torch.arange(node.shape[0], device=node.device) - first.repeat_interleave(count)
        before = self._degree[nodes]  # d: list length before the batch
        after = before + count
        # positions [max(0, d-k), max(0, d+c-k)) leave: old ones from the ring, new ones directly
        pos_uk = (before - k).clamp(min=0).unsqueeze(1) + torch.arange(k, device=node.device)
        old_out = pos_uk < torch.minimum(before, after - k).unsqueeze(1)
        ring_out = self._ring[nodes.unsqueeze(1).expand(-1, k)[old_out], pos_uk[old_out] % k]
        pos = before.repeat_interleave(count) + rank
        stays = pos >= (after - k).repeat_interleave(count)
        self._ring[node[stays], pos[stays] % k] = entry[stays]
        self._degree[nodes] = after
        return torch.cat([ring_out, entry[~stays]])

    def _grow(self, num_nodes: int, num_eids: int) -> None:
        if num_nodes > self._degree.shape[0]:
            size = max(num_nodes, 2 * self._degree.shape[0])
            ring = torch.full((size, self.window), -1, dtype=torch.int64, device=self.device)
            ring[: self._ring.shape[0]] = self._ring
            degree = torch.zeros(size, dtype=torch.int64, device=self.device)
            degree[: self._degree.shape[0]] = self._degree
            self._ring, self._degree = ring, degree
        if num_eids > self._live.shape[0]:
            live = torch.zeros(max(num_eids, 2 * self._live.shape[0]), dtype=torch.int8,
                               device=self.device)  # fmt: skip
            live[: self._live.shape[0]] = self._live
            self._live = live

    def state_dict(self) -> dict:
        return {"ring": self._ring.cpu(), "degree": self._degree.cpu(), "live": self._live.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self._ring = state["ring"].to(self.device)
        self._degree = state["degree"].to(self.device)
        self._live = state["live"].to(self.device)


def _groups(sorted_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct values of a sorted tensor, the position of each one's first entry, counts."""
    keys, count = torch.unique_consecutive(sorted_keys, return_counts=True)
    first = torch.cumsum(count, 0) - count
    return keys, first, count
