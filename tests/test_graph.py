"""The dynamic graph store against the brute-force reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ReferenceGraph, twin_graphs

from tidegraph.storage import DynamicGraph
from tidegraph.storage.checkpoint import unpack_rows


def _neighbors(g: DynamicGraph, node: int):
    nbr, t, eid = g.temporal_neighbors(node)
    return list(zip(nbr.tolist(), t.tolist(), eid.tolist(), strict=True))


@st.composite
def batches(draw, max_id: int = 12, huge: bool = False):
    """A few batches of edges: duplicates, self loops, equal times and empty batches."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(0, 25))
        ids = st.integers(0, max_id)
        src = draw(st.lists(ids, min_size=n, max_size=n))
        dst = draw(st.lists(ids, min_size=n, max_size=n))
        t = draw(st.lists(st.integers(0, 6).map(float), min_size=n, max_size=n))
        if huge:
            src = [s + 2**40 for s in src]
        out.append((src, dst, t))
    return out


@settings(max_examples=60, deadline=None)
@given(batches(), st.booleans())
def test_queries_match_reference(data, add_reverse):
    g = DynamicGraph(add_reverse=add_reverse)
    ref = ReferenceGraph(add_reverse=add_reverse)
    for src, dst, t in data:
        g.add_edges(torch.tensor(src, dtype=torch.int64), np.array(dst, dtype=np.int64), t)
        ref.add_edges(src, dst, t)
    assert g.num_edges == sum(len(s) for s, _, _ in data)
    assert g.num_stored_edges == len(ref.rows)
    assert g.num_nodes == ref.num_nodes
    nodes = list(range(15))  # 13 and 14 are never seen
    assert g.out_degree(torch.tensor(nodes)).tolist() == [ref.degree(v) for v in nodes]
    for v in nodes:
        assert _neighbors(g, v) == ref.neighbors(v)


@settings(max_examples=20, deadline=None)
@given(batches(huge=True))
def test_huge_ids(data):
    g, ref = DynamicGraph(), ReferenceGraph()
    for src, dst, t in data:
        g.add_edges(torch.tensor(src, dtype=torch.int64), torch.tensor(dst), torch.tensor(t))
        ref.add_edges(src, dst, t)
    for v in {r[0] for r in ref.rows}:
        assert _neighbors(g, v) == ref.neighbors(v)


@settings(max_examples=30, deadline=None)
@given(batches(), st.integers(0, 7))
def test_offload_matches_reference(data, t_off):
    g, ref = DynamicGraph(), ReferenceGraph()
    for src, dst, t in data:
        g.add_edges(torch.tensor(src, dtype=torch.int64), torch.tensor(dst), torch.tensor(t))
        ref.add_edges(src, dst, t)
    before = g.memory_bytes()
    dropped = g.offload_before(float(t_off))
    ref_before = len(ref.rows)
    ref.offload_before(float(t_off))
    assert dropped == ref_before - len(ref.rows)
    assert g.memory_bytes() <= before
    for v in range(13):
        assert _neighbors(g, v) == ref.neighbors(v)


def test_compaction_keeps_logarithmic_segments():
    g = DynamicGraph()
    gen = torch.Generator().manual_seed(0)
    for i in range(64):
        src = torch.randint(0, 50, (100,), generator=gen)
        dst = torch.randint(0, 50, (100,), generator=gen)
        g.add_edges(src, dst, torch.full((100,), float(i)))
    assert len(g.segments) <= 7  # a binary counter over 64 equal batches
    assert g.num_edges == 6400


def test_default_eids_continue_and_explicit_eids_kept():
    g = DynamicGraph(add_reverse=False)
    g.add_edges([0, 1], [1, 2], [1.0, 2.0])
    g.add_edges([2], [3], [3.0], eid=[100])
    g.add_edges([3], [0], [4.0])
    assert _neighbors(g, 0) == [(1, 1.0, 0)]
    assert _neighbors(g, 2) == [(3, 3.0, 100)]
    assert _neighbors(g, 3) == [(0, 4.0, 101)]


