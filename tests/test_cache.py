"""The feature cache: every policy returns the store's rows, and evicts what its rule says."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidegraph.storage.cache import POLICIES, CacheConfig, CachedFeatureStore, RecentWindowTracker
from tidegraph.storage.features import HostFeatureStore, InMemoryFeatureStore

DIM = 3


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def filled(n: int, dim: int = DIM, **kwargs) -> HostFeatureStore:
    store = HostFeatureStore(dim=dim, **kwargs)
    store.append(torch.randn(n, dim, generator=torch.Generator().manual_seed(n)))
    return store


def fake(n: int) -> InMemoryFeatureStore:
    store = InMemoryFeatureStore(dim=DIM)
    store.append(torch.arange(n * DIM, dtype=torch.float32).view(n, DIM))
    store.fetched.clear()
    return store


def cache(store, device="cpu", **kwargs) -> CachedFeatureStore:
    if "ratio" not in kwargs:
        kwargs.setdefault("capacity", 2)
    return CachedFeatureStore(store, device=str(device), enabled=True, **kwargs)


def cached(c: CachedFeatureStore) -> list[int]:
    return c.cached_ids().tolist()


# ---- exactness: property test against the uncached store ------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("get"), st.lists(st.integers(0, 90), max_size=25)),
        st.tuples(st.just("append"), st.integers(0, 12)),
        st.tuples(st.just("put"), st.lists(st.integers(0, 70), max_size=6)),
        st.tuples(st.just("restore"), st.lists(st.integers(0, 90), max_size=30)),
        st.tuples(st.just("demote"), st.lists(st.integers(0, 90), max_size=10)),
    ),
    max_size=14,
)


@pytest.mark.parametrize("policy", POLICIES)
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=_ops,
    size=st.one_of(st.integers(0, 12).map(lambda c: {"capacity": c}),
                   st.sampled_from([0.05, 0.2, 0.5, 1.0]).map(lambda r: {"ratio": r})),
    precision=st.sampled_from(["fp32", "int8"]),
    admit_on_write=st.booleans(),
)  # fmt: skip
def test_every_policy_returns_the_store_rows(device, policy, ops, size, precision, admit_on_write):
    store = filled(40, precision=precision)
    c = cache(store, device, policy=policy, admit_on_write=admit_on_write, **size)
    gen = torch.Generator().manual_seed(0)
    for op, arg in ops:
        if op == "get":
            got = c.get(ids(*arg).to(device))
            assert got.device.type == torch.device(device).type
            assert torch.equal(got.cpu(), store.get(ids(*arg)))
        elif op == "append":
            c.append(torch.randn(arg, DIM, generator=gen))
        elif op == "put":
            c.put(ids(*arg), torch.randn(len(arg), DIM, generator=gen))
        elif op == "demote":
            c.demote(ids(*arg))
        else:
            c.restore(ids(*arg))
        held = c.cached_ids()
        assert held.numel() <= c.capacity and held.unique().numel() == held.numel()
    everything = torch.arange(store.num_rows + 5)
    assert torch.equal(c.get(everything.to(device)).cpu(), store.get(everything))


@pytest.mark.parametrize("policy", POLICIES)
def test_hits_are_not_fetched_again(policy):
    store = fake(20)
    c = cache(store, capacity=4, policy=policy)
    c.restore(ids(1, 2))
    store.fetched.clear()
    c.get(ids(2, 2, 1, 5))
    assert [f.tolist() for f in store.fetched] == [[5]]
    assert c.stats()["hits"] == 2 and c.stats()["misses"] == 1


def test_empty_request():
    c = cache(filled(5))
    out = c.get(ids())
    assert out.shape == (0, DIM) and c.stats()["requests"] == 1
    assert c.stats()["hits"] + c.stats()["misses"] == 0


def test_more_distinct_misses_than_capacity():
    store = filled(50)
    c = cache(store, capacity=3)
    c.get(ids(1, 2))
    got = c.get(ids(1, 2, 30, 31, 32, 30))
    assert torch.equal(got, store.get(ids(1, 2, 30, 31, 32, 30)))
    assert cached(c) == [1, 2, 30]  # hits stay; the most repeated miss is admitted
    c.get(torch.arange(40))
    assert len(cached(c)) == 3


def test_ids_beyond_the_store_read_as_default():
    store = filled(5)
    c = cache(store, capacity=4)
    assert torch.equal(c.get(ids(3, 99)), store.get(ids(3, 99)))
    assert torch.equal(c.get(ids(99))[0], torch.zeros(DIM))
    assert 99 not in cached(c)  # default rows are served, never cached
    # a huge id must not size an id table (2^40 entries would be 8 TB), cached or not
    off = CachedFeatureStore(store, ratio=0.5, device="cpu", enabled=False)
    for c in (cache(store, capacity=4), off):
        assert torch.equal(c.get(ids(2, 2**40)), store.get(ids(2, 2**40)))


# ---- policies: hand-made sequences ------------------------------------------------------------


def replay(c: CachedFeatureStore, *requests) -> None:
    for r in requests:
        c.get(ids(*r) if isinstance(r, tuple) else ids(r))


def test_lru_evicts_least_recently_used(device):
    c = cache(filled(10), device, policy="lru")
    replay(c, 1, 2, 1, 3)
    assert cached(c) == [1, 3]
    replay(c, 1, 4)
    assert cached(c) == [1, 4]


def test_fifo_evicts_first_admitted_even_if_used(device):
    c = cache(filled(10), device, policy="fifo")
    replay(c, 1, 2, 1, 1, 3)
    assert cached(c) == [2, 3]
    replay(c, 4)
    assert cached(c) == [3, 4]


def test_lfu_evicts_least_frequent_then_least_recent(device):
    c = cache(filled(10), device, policy="lfu")
    replay(c, 1, 1, 2, 3)
    assert cached(c) == [1, 3]
    replay(c, 4)  # 3 and 4 both once: 3 is older
    assert cached(c) == [1, 4]
    replay(c, (4, 4, 4), 5, 6)  # 4 now counts 4 > 1's 2
    assert cached(c) == [4, 6]


def test_lfu_counts_multiplicity_within_a_request(device):
    c = cache(filled(10), device, policy="lfu")
    replay(c, (1, 1, 1), 2, 3)
    assert cached(c) == [1, 3]


def test_recency_keeps_the_newest_ids(device):
    c = cache(filled(10), device, policy="recency")
    replay(c, 5, 3)
    assert cached(c) == [3, 5]
    replay(c, 1)  # older than everything cached: not admitted
    assert cached(c) == [3, 5]
    replay(c, 7)
    assert cached(c) == [5, 7]
    replay(c, (9, 8, 6))
    assert cached(c) == [8, 9]


def test_static_keeps_the_most_touched_presampled_ids(device):
    c = cache(filled(10), device, policy="static")
    c.restore(ids(1, 2, 3, 3, 1, 3, 4))
    assert cached(c) == [1, 3]
    replay(c, 2, 2, 5)
    assert cached(c) == [1, 3]
    c.restore(ids(2, 5, 5))
    assert cached(c) == [2, 5]


@pytest.mark.parametrize("policy", ["lru", "fifo", "recency"])
def test_restore_seeds_earliest_first(device, policy):
    c = cache(filled(10), device, capacity=3, policy=policy)
    replay(c, 9, 8, 7)
    c.restore(ids(4, 1, 4, 6, 2))
    assert cached(c) == [1, 4, 6]
    replay(c, 4, 1, 6)
    assert c.stats()["hits"] == 3


def test_restore_with_lfu_seeds_most_touched():
    c = cache(filled(10), capacity=2, policy="lfu")
    c.restore(ids(4, 1, 2, 2, 1, 2))
    assert cached(c) == [1, 2]


# ---- growth, writes, pass-through ---------------------------------------------------------------


def test_ratio_capacity_grows_with_the_store_and_keeps_contents(device):
    store = filled(20)
    c = cache(store, device, capacity=None, ratio=0.2, policy="lru")
    assert c.get(ids(0, 1, 2, 3)).shape == (4, DIM) and c.capacity == 4
    c.append(torch.randn(30, DIM))
    got = c.get(ids(0, 1, 2, 3, 45))
    assert c.capacity == 10 and cached(c) == [0, 1, 2, 3, 45]
    assert torch.equal(got.cpu(), store.get(ids(0, 1, 2, 3, 45)))
    assert c.stats()["hits"] == 4


def test_resize_shrinks_keeping_what_the_policy_values():
    c = cache(filled(10), capacity=4, policy="lru")
    replay(c, 1, 2, 3, 4, 2)
    c.resize(capacity=2)
    assert c.capacity == 2 and cached(c) == [2, 4]
    assert torch.equal(c.get(ids(4, 2, 1)), c.store.get(ids(4, 2, 1)))


def test_writes_refresh_cached_copies():
    store = filled(10, precision="int8")
    c = cache(store, capacity=3)
    c.get(ids(1, 2))
    c.put(ids(2, 5), torch.ones(2, DIM))
    assert torch.equal(c.get(ids(2, 5)), store.get(ids(2, 5)))
    assert torch.allclose(c.get(ids(2)), torch.ones(1, DIM))


def test_admit_on_write_caches_appended_rows():
    store = filled(10)
    c = cache(store, capacity=3, policy="recency", admit_on_write=True)
    new = c.append(torch.randn(2, DIM))
    assert cached(c) == new.tolist()
    c.get(new)
    assert c.stats()["hits"] == 2 and c.stats()["bytes_h2d_write"] == 2 * store.row_bytes


def test_admit_on_write_moves_only_the_rows_it_admits():
    store = filled(10)
    c = cache(store, capacity=2, policy="recency", admit_on_write=True)
    c.get(ids(1))
    c.put(ids(1), torch.ones(1, DIM))  # cached: refreshed (one row)
    c.append(torch.randn(100, DIM))  # two slots: only the two newest rows are fetched
    assert cached(c) == [108, 109]
    assert c.stats()["bytes_h2d_write"] == 3 * store.row_bytes


def test_pass_through_when_disabled():
    store = filled(10)
    c = CachedFeatureStore(store, ratio=0.5, device="cpu", enabled=False)
    for _ in range(3):
        assert torch.equal(c.get(ids(1, 1, 2)), store.get(ids(1, 1, 2)))
    s = c.stats()
    assert (s["capacity"], s["hits"], s["misses"]) == (0, 0, 6)


def test_default_is_pass_through_without_cuda():
    c = CachedFeatureStore(filled(4), ratio=0.5)
    assert c.enabled == torch.cuda.is_available()


def test_invalidate():
    c = cache(filled(10), capacity=3)
    replay(c, (1, 2, 3))
    c.invalidate(ids(2, 50))
    assert cached(c) == [1, 3]
    c.invalidate()
    assert cached(c) == []


def test_zero_width_features():
    store = HostFeatureStore(dim=0)
    store.append(torch.empty(5, 0))
    c = cache(store, capacity=2)
    assert c.get(ids(1, 2, 1)).shape == (3, 0)
    assert c.stats()["bytes_h2d"] == 0


# ---- stats and state ------------------------------------------------------------------------


def test_stats_count_distinct_ids_and_bytes():
    store = filled(10, precision="int8")
    c = cache(store, capacity=4)
    replay(c, (1, 1, 2), (1, 3))
    s = c.stats()
    assert (s["hits"], s["misses"], s["rows"], s["requests"]) == (1, 3, 5, 2)
    assert s["hit_rate"] == 0.25 and s["bytes_h2d"] == 3 * store.row_bytes
    assert s["lookup_seconds"] > 0 and s["size"] == 3
    c.reset_stats()
    assert c.stats()["hits"] == 0 and c.stats()["size"] == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_state_dict_round_trip(device, policy):
    store = filled(30, precision="int8")
    c = cache(store, device, capacity=5, policy=policy)
    c.restore(ids(3, 4, 4))
    replay(c, (1, 2), 7, (3, 9))
    state = c.state_dict()
    assert state["slot_ids"].device.type == "cpu"
    copy = cache(store, device, capacity=5, policy=policy)
    copy.load_state_dict(state)
    assert cached(copy) == cached(c) and copy.stats() == c.stats()
    replay(c, 11, 2, 12)
    replay(copy, 11, 2, 12)
    assert cached(copy) == cached(c)
    assert torch.equal(copy.get(torch.arange(30)), store.get(torch.arange(30)).to(device))


@pytest.mark.parametrize(
    "kwargs, message",
    [({}, "exactly one of capacity and ratio"),
     ({"capacity": 2, "ratio": 0.1}, "exactly one"),
     ({"capacity": -1}, "CacheConfig.capacity"),
     ({"ratio": float("inf")}, "CacheConfig.ratio"),
     ({"capacity": 1, "policy": "arc"}, "CacheConfig.policy"),
     ({"capacity": 1, "device": "gpu0"}, "CacheConfig.device")],
)  # fmt: skip
def test_config_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(**kwargs)


def test_config_object_and_overrides():
    config = CacheConfig(ratio=0.1, policy="lfu", device="cpu", enabled=True)
    c = CachedFeatureStore(filled(30), config, policy="fifo")
    assert c.config.policy == "fifo" and c.config.ratio == 0.1
    c.get(ids(0))
    assert c.capacity == 3


# ---- demotion and the recent-window tracker ----------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "recency"])
def test_demoted_ids_are_evicted_first_unless_read_again(device, policy):
    c = cache(filled(10), device, capacity=3, policy=policy)
    replay(c, 5, 6, (7, 7, 7))
    assert c.demote(ids(7, 6, 9)) == 2
    replay(c, 6, 8)  # 6 was read again: only 7 is still demoted
    assert cached(c) == [5, 6, 8]
    assert c.stats()["demoted"] == 2


def brute_force_dead(src: list[int], dst: list[int], window: int) -> set[int]:
    lists: dict[int, list[int]] = {}
    for e, (u, v) in enumerate(zip(src, dst, strict=True)):
        lists.setdefault(u, []).append(e)
        lists.setdefault(v, []).append(e)
    live = {e for entries in lists.values() for e in entries[-window:]}
    return set(range(len(src))) - live


@settings(max_examples=60, deadline=None)
@given(
    edges=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    window=st.integers(1, 4),
)
def test_recent_window_tracker_matches_brute_force(edges, cuts, window):
    src, dst = [u for u, _ in edges], [v for _, v in edges]
    tracker = RecentWindowTracker(window)
    dead: set[int] = set()
    bounds = sorted({0, len(edges), *(c for c in cuts if c <= len(edges))})
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        out = tracker.add_edges(ids(*src[lo:hi]), ids(*dst[lo:hi]), torch.arange(lo, hi))
        assert out.tolist() == sorted(out.tolist()) and not dead & set(out.tolist())
        dead |= set(out.tolist())
        assert dead == brute_force_dead(src[:hi], dst[:hi], window)


def test_dead_edges_are_never_sampled_again():
    from tidegraph.sampling import TemporalSampler
    from tidegraph.storage import DynamicGraph

    gen = torch.Generator().manual_seed(0)
    graph, tracker = DynamicGraph(), RecentWindowTracker(5)
    sampler = TemporalSampler(graph, fanouts=[5], strategy="recent", seed=0)
    dead = torch.zeros(0, dtype=torch.int64)
    for b in range(8):
        src, dst = (
            torch.randint(0, 15, (30,), generator=gen),
            torch.randint(0, 15, (30,), generator=gen),
        )
        t = torch.arange(b * 30, b * 30 + 30, dtype=torch.float64)
        graph.add_edges(src, dst, t)
        dead = torch.cat([dead, tracker.add_edges(src, dst, torch.arange(b * 30, b * 30 + 30))])
        roots = torch.arange(15)
        block = sampler.sample(roots, torch.full((15,), 1e9))[0]
        assert not bool(torch.isin(block.nbr_eids[block.mask], dead).any())
    assert dead.numel() > 0


def test_tracker_sorts_by_time_and_keeps_state(device):
    tracker = RecentWindowTracker(1, device=device)
    t = torch.tensor([5.0, 2.0])
    out = tracker.add_edges(ids(0, 0), ids(1, 1), ids(0, 1), t=t)
    assert out.tolist() == [1]  # edge 1 is older, so edge 0 is the newest at both ends
    copy = RecentWindowTracker(1, device=device)
    copy.load_state_dict(tracker.state_dict())
    assert copy.add_edges(ids(0), ids(1), ids(2)).tolist() == [0]


def test_tracker_without_reverse_edges_follows_sources_only():
    tracker = RecentWindowTracker(1, add_reverse=False)
    assert tracker.add_edges(ids(0, 1), ids(5, 5), ids(0, 1)).tolist() == []
    assert tracker.add_edges(ids(0), ids(5), ids(2)).tolist() == [0]
