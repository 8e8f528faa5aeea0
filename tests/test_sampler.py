"""The temporal sampler: exact `recent` against the reference, valid and uniform `uniform`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ReferenceGraph, recent_hops, twin_graphs

from tidegraph.sampling import Block, TemporalSampler
from tidegraph.storage import DynamicGraph


@pytest.fixture(scope="module", autouse=True, params=[False, True], ids=["pruned", "sync_free"])
def search_mode(request):
    """Every test runs with both binary-search modes, whatever the device."""
    TemporalSampler.sync_free = request.param
    yield request.param
    TemporalSampler.sync_free = None


def _rows(block: Block):
    """Valid slots of each row as (nbr, t, eid) tuples."""
    out = []
    for r in range(block.num_roots):
        m = block.mask[r]
        out.append(
            list(
                zip(
                    block.nbr_ids[r][m].tolist(),
                    block.nbr_ts[r][m].tolist(),
                    block.nbr_eids[r][m].tolist(),
                    strict=True,
                )
            )
        )
    return out


def _check_layout(block: Block, k: int) -> None:
    assert block.nbr_ids.shape == block.nbr_ts.shape == block.mask.shape == (block.num_roots, k)
    assert torch.equal(block.valid(block.nbr_eids), block.nbr_eids[block.mask])
    assert torch.equal(block.valid_rows, block.mask.nonzero()[:, 0])
    invalid = ~block.mask
    assert (block.nbr_ids[invalid] == -1).all() and (block.nbr_eids[invalid] == -1).all()
    assert (block.dt[invalid] == 0).all()
    expected_dt = (block.dst_ts.unsqueeze(1) - block.nbr_ts).float()
    assert torch.equal(block.dt, expected_dt)
    # valid slots are left-aligned: a row never has a valid slot after an invalid one
    assert (block.mask[:, 1:] <= block.mask[:, :-1]).all()


@pytest.fixture
def small_graph(device) -> DynamicGraph:
    """src [0,0,0,1,1,1,2,2,2] -> dst [1,2,3]x3 at t [0,1,2]x3, eids 0..8 (one direction)."""
    g = DynamicGraph(device=device.type, add_reverse=False)
    g.add_edges(
        torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2], device=device),
        torch.tensor([1, 2, 3] * 3, device=device),
        torch.tensor([0.0, 1.0, 2.0] * 3, device=device),
        torch.arange(9, device=device),
    )
    return g


def test_small_graph_one_hop(small_graph, device):
    s = TemporalSampler(small_graph, [2])
    roots = torch.tensor([0, 0, 0, 2, 7], device=device)
    (block,) = s.sample(roots, torch.tensor([2.0, 0.0, 3.0, 1.5, 9.0], device=device))
    _check_layout(block, 2)
    assert _rows(block) == [
        [(2, 1.0, 1), (1, 0.0, 0)],
        [],  # t = 0 sees nothing: visibility is strictly before
        [(3, 2.0, 2), (2, 1.0, 1)],
        [(2, 1.0, 7), (1, 0.0, 6)],
        [],  # a node never seen
    ]
    assert block.nbr_ids.device.type == device.type


def test_small_graph_two_hops(small_graph, device):
    s = TemporalSampler(small_graph, [2, 2])
    b1, b2 = s.sample(torch.tensor([0], device=device), torch.tensor([3.0], device=device))
    assert _rows(b1) == [[(3, 2.0, 2), (2, 1.0, 1)]]
    assert b2.dst_ids.tolist() == [0, 3, 2]
    assert b2.dst_ts.tolist() == [3.0, 2.0, 1.0]
    assert _rows(b2) == [[(3, 2.0, 2), (2, 1.0, 1)], [], [(1, 0.0, 6)]]


def test_small_graph_snapshots(small_graph, device):
    s = TemporalSampler(small_graph, [2], num_snapshots=3, snapshot_window=1.0)
    snaps = s.sample(torch.tensor([0, 1], device=device), torch.tensor([3.0, 2.5], device=device))
    assert len(snaps) == 3
    assert [_rows(b[0]) for b in snaps] == [
        [[(3, 2.0, 2)], [(3, 2.0, 5)]],  # [t - 1, t)
        [[(2, 1.0, 1)], [(2, 1.0, 4)]],  # [t - 2, t - 1)
        [[(1, 0.0, 0)], [(1, 0.0, 3)]],  # [t - 3, t - 2)
    ]


def test_static_roots_see_everything(small_graph, device):
    s = TemporalSampler(small_graph, [5])
    (block,) = s.sample(
        torch.tensor([1], device=device), torch.full((1,), torch.inf, device=device)
    )
    assert _rows(block) == [[(3, 2.0, 5), (2, 1.0, 4), (1, 0.0, 3)]]
    # valid slots are infinitely old; invalid ones keep the layout's dt 0 (inf - inf is NaN)
    assert torch.isinf(block.dt[block.mask]).all() and (block.dt[~block.mask] == 0).all()


@st.composite
def graph_and_roots(draw):
    batches = []
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(0, 30))
        ids = st.lists(st.integers(0, 10), min_size=n, max_size=n)
        times = st.lists(st.integers(0, 8).map(float), min_size=n, max_size=n)
        batches.append((draw(ids), draw(ids), draw(times)))
    r = draw(st.integers(1, 12))
    roots = draw(st.lists(st.integers(0, 12), min_size=r, max_size=r))
    ts = draw(st.lists(st.integers(0, 10).map(float), min_size=r, max_size=r))
    return batches, roots, ts


def _build(batches, add_reverse=True, device="cpu"):
    g, ref = DynamicGraph(device=device, add_reverse=add_reverse), ReferenceGraph(add_reverse)
    for src, dst, t in batches:
        g.add_edges(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64), t)
        ref.add_edges(src, dst, t)
    return g, ref


@settings(max_examples=60, deadline=None)
@given(graph_and_roots(), st.sampled_from([[1], [3], [2, 2], [4, 1, 2]]), st.booleans())
def test_recent_equals_reference(data, fanouts, add_reverse):
    batches, roots, ts = data
    g, ref = _build(batches, add_reverse)
    blocks = TemporalSampler(g, fanouts).sample(torch.tensor(roots), torch.tensor(ts))
    for block, (exp_roots, exp_ts, exp_rows), k in zip(
        blocks, recent_hops(ref, roots, ts, fanouts), fanouts, strict=True
    ):
        _check_layout(block, k)
        assert block.dst_ids.tolist() == exp_roots
        assert block.dst_ts.tolist() == exp_ts
        assert _rows(block) == exp_rows


@settings(max_examples=40, deadline=None)
@given(graph_and_roots(), st.integers(1, 3), st.sampled_from([0.5, 2.0, 3.0]))
def test_recent_snapshots_equal_reference(data, num_snapshots, w):
    batches, roots, ts = data
    g, ref = _build(batches)
    s = TemporalSampler(g, [2, 2], num_snapshots=num_snapshots, snapshot_window=w)
    snaps = s.sample(torch.tensor(roots), torch.tensor(ts))
    assert len(snaps) == num_snapshots
    for i, blocks in enumerate(snaps):
        hi = [t - i * w for t in ts]
        lo = [t - (i + 1) * w for t in ts]
        for block, (_, _, rows) in zip(
            blocks, recent_hops(ref, roots, hi, [2, 2], lo), strict=True
        ):
            assert _rows(block) == rows


def _expand(blocks: list[Block]) -> list[list]:
    """Per hop, the (root, root time, rows) of every root of the full layout, read from a
    deduplicated sampling through `next_index`."""
    out, rows_of = [], list(range(blocks[0].num_roots))  # full root -> row of this block
    for hop, block in enumerate(blocks):
        rows = _rows(block)
        out.append([(int(block.dst_ids[j]), float(block.dst_ts[j]), rows[j]) for j in rows_of])
        if hop + 1 == len(blocks):
            break
        counts = block.mask.sum(1).tolist()
        starts = [sum(counts[:j]) for j in range(block.num_roots)]
        nbrs = [block.num_roots + starts[j] + c for j in rows_of for c in range(counts[j])]
        rows_of = block.next_index[rows_of + nbrs].tolist()
    return out


@settings(max_examples=60, deadline=None)
@given(graph_and_roots(), st.sampled_from([[2, 2], [3, 1, 2]]), st.integers(1, 2))
def test_dedup_recent_is_the_full_layout_deduplicated(data, fanouts, num_snapshots):
    batches, roots, ts = data
    g, _ = _build(batches)
    kw = dict(num_snapshots=num_snapshots, snapshot_window=2.0 if num_snapshots > 1 else 0.0)
    full = TemporalSampler(g, fanouts, **kw).sample(torch.tensor(roots), torch.tensor(ts))
    dedup = TemporalSampler(g, fanouts, dedup=True, **kw)
    dd = dedup.sample(torch.tensor(roots), torch.tensor(ts))
    if num_snapshots == 1:
        full, dd = [full], [dd]
    for f_blocks, d_blocks in zip(full, dd, strict=True):
        for block in d_blocks[1:] if num_snapshots == 1 else []:
            # each later hop holds distinct (root, time) pairs (with snapshots, distinct
            # (root, time, window start), and the window start is not in the block)
            pairs = list(zip(block.dst_ids.tolist(), block.dst_ts.tolist(), strict=True))
            assert len(set(pairs)) == len(pairs)
        expected = [
            list(zip(b.dst_ids.tolist(), b.dst_ts.tolist(), _rows(b), strict=True))
            for b in f_blocks
        ]
        assert _expand(d_blocks) == expected


@settings(max_examples=40, deadline=None)
@given(graph_and_roots(), st.integers(1, 4))
def test_uniform_is_valid(data, k):
    batches, roots, ts = data
    g, ref = _build(batches)
    (block,) = TemporalSampler(g, [k], strategy="uniform", seed=3).sample(
        torch.tensor(roots), torch.tensor(ts)
    )
    _check_layout(block, k)
    for v, t, row in zip(roots, ts, _rows(block), strict=True):
        visible = ref.neighbors(v, t)
        if len(visible) <= k:
            assert row == visible  # every visible edge, newest first
        else:
            assert len(row) == k
            remaining = list(visible)
            for edge in row:  # distinct draws: a multiset inside the visible edges
                remaining.remove(edge)
            assert [e[1] for e in row] == sorted((e[1] for e in row), reverse=True)


def test_uniform_frequencies_are_uniform():
    """Chi-square test: 20 edges of one node spread over 3 segments, 4000 roots (the node at
    4000 times after its edges: distinct keys of the counter-based draws), k = 5."""
    g = DynamicGraph(add_reverse=False)
    for lo, hi in ((0, 12), (12, 16), (16, 20)):
        n = hi - lo
        g.add_edges(torch.zeros(n, dtype=torch.int64), torch.arange(lo, hi), torch.arange(lo, hi))
    assert len(g.segments) > 1
    s = TemporalSampler(g, [5], strategy="uniform", seed=0)
    roots = torch.zeros(4000, dtype=torch.int64)
    (block,) = s.sample(roots, 100.0 + torch.arange(4000, dtype=torch.float64))
    assert block.mask.all()
    sorted_ids = block.nbr_ids.sort(1).values
    assert (sorted_ids[:, 1:] != sorted_ids[:, :-1]).all()  # no repeats within a row
    counts = torch.bincount(block.nbr_ids.flatten(), minlength=20).double()
    expected = 4000 * 5 / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 43.8  # 19 degrees of freedom, p = 0.001


def test_uniform_reproducible_and_state_restores():
    g, _ = _build([(list(range(10)) * 5, list(range(50)), [float(i) for i in range(50)])])
    roots, ts = torch.arange(10), torch.full((10,), 60.0)
    a = TemporalSampler(g, [3, 2], strategy="uniform", seed=7)
    b = TemporalSampler(g, [3, 2], strategy="uniform", seed=7)
    state = a.state_dict()
    first = a.sample(roots, ts)
    assert all(
        torch.equal(x.nbr_eids, y.nbr_eids) for x, y in zip(first, b.sample(roots, ts), strict=True)
    )
    a.load_state_dict(state)
    again = a.sample(roots, ts)
    assert all(torch.equal(x.nbr_eids, y.nbr_eids) for x, y in zip(first, again, strict=True))


def test_uniform_draws_are_a_function_of_the_key_and_the_root():
    """Identical roots under one key share a draw; other times, windows or keys draw anew;
    a root's draw does not depend on the other roots of the request, nor on their order."""
    g, _ = _build([([0] * 30, list(range(1, 31)), [float(i) for i in range(30)])], False)
    s = TemporalSampler(g, [3], strategy="uniform", seed=1)
    same = s.sample_hop(torch.zeros(50, dtype=torch.int64), torch.full((50,), 99.0), 3, key=5)
    assert len({tuple(r) for r in same.nbr_eids.tolist()}) == 1
    times = 99.0 + torch.arange(50, dtype=torch.float64)
    apart = s.sample_hop(torch.zeros(50, dtype=torch.int64), times, 3, key=5)
    assert len({tuple(r) for r in apart.nbr_eids.tolist()}) > 25
    keys = [s.sample_hop(torch.zeros(1, dtype=torch.int64), times[:1], 3, key=k) for k in range(20)]
    assert len({tuple(b.nbr_eids[0].tolist()) for b in keys}) > 10
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    mixed = s.sample_hop(torch.zeros(50, dtype=torch.int64), times[perm], 3, key=5)
    assert torch.equal(mixed.nbr_eids, apart.nbr_eids[perm])
    alone = s.sample_hop(torch.zeros(1, dtype=torch.int64), times[7:8], 3, key=5)
    assert torch.equal(alone.nbr_eids[0], apart.nbr_eids[7])