def test_bytes_per_edge_within_budget():
    g = DynamicGraph()
    gen = torch.Generator().manual_seed(0)
    for i in range(10):
        n = 20_000
        g.add_edges(
            torch.randint(0, 5_000, (n,), generator=gen),
            torch.randint(0, 5_000, (n,), generator=gen),
            torch.arange(n, dtype=torch.float64) + i * n,
        )
    report = g.memory_report()
    assert report["num_stored_edges"] == 400_000
    assert report["bytes_per_stored_edge"] <= 24


@pytest.mark.parametrize(
    ("src", "dst", "t", "match"),
    [
        ([0, -1], [1, 2], [0.0, 1.0], "row 1 has a negative id"),
        ([0, 1], [1, 2], [0.0, float("nan")], "row 1 has time nan"),
        ([0, 1], [1, 2], [float("inf"), 0.0], "row 0 has time inf"),
        ([0, 1], [1, 2], [0.0, 1.7e18], r"row 1 has time 1\.7\d*e\+18, beyond \+-2\^53"),
        ([0, 1], [1], [0.0, 1.0], "equal length"),
        ([0.5, 1.0], [1, 2], [0.0, 1.0], "src must hold integer ids"),
    ],
)
def test_bad_input_is_rejected_and_graph_unchanged(src, dst, t, match):
    g = DynamicGraph()
    g.add_edges([0], [1], [0.0])
    state = g.memory_report()
    with pytest.raises(ValueError, match=match):
        g.add_edges(torch.tensor(src), torch.tensor(dst), torch.tensor(t))
    assert g.memory_report() == state
    assert _neighbors(g, 0) == [(1, 0.0, 0)]


def test_reversed_numpy_views_and_nan_offload():
    g = DynamicGraph()
    src, dst, t = np.arange(3), np.arange(1, 4), np.arange(3, dtype=np.float64)
    g.add_edges(src[::-1], dst[::-1], t[::-1])  # negative strides
    assert _neighbors(g, 0) == [(1, 0.0, 2)]
    with pytest.raises(ValueError, match="t is NaN"):
        g.offload_before(float("nan"))
    assert g.num_stored_edges == 6


def test_state_dict_roundtrip():
    g = DynamicGraph()
    g.add_edges([0, 1, 2], [1, 2, 0], [1.0, 2.0, 3.0])
    g.add_edges([0], [2], [4.0])
    h = DynamicGraph()
    h.load_state_dict(g.state_dict())
    for v in range(3):
        assert _neighbors(h, v) == _neighbors(g, v)
    h.add_edges([1], [1], [5.0])
    assert h.num_edges == 5 and _neighbors(h, 1)[0] == (1, 5.0, 4)


def _same_segments(a: DynamicGraph, b: DynamicGraph) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert len(sa["segments"]) == len(sb["segments"])
    for x, y in zip(sa["segments"], sb["segments"], strict=True):
        for key, value in x.items():
            if torch.is_tensor(value):
                assert torch.equal(value, y[key]) and value.dtype == y[key].dtype, key
            else:
                assert value == y[key], key
    assert {k: v for k, v in sa.items() if k not in ("segments", "spans")} == {
        k: v for k, v in sb.items() if k not in ("segments", "spans")
    }


@settings(max_examples=80, deadline=None)
@given(batches(huge=False), st.booleans(), st.booleans(), st.data())
def test_pieces_written_once_bring_the_segments_back_bitwise(data, add_reverse, later, draw):
    """A checkpoint's graph as pieces (the edges added since the last piece, taken at any
    batch boundary) loads back as the same segments, bitwise, whatever merges happened
    between pieces and whether batch times overlap (`later`: each batch after the last);
    the loaded graph then grows as the original does."""
    g = DynamicGraph(add_reverse=add_reverse)
    pieces, end = [], 0
    for i, (src, dst, t) in enumerate(data):
        t = [6.0 * i + x for x in t] if later else t
        g.add_edges(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64), t)
        if draw.draw(st.booleans()) and g.eid_end > end:  # a checkpoint here
            pieces.append(g.rows_since(end))
            end = g.eid_end
    if g.eid_end > end:
        pieces.append(g.rows_since(end))
    assert g.ordered and sum(p["rows"].shape[0] for p in pieces) == g.num_stored_edges
    h = DynamicGraph(add_reverse=add_reverse)
    h.load_state_dict(g.piece_state(pieces))
    _same_segments(h, g)
    for x in (g, h):
        x.add_edges([3, 0], [0, 3], [2.0, 50.0])
    _same_segments(h, g)
    assert h.spans == g.spans


def test_pieces_are_narrow_while_ids_fit_and_wide_or_old_pieces_load_too():
    """A piece costs 20 bytes an edge (int32 node, nbr and eid offset, float64 time) while
    ids and its eids fit in int32, 32 otherwise; pieces written before narrow ones (bare
    32-byte rows, absolute eids) load as the same segments."""
    from tidegraph.storage.checkpoint import pack_rows

    g = DynamicGraph(add_reverse=True)
    g.add_edges([0, 1, 2], [1, 2, 0], [1.0, 2.0, 2.0])
    first = g.rows_since(0)
    g.add_edges([2, 3], [3, 0], [2.0, 4.0])
    second = g.rows_since(3)
    assert (first["lo"], second["lo"]) == (0, 3)
    assert first["rows"].shape == (6, 20) and second["rows"].shape == (4, 20)
    h = DynamicGraph(add_reverse=True)
    h.load_state_dict(g.piece_state([first, second]))
    _same_segments(h, g)

    old = []  # the same pieces as checkpoints before narrow pieces held them
    for piece in (first, second):
        node, nbr, t, eid = unpack_rows(piece["rows"], [torch.int32, torch.int32,
                                                        torch.float64, torch.int32])  # fmt: skip
        old.append(pack_rows([node.long(), nbr.long(), t, eid.long() + piece["lo"]]))
    h = DynamicGraph(add_reverse=True)
    h.load_state_dict(g.piece_state(old))
    _same_segments(h, g)

    big = 2**31 + 5  # an id past int32: wide rows
    w = DynamicGraph(add_reverse=False)
    w.add_edges(torch.tensor([big, 0]), torch.tensor([1, big]), [1.0, 3.0])
    piece = w.rows_since(0)
    assert piece["rows"].shape == (2, 32)
    h = DynamicGraph(add_reverse=False)
    h.load_state_dict(w.piece_state([piece]))
    _same_segments(h, w)
    with pytest.raises(ValueError, match="a piece has rows of 12 bytes"):
        cut = {"lo": 0, "rows": piece["rows"][:, :12]}
        DynamicGraph(add_reverse=False).load_state_dict(w.piece_state([cut]))


def test_batches_out_of_eid_order_keep_segments_as_state():
    g = DynamicGraph()
    g.add_edges([0, 1], [1, 2], [1.0, 2.0], eid=[10, 11])
    assert g.ordered and g.spans == [(10, 12)]
    g.add_edges([2], [0], [3.0], eid=[5])  # below the batch before: pieces could not split
    assert not g.ordered
    with pytest.raises(ValueError, match="not added in eid order"):
        g.piece_state([])
    h = DynamicGraph()
    h.load_state_dict(g.state_dict())
    _same_segments(h, g)
    assert not h.ordered


def test_unknown_placement():
    with pytest.raises(ValueError, match="device must be one of"):
        DynamicGraph(device="tpu")


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["cuda", "pinned"])
def test_gpu_placements_match_cpu(placement):
    cpu, gpu, _ = twin_graphs(placement, num_nodes=30, num_edges=500, t_max=20, seed=1)
    for v in range(30):
        assert _neighbors(gpu, v) == _neighbors(cpu, v)