def test_keyed_mixing_matches_its_integer_definition():
    """The tensor hash wraps like the Python one (modulo 2^64, logical shifts)."""
    from tidegraph.sampling.keyed import _mix, mix

    xs = [0, 1, -1, 2**63 - 1, -(2**63), 123456789123456789, -987654321987654321]
    assert _mix(torch.tensor(xs, dtype=torch.int64)).tolist() == [mix(x) for x in xs]


def test_empty_graph_and_empty_roots():
    g = DynamicGraph()
    (block,) = TemporalSampler(g, [4]).sample(torch.tensor([0, 5]), torch.tensor([1.0, 2.0]))
    assert block.nbr_ids.shape == (2, 4) and not block.mask.any()
    g.add_edges([0], [1], [0.0])
    b1, b2 = TemporalSampler(g, [4, 2]).sample(torch.empty(0, dtype=torch.int64), torch.empty(0))
    assert b1.nbr_ids.shape == (0, 4) and b2.nbr_ids.shape == (0, 2)


@pytest.mark.parametrize(
    ("roots", "ts", "match"),
    [
        (torch.tensor([0, -2]), torch.tensor([1.0, 1.0]), "root 1 has negative id -2"),
        (torch.tensor([0], dtype=torch.int32), torch.tensor([1.0]), "roots must be int64"),
        (torch.tensor([0, 1]), torch.tensor([1.0]), "ts has shape"),
        (torch.tensor([0, 1]), torch.tensor([1.0, torch.nan]), "root 1 has time NaN"),
        (torch.tensor([0], device="meta"), torch.tensor([1.0]), "roots is on meta"),
    ],
)
def test_bad_roots(roots, ts, match):
    g = DynamicGraph()
    g.add_edges([0], [1], [0.0])
    with pytest.raises(ValueError, match=match):
        TemporalSampler(g, [2]).sample(roots, ts)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "newest"}, "strategy must be one of"),
        ({"fanouts": [0]}, "fanouts must be positive"),
        ({"fanouts": [2, -1]}, "fanouts must be positive"),
        ({"num_snapshots": 2}, "snapshot_window must be > 0"),
        ({"num_snapshots": 0}, "num_snapshots must be >= 1"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TemporalSampler(DynamicGraph(), **kwargs)


def test_unseeded_sampler_leaves_the_global_generator_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    TemporalSampler(DynamicGraph(), [2])
    assert torch.equal(torch.rand(3), expected)


def test_no_hops_samples_nothing():
    # fanouts [] is a zero-hop sampler (models without neighbours, e.g. JODIE): no blocks, and
    # root checks still apply
    g = DynamicGraph()
    g.add_edges([0, 1], [1, 2], [0.0, 1.0])
    sampler = TemporalSampler(g, [])
    assert sampler.sample(torch.tensor([0, 1]), torch.tensor([5.0, 5.0])) == []
    with pytest.raises(ValueError, match="negative id"):
        sampler.sample(torch.tensor([-1]), torch.tensor([5.0]))


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["recent", "uniform"])
@pytest.mark.parametrize("placement", ["cuda", "pinned"])
def test_cuda_equals_cpu(strategy, placement):
    cpu, gpu, gen = twin_graphs(placement, num_nodes=200, num_edges=5000, t_max=1000, seed=2)
    roots, ts = torch.randint(0, 220, (700,), generator=gen), torch.rand(700, generator=gen) * 1100
    a = TemporalSampler(cpu, [10, 5], strategy=strategy, seed=0).sample(roots, ts)
    b = TemporalSampler(gpu, [10, 5], strategy=strategy, seed=0).sample(roots.cuda(), ts.cuda())
    for x, y in zip(a, b, strict=True):
        # uniform draws are counter-based, keyed from the samplers' host generators: the same
        assert torch.equal(x.mask, y.mask.cpu())
        assert torch.equal(x.nbr_eids, y.nbr_eids.cpu())