@pytest.mark.gpu
def test_pinned_state_is_host_memory_and_loads_without_the_gpu(tmp_path):
    cpu, gpu, _ = twin_graphs("pinned", num_nodes=30, num_edges=500, t_max=20, seed=1)
    state = gpu.state_dict()
    tensors = [v for seg in state["segments"] for v in seg.values() if torch.is_tensor(v)]
    assert tensors and all(v.device.type == "cpu" for v in tensors)
    torch.save(state, tmp_path / "g.pt")
    loaded = DynamicGraph(device="pinned")
    on_gpu = torch.load(tmp_path / "g.pt", map_location="cuda")  # a checkpoint moved to the GPU
    before = torch.cuda.memory_allocated()
    loaded.load_state_dict(on_gpu)
    assert torch.cuda.memory_allocated() == before  # segments went to pinned host memory
    for v in range(30):
        assert _neighbors(loaded, v) == _neighbors(cpu, v)
    assert loaded.offload_before(10.0) == cpu.offload_before(10.0)


@settings(max_examples=60, deadline=None)
@given(batches(), st.booleans())
def test_time_ordered_stream_matches_reference(data, add_reverse):
    """Batches later in time than the ones before (sharing boundary times): the merge path that
    interleaves sorted segments instead of re-sorting them."""
    g, ref = DynamicGraph(add_reverse=add_reverse), ReferenceGraph(add_reverse=add_reverse)
    for i, (src, dst, t) in enumerate(data):
        t = sorted(6.0 * i + x for x in t) if i % 2 else [6.0 * i + x for x in t]
        g.add_edges(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64), t)
        ref.add_edges(src, dst, t)
    for v in range(13):
        assert _neighbors(g, v) == ref.neighbors(v)


def test_uva_view_needs_pinned_memory():
    from tidegraph.storage.uva import uva_view

    with pytest.raises(ValueError, match="pinned host memory"):
        uva_view(torch.arange(4))


@pytest.mark.gpu
def test_uva_view_refuses_strided_pinned_memory():
    from tidegraph.storage.uva import uva_view

    with pytest.raises(ValueError, match="contiguous"):
        uva_view(torch.arange(8).pin_memory()[::2])


@pytest.mark.gpu
def test_uva_view_reads_host_memory_from_cuda():
    from tidegraph.storage.uva import uva_view

    host = torch.arange(1000, dtype=torch.int64).pin_memory()
    view = uva_view(host)
    assert view.device.type == "cuda"
    idx = torch.tensor([3, 999, 0], device="cuda")
    assert view[idx].tolist() == [3, 999, 0]
    host[3] = -7  # the view aliases the host memory: no copy was made
    torch.cuda.synchronize()
    assert int(view[3]) == -7


def test_failed_compaction_leaves_a_valid_graph(monkeypatch, caplog):
    from tidegraph.storage.segment import Segment

    g, ref = DynamicGraph(), ReferenceGraph()
    g.add_edges([0, 1], [1, 2], [1.0, 2.0])
    ref.add_edges([0, 1], [1, 2], [1.0, 2.0])

    def fail(*_):
        raise MemoryError("simulated")

    monkeypatch.setattr(Segment, "merge", staticmethod(fail))
    g.add_edges([2, 0], [0, 2], [3.0, 4.0])  # equal sizes: triggers the merge, which fails
    ref.add_edges([2, 0], [0, 2], [3.0, 4.0])
    assert "compaction postponed: simulated" in caplog.text
    monkeypatch.undo()
    assert g.num_edges == 4 and len(g.segments) == 2
    for v in range(3):
        assert _neighbors(g, v) == ref.neighbors(v)
    g.add_edges([1, 2], [0, 2], [5.0, 6.0])  # and the graph goes on compacting later
    ref.add_edges([1, 2], [0, 2], [5.0, 6.0])
    assert len(g.segments) == 1
    for v in range(3):
        assert _neighbors(g, v) == ref.neighbors(v)
