"""Tests of the streaming event loaders on the bundled datasets and on small written files."""

from __future__ import annotations

import csv
import gzip
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegraph.data import bundled_path
from tidegraph.storage.events import EventBatch
from tidegraph.storage.ingest import (
    ColumnMap,
    LoaderConfig,
    LoaderError,
    load_events,
    open_events,
    read_node_features,
)
from tidegraph.storage.ingest.text import CsvSource


def write(path: Path, text: str) -> Path:
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def assert_same(a: EventBatch, b: EventBatch) -> None:
    for name in ("src", "dst", "t", "eid", "edge_feat", "label"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name


def assert_stream_ok(batch: EventBatch) -> None:
    assert torch.equal(batch.eid, torch.arange(len(batch)))
    assert bool((batch.t[1:] >= batch.t[:-1]).all())


# ----------------------------------------------------------------------------- bundled data


@pytest.fixture(scope="module")
def wikipedia() -> EventBatch:
    return load_events(bundled_path("wikipedia"))


def test_wikipedia_bundled(wikipedia: EventBatch) -> None:
    assert len(wikipedia) == 157_474
    nodes = torch.unique(torch.cat([wikipedia.src, wikipedia.dst]))
    assert len(nodes) == 9_227 and nodes.min() == 0 and nodes.max() == 9_226
    assert wikipedia.src.max() == 8_226 and wikipedia.dst.min() == 8_227
    assert wikipedia.label is not None and wikipedia.label.sum() == 217
    assert wikipedia.edge_feat is None
    assert wikipedia.t[0] == 0 and wikipedia.t[-1] == 2_678_373
    assert_stream_ok(wikipedia)


def test_uci_bundled() -> None:
    batch = load_events(bundled_path("uci"))
    assert len(batch) == 59_835
    nodes = torch.unique(torch.cat([batch.src, batch.dst]))
    assert len(nodes) == 1_899 and nodes.min() == 1 and nodes.max() == 1_899
    assert batch.t[0] == 1_082_040_961 and batch.t[-1] == 1_098_777_142
    assert batch.label is None and batch.edge_feat is None
    assert_stream_ok(batch)


def test_wikipedia_chunked_reading_is_identical(wikipedia: EventBatch) -> None:
    reader = open_events(bundled_path("wikipedia"), chunk_rows=5_000)
    batches = list(reader)
    assert len(batches) == 32 and max(len(b) for b in batches) == 5_000
    assert_same(EventBatch.cat(batches), wikipedia)
    assert reader.stats.rows_read == reader.stats.rows_yielded == 157_474
    windowed = load_events(bundled_path("wikipedia"), chunk_rows=20_000, sort=True)
    assert_same(windowed, wikipedia)


def test_bundled_path_names() -> None:
    assert bundled_path("UCI") == bundled_path("collegemsg")
    with pytest.raises(KeyError, match="wikipedia"):
        bundled_path("reddit")


# ----------------------------------------------------------------------------- formats


def test_jodie_with_features_shifts_items(tmp_path: Path) -> None:
    text = (
        "user_id,item_id,timestamp,state_label,comma_separated_list_of_features\n"
        "0,0,1.0,0,0.1,0.2,0.3\n"
        "2,1,2.0,1,1.1,1.2,1.3\n"
        "1,0,2.5,0,2.1,2.2,2.3\n"
    )
    path = write(tmp_path / "jodie.csv", text)
    batch = load_events(path)  # auto: the header names JODIE
    assert batch.src.tolist() == [0, 2, 1]
    assert batch.dst.tolist() == [3, 4, 3]  # items shifted past max user id 2
    assert batch.label.tolist() == [0, 1, 0]
    assert batch.edge_feat.dtype == torch.float32 and batch.edge_feat.shape == (3, 3)
    assert torch.allclose(batch.edge_feat[1], torch.tensor([1.1, 1.2, 1.3]))
    assert load_events(path, "jodie", num_users=10).dst.tolist() == [10, 11, 10]


def test_jodie_user_beyond_num_users_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path / "j.csv", "user_id,item_id,timestamp,state_label\n0,0,1,0\n5,0,2,0\n")
    with pytest.raises(
        LoaderError, match=r"j\.csv: line 3: id out of range: src id 5 >= num_users 3"
    ):
        load_events(path, num_users=3)


def make_tgl(directory: Path, times: list[float], extra_feature_rows: int = 0) -> torch.Tensor:
    directory.mkdir()
    lines = [",src,dst,time,int_roll,ext_roll"]
    for i, t in enumerate(times):
        lines.append(f"{i},{i % 3},{3 + i % 2},{t},0,{int(i > 2)}")
    write(directory / "edges.csv", "\n".join(lines) + "\n")
    feats = torch.arange((len(times) + extra_feature_rows) * 2, dtype=torch.float64).view(-1, 2)
    torch.save(feats, directory / "edge_features.pt")
    torch.save(torch.ones(5, 4), directory / "node_features.pt")
    return feats


def test_tgl_layout_with_edge_features(tmp_path: Path) -> None:
    feats = make_tgl(tmp_path / "tgl", [1, 2, 2, 5, 7])
    reader = open_events(tmp_path / "tgl", chunk_rows=2)
    batch = EventBatch.cat(list(reader))
    assert reader.format == "tgl"
    assert batch.src.tolist() == [0, 1, 2, 0, 1] and batch.dst.tolist() == [3, 4, 3, 4, 3]
    assert torch.equal(batch.edge_feat, feats.float())
    assert torch.equal(reader.node_features(), torch.ones(5, 4))
    assert torch.equal(read_node_features(tmp_path / "tgl"), torch.ones(5, 4))


def test_tgl_features_follow_rows_when_sorted(tmp_path: Path) -> None:
    feats = make_tgl(tmp_path / "tgl", [3, 1, 2, 5, 4])
    batch = load_events(tmp_path / "tgl", sort=True, chunk_rows=2)
    order = [1, 2, 0, 4, 3]
    assert batch.t.tolist() == [1, 2, 3, 4, 5]
    assert torch.equal(batch.edge_feat, feats[order].float())


def test_tgl_feature_rows_must_match_edges(tmp_path: Path) -> None:
    make_tgl(tmp_path / "tgl", [1, 2, 3], extra_feature_rows=1)
    with pytest.raises(LoaderError, match=r"edge_features\.pt: has 4 rows, edges\.csv has 3"):
        load_events(tmp_path / "tgl")
    with pytest.raises(LoaderError, match="feature width mismatch: 2 features, expected 3"):
        load_events(tmp_path / "tgl", feature_dim=3)


def test_snap_edge_list_with_comments_and_tabs(tmp_path: Path) -> None:
    text = "# Directed graph\n# FromNodeId\tToNodeId\tTime\n1\t2\t10\n2\t3\t11\n3\t1\t11\n"
    path = write(tmp_path / "snap.txt.gz", text)
    batch = load_events(path)
    assert batch.src.tolist() == [1, 2, 3] and batch.dst.tolist() == [2, 3, 1]
    assert batch.t.tolist() == [10, 11, 11]
    bad = write(tmp_path / "bad.txt", "# c\n1 2 10\n2 3 x\n")
    with pytest.raises(LoaderError, match=r"bad\.txt: line 3: non-numeric time: 'x'"):
        load_events(bad)


def test_parquet_with_list_features(tmp_path: Path) -> None:
    table = pa.table(
        {
            "a": pa.array([5, 6, 7], pa.int32()),
            "b": pa.array([1, 2, 3], pa.int64()),
            "when": [0.5, 1.5, 1.5],
            "y": [0, 1, 0],
            "x": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
            "other": ["p", "q", "r"],
        }
    )
    pq.write_table(table, tmp_path / "e.parquet", row_group_size=2)
    columns = ColumnMap(src="a", dst="b", time="when", label="y", features="x")
    batch = load_events(tmp_path / "e.parquet", columns=columns, chunk_rows=1)
    assert batch.src.tolist() == [5, 6, 7] and batch.dst.tolist() == [1, 2, 3]
    assert batch.t.tolist() == [0.5, 1.5, 1.5] and batch.label.tolist() == [0, 1, 0]
    assert batch.edge_feat.tolist() == [[1, 2], [3, 4], [5, 6]]


def test_parquet_bad_rows_name_the_row(tmp_path: Path) -> None:
    table = pa.table({"src": [1, -2, 3], "dst": [1, 2, 3], "time": [1.0, 2.0, 3.0]})
    pq.write_table(table, tmp_path / "e.parquet")
    with pytest.raises(LoaderError, match=r"e\.parquet: row 2: negative id: -2 in column 'src'"):
        load_events(tmp_path / "e.parquet")
    ragged = pa.table({"src": [1, 2], "dst": [1, 2], "time": [1.0, 2.0], "f": [[1.0], [1.0, 2.0]]})
    pq.write_table(ragged, tmp_path / "r.parquet")
    with pytest.raises(LoaderError, match=r"r\.parquet: row 1: feature width mismatch: 1 values"):
        load_events(tmp_path / "r.parquet", columns=ColumnMap(features="f"), feature_dim=2)


def test_parquet_nulls_are_rejected(tmp_path: Path) -> None:
    table = pa.table({"src": ["1", None, "3"], "dst": [1, 2, None], "time": [1.0, 2.0, 3.0]})
    pq.write_table(table, tmp_path / "n.parquet")
    with pytest.raises(LoaderError, match=r"n\.parquet: row 2: missing id: null in column 'src'"):
        load_events(tmp_path / "n.parquet")
    batch = load_events(tmp_path / "n.parquet", quarantine=tmp_path / "q.csv")
    assert batch.src.tolist() == [1]


def bitcoin_file(tmp_path: Path) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(3)
    n = 200
    base = np.arange(n) * 10 + 1_400_000_000
    times = base + rng.integers(-40, 40, n)  # unsorted, each row at most a few rows out of place
    rows = [
        f"{rng.integers(1, 50)},{rng.integers(1, 50)},{rng.integers(-10, 11)},{t}" for t in times
    ]
    path = write(tmp_path / "bitcoin.csv", "SOURCE,TARGET,RATING,TIME\n" + "\n".join(rows) + "\n")
    return path, times


def test_bitcoin_style_unsorted_with_extra_columns(tmp_path: Path) -> None:
    path, times = bitcoin_file(tmp_path)
    order = np.argsort(times, kind="stable")
    for sort in (True, "full"):
        batch = load_events(path, sort=sort, reorder_window=16, chunk_rows=7)
        assert batch.t.tolist() == times[order].astype(float).tolist()
        assert_stream_ok(batch)
    first_drop = int(np.flatnonzero(np.diff(times) < 0)[0]) + 3  # header is line 1
    with pytest.raises(LoaderError, match=rf"bitcoin\.csv: line {first_drop}: time decreases"):
        load_events(path)


def test_gzip_csv_and_explicit_columns(tmp_path: Path) -> None:
    path = write(tmp_path / "e.csv.gz", "x,from,to,when\n9,1,2,3\n9,2,1,4\n")
    columns = ColumnMap(src="from", dst="to", time=3)
    batch = load_events(path, columns=columns)
    assert batch.src.tolist() == [1, 2] and batch.t.tolist() == [3, 4]


def test_integral_float_ids_are_accepted(tmp_path: Path) -> None:
    path = write(tmp_path / "e.csv", "src,dst,time\n3.0,1e3,1\n +4 ,5,2.5\n")
    batch = load_events(path)
    assert batch.src.tolist() == [3, 4] and batch.dst.tolist() == [1000, 5]


def test_reader_iterates_twice_the_same(tmp_path: Path) -> None:
    path = write(tmp_path / "e.csv", "src,dst,time\n0,1,1\n1,2\n2,3,3\n")
    reader = open_events(path, quarantine=tmp_path / "q.csv", chunk_rows=1)
    first, second = EventBatch.cat(list(reader)), EventBatch.cat(list(reader))
    assert_same(first, second)
    assert reader.stats.rows_rejected == 1 and reader.stats.rows_read == 3


# ----------------------------------------------------------------------------- chunking


def test_small_file_identical_for_every_chunk_size(tmp_path: Path) -> None:
    path, _ = bitcoin_file(tmp_path)
    reference = load_events(path, sort="full")
    for chunk_rows in (1, 2, 3, 7, 64, 199, 200, 201, 10_000):
        got = load_events(path, sort=True, reorder_window=16, chunk_rows=chunk_rows)
        assert_same(got, reference)


def test_invalid_rows_deep_in_a_file_keep_line_numbers(tmp_path: Path) -> None:
    n, bad = 20_000, {15_000: "1,2", 19_000: "1,2,3,4", 19_999: "7"}
    rows = [bad.get(i, f"{i},{i + 1},{i}") for i in range(n)]
    path = write(tmp_path / "big.csv", "src,dst,time\n" + "\n".join(rows) + "\n")
    quarantine = tmp_path / "q.csv"
    reader = open_events(path, chunk_rows=500, quarantine=quarantine)
    batches = list(reader)
    assert len(batches) > 30
    batch = EventBatch.cat(batches)
    expected = [i for i in range(n) if i not in bad]
    assert batch.src.tolist() == expected and batch.t.tolist() == expected
    lines = [int(r["line"]) for r in csv.DictReader(quarantine.open())]
    assert lines == [i + 2 for i in sorted(bad)]
    with pytest.raises(
        LoaderError, match=r"big\.csv: line 15002: wrong field count: row has 2 fields"
    ):
        load_events(path, chunk_rows=500)


def test_reading_streams_instead_of_reading_whole(tmp_path: Path) -> None:
    n = 200_000
    path = write(
        tmp_path / "long.csv", "src,dst,time\n" + "".join(f"{i},1,{i}\n" for i in range(n))
    )
    reader = open_events(path, chunk_rows=1_000)
    first = next(iter(reader))
    assert len(first) == 1_000 and first.eid[-1] == 999
    assert reader._source.rows_seen < n // 4  # only a few blocks were parsed so far


def reference_window(times: list[int], window: int) -> tuple[list[int], list[int]]:
    """Row by row: the late rows, and the others' arrival indices stably sorted by time."""
    late, kept = [], []
    for i, t in enumerate(times):
        bound = max(times[: max(i - window, 0)], default=None)
        (late if bound is not None and t < bound else kept).append(i)
    return late, sorted(kept, key=lambda i: times[i])


@settings(max_examples=60, deadline=None)
@given(
    times=st.lists(st.integers(0, 30), min_size=1, max_size=60),
    window=st.integers(0, 8),
    chunk_rows=st.integers(1, 20),
)
def test_reorder_window_matches_row_by_row_rule(
    tmp_path_factory: pytest.TempPathFactory, times: list[int], window: int, chunk_rows: int
) -> None:
    path = tmp_path_factory.mktemp("w") / "e.csv"
    write(path, "src,dst,time\n" + "".join(f"{i},{i},{t}\n" for i, t in enumerate(times)))
    quarantine = path.with_name("q.csv")
    sort = window > 0
    reader = open_events(
        path, sort=sort, reorder_window=max(window, 1), chunk_rows=chunk_rows, quarantine=quarantine
    )
    got = load_events(path, config=reader.config)
    late, kept = reference_window(times, window if sort else 0)
    assert got.src.tolist() == kept
    rejected = list(csv.DictReader(quarantine.open()))
    assert [int(r["line"]) - 2 for r in rejected] == late


# ----------------------------------------------------------------------------- bad input


BAD_CASES = [
    ("1,2,abc", {}, "line 3: non-numeric time: 'abc' in column 'time'"),
    ("1,2,nan", {}, "line 3: NaN time: column 'time' holds nan"),
    ("1,2,inf", {}, "line 3: non-finite time: column 'time' holds inf"),
    ("1,2,", {}, "line 3: non-numeric time: '' in column 'time'"),
    ("-1,2,5", {}, "line 3: negative id: -1 in column 'src'"),
    ("1,2.5,5", {}, "line 3: non-integer id: '2.5' in column 'dst'"),
    ("1,x,5", {}, "line 3: non-numeric id: 'x' in column 'dst'"),
    ("1,2,5,7", {}, "line 3: wrong field count: row has 4 fields, expected 3"),
    ("1,2", {}, "line 3: wrong field count: row has 2 fields, expected 3"),
    ("1,2,0", {}, "line 3: time decreases: time 0 is earlier than 1"),
    ("1,20,5", {"num_nodes": 10}, "line 3: id out of range: dst id 20 >= num_nodes 10"),
]


@pytest.mark.parametrize(("row", "options", "message"), BAD_CASES)
def test_bad_row_names_file_line_and_reason(
    tmp_path: Path, row: str, options: dict, message: str
) -> None:
    path = write(tmp_path / "events.csv", f"src,dst,time\n0,1,1\n{row}\n3,4,9\n")
    with pytest.raises(LoaderError) as info:
        load_events(path, **options)
    assert str(info.value).startswith(f"{path}: {message}")
    assert info.value.line == 3
    quarantine = tmp_path / "q.csv"
    batch = load_events(path, quarantine=quarantine, **options)
    assert batch.src.tolist() == [0, 3]  # the valid rows, none dropped
    rows = list(csv.DictReader(quarantine.open()))
    assert (
        len(rows) == 1 and rows[0]["line"] == "3" and message.split(": ", 1)[1] in rows[0]["reason"]
    )


def test_missing_column_names_the_header(tmp_path: Path) -> None:
    path = write(tmp_path / "e.csv", "u,i,timestamp\n1,2,3\n")
    with pytest.raises(LoaderError, match=r"e\.csv: line 1: missing column 'ts'"):
        load_events(path, columns=ColumnMap(src="u", dst="i", time="ts"))
    with pytest.raises(LoaderError, match=r"e\.csv: line 1: missing column at position 5"):
        load_events(path, columns=ColumnMap(src="u", dst="i", time=5))
    odd = write(tmp_path / "odd.csv", "a,b,c\n1,2,3\n")
    with pytest.raises(LoaderError, match="cannot find a src column"):
        load_events(odd)


def test_feature_width_mismatch(tmp_path: Path) -> None:
    text = "user_id,item_id,timestamp,state_label,features\n0,0,1,0,0.5,0.5\n1,0,2,0,0.5\n"
    path = write(tmp_path / "j.csv", text)
    with pytest.raises(
        LoaderError,
        match=r"j\.csv: line 3: feature width mismatch \(2 features expected\): row has 5 f",
    ):
        load_events(path)
    with pytest.raises(LoaderError, match=r"j\.csv: line 2: feature width mismatch: 2 feature"):
        load_events(path, feature_dim=3)


def test_late_event_beyond_window(tmp_path: Path) -> None:
    path = write(tmp_path / "e.csv", "src,dst,time\n0,0,5\n0,0,6\n0,0,7\n0,0,4\n")
    assert load_events(path, sort=True, reorder_window=3).t.tolist() == [4, 5, 6, 7]
    with pytest.raises(
        LoaderError, match=r"line 5: too late for the reorder window: time 4 is earlier than 5"
    ):
        load_events(path, sort=True, reorder_window=2)


def test_quarantine_counts_logs_and_keeps_valid_rows(tmp_path: Path, caplog) -> None:
    rows = ["0,1,1", "x,1,2", "0,1,nan", "2,3,3", "4,5", "1,1,0", "5,6,7"]
    path = write(tmp_path / "e.csv", "src,dst,time\n" + "\n".join(rows) + "\n")
    quarantine = tmp_path / "out" / "q.csv"
    reader = open_events(path, quarantine=quarantine, chunk_rows=2)
    with caplog.at_level(logging.WARNING, logger="tidegraph.storage.ingest"):
        batch = EventBatch.cat(list(reader))
    assert batch.src.tolist() == [0, 2, 5] and batch.eid.tolist() == [0, 1, 2]
    assert reader.stats.rows_read == 7 and reader.stats.rows_yielded == 3
    assert reader.stats.rows_rejected == 4
    assert reader.stats.rejected_by_reason == {
        "non-numeric id": 1,
        "NaN time": 1,
        "wrong field count": 1,
        "time decreases": 1,
    }
    written = list(csv.DictReader(quarantine.open()))
    assert sorted(int(r["line"]) for r in written) == [3, 4, 6, 7]
    assert {r["line"]: r["text"] for r in written}["6"] == "4,5"
    assert "rejected 4 of 7 rows" in caplog.text


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="LoaderConfig.chunk_rows"):
        LoaderConfig(chunk_rows=0)
    with pytest.raises(ValueError, match="LoaderConfig.sort"):
        LoaderConfig(sort="sometimes")
    with pytest.raises(ValueError, match="LoaderConfig.format"):
        LoaderConfig(format="xml")
    with pytest.raises(ValueError, match="ColumnMap.src"):
        ColumnMap(src=-1)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match="no such file"):
        open_events(tmp_path / "nope.csv")


# ----------------------------------------------------------------------------- wide feature files


def wide_jodie(path: Path, n: int, width: int, bad: dict[int, str] | None = None) -> Path:
    """A JODIE CSV of n rows with `width` features; `bad` replaces whole data rows by index."""
    rng = np.random.default_rng(5)
    feats = np.round(rng.standard_normal((n, width)), 6)
    rows = [
        f"{i % 97},{i % 13},{i},{i % 2}," + ",".join(map(str, feats[i].tolist())) for i in range(n)
    ]
    for i, row in (bad or {}).items():
        rows[i] = row
    return write(path, "user_id,item_id,timestamp,state_label,features\n" + "\n".join(rows) + "\n")


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """The (threads, typed) of each pass the CSV readers make."""
    seen: list[tuple[bool, bool]] = []
    original = CsvSource._open

    def spy(self: CsvSource, threads: bool, typed: bool):
        if self.typed:  # not the JODIE first pass, which reads the user column only
            seen.append((threads, typed))
        return original(self, threads, typed)

    monkeypatch.setattr(CsvSource, "_open", spy)
    return seen


def load_both(monkeypatch: pytest.MonkeyPatch, path: Path, **options) -> tuple[tuple, tuple]:
    """(batches, quarantined rows) read with typed features, then with text features only."""
    out = []
    for typed in (True, False):
        monkeypatch.setattr(CsvSource, "read_typed", typed)
        quarantine = path.with_name(f"q_{typed}.csv")
        batches = list(open_events(path, quarantine=quarantine, **options))
        out.append((batches, list(csv.DictReader(quarantine.open()))))
    return out[0], out[1]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int64)


def assert_bits_equal(a: list[EventBatch], b: list[EventBatch]) -> None:
    """Same batches, floats compared bit for bit (so NaNs and signed zeros count)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name in ("src", "dst", "t", "eid", "label", "edge_feat"):
            u, v = getattr(x, name), getattr(y, name)
            assert u.dtype == v.dtype and u.shape == v.shape, name
            assert torch.equal(bits(u), bits(v)), name


def test_wide_clean_file_reads_features_typed_in_one_pass(
    tmp_path: Path, passes: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = wide_jodie(tmp_path / "wide.csv", 3_000, 40)
    (fast, _), (text, _) = load_both(monkeypatch, path, chunk_rows=100)
    assert passes == [(True, True), (True, False)]  # one typed pass; then the text-only read
    assert_bits_equal(fast, text)
    assert sum(len(b) for b in fast) == 3_000 and fast[0].edge_feat.shape[1] == 40


def test_wide_bad_feature_deep_in_file_names_its_line(
    tmp_path: Path, passes: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, width = 20_000, 20
    good = wide_jodie(tmp_path / "good.csv", n, width).read_text().splitlines()
    fields = good[12_346].split(",")
    bad = {
        12_345: ",".join(fields[:10] + [""] + fields[11:]),  # an empty feature
        15_000: good[15_001].replace(",", ",,", 1),  # wrong field count
        17_500: good[17_501].rsplit(",", 1)[0] + ",x",  # last feature not a number
    }
    path = wide_jodie(tmp_path / "wide.csv", n, width, bad)
    with pytest.raises(LoaderError) as info:
        load_events(path, chunk_rows=100)
    assert str(info.value) == f"{path}: line 12347: non-numeric feature: '' in column 'f6'"
    assert passes[:2] == [(True, True), (True, False)]
    passes.clear()
    (fast, q_fast), (text, q_text) = load_both(monkeypatch, path, chunk_rows=100)
    assert passes[-1] == (False, False)
    assert_bits_equal(fast, text)
    assert q_fast == q_text
    assert [int(r["line"]) for r in q_fast] == [12_347, 15_002, 17_502]
    assert q_fast[2]["reason"] == "non-numeric feature: 'x' in column 'f19'"
    kept = torch.cat([b.t for b in fast])
    assert kept.tolist() == [float(i) for i in range(n) if i not in bad]


def test_wide_invalid_row_before_bad_value_is_reported_once(
    tmp_path: Path, passes: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, width = 8_000, 10
    good = wide_jodie(tmp_path / "good.csv", n, width).read_text().splitlines()
    bad = {1_000: "1,2,1000,0", 6_000: good[6_001].rsplit(",", 1)[0] + ",1..5"}
    path = wide_jodie(tmp_path / "wide.csv", n, width, bad)
    (fast, q_fast), (text, q_text) = load_both(monkeypatch, path, chunk_rows=50)
    assert_bits_equal(fast, text)
    assert q_fast == q_text and [int(r["line"]) for r in q_fast] == [1_002, 6_002]
    assert q_fast[0]["reason"].startswith("feature width mismatch (10 features expected)")


GOOD_FEATURES = ["0", "-0", "1.5", " 2.25 ", "+.5", "5.", "1e-3", "1E400", "-1e-400", "nan",
                 "-NaN", "inf", "-Infinity", "0.1234567890123456789", "3.4028235677973366e38",
                 "1.0000000596046448"]  # fmt: skip
BAD_FEATURES = ["x", "", " ", "NA", "null", "1e", "--1", "0x1", "1,5"]


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.lists(st.sampled_from(GOOD_FEATURES), min_size=3, max_size=3), max_size=30),
    bad=st.none() | st.tuples(st.integers(0, 29), st.integers(0, 2), st.sampled_from(BAD_FEATURES)),
    chunk_rows=st.integers(1, 8),
    quote=st.booleans(),
)
def test_typed_and_text_features_agree_bit_for_bit(
    tmp_path_factory: pytest.TempPathFactory,
    values: list[list[str]],
    bad: tuple[int, int, str] | None,
    chunk_rows: int,
    quote: bool,
) -> None:
    if bad is not None and bad[0] < len(values):
        values[bad[0]][bad[1]] = bad[2]
    q = '"' if quote else ""
    rows = [
        f"{i},{i % 2},{i},0," + ",".join(q + v + q for v in row) for i, row in enumerate(values)
    ]
    path = tmp_path_factory.mktemp("f") / "j.csv"
    write(
        path, "user_id,item_id,timestamp,state_label,features\n" + "".join(r + "\n" for r in rows)
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        (fast, q_fast), (text, q_text) = load_both(monkeypatch, path, chunk_rows=chunk_rows)
    assert_bits_equal(fast, text)
    assert q_fast == q_text


# ----------------------------------------------------------------------------- edge cases of input


def quarantined(path: Path) -> list[dict]:
    return list(csv.DictReader(path.open()))


def test_ids_beyond_int64_are_rejected_and_others_stay_exact(tmp_path: Path) -> None:
    big = 2**53 + 1  # a float would read it as 2**53
    path = write(
        tmp_path / "e.csv",
        f"src,dst,time\n{big},1,1\n99999999999999999999,2,2\n{2**63 - 1},+0{2**63 - 1},3\n",
    )
    with pytest.raises(LoaderError) as info:
        load_events(path)
    assert str(info.value) == (
        f"{path}: line 3: id out of range: '99999999999999999999' in column 'src' "
        "does not fit in int64"
    )
    batch = load_events(path, quarantine=tmp_path / "q.csv")
    assert batch.src.tolist() == [big, 2**63 - 1] and batch.dst.tolist() == [1, 2**63 - 1]
    assert [r["line"] for r in quarantined(tmp_path / "q.csv")] == ["3"]
    floats = write(tmp_path / "f.csv", f"src,dst,time\n1,1e19,1\n1,{2**63},2\n-1e30,1,3\n")
    load_events(floats, quarantine=tmp_path / "qf.csv")
    reasons = [r["reason"] for r in quarantined(tmp_path / "qf.csv")]
    assert len(reasons) == 3 and all(r.startswith("id out of range") for r in reasons)


def test_parquet_ids_beyond_int64_are_rejected(tmp_path: Path) -> None:
    ids = pa.array([2**63, 5, 2**64 - 1, None], pa.uint64())
    table = pa.table({"src": ids, "dst": [1, 2, 3, 4], "time": [1.0, 2.0, 3.0, 4.0]})
    pq.write_table(table, tmp_path / "u.parquet")
    with pytest.raises(
        LoaderError, match=r"u\.parquet: row 1: id out of range: 9223372036854775808 in column"
    ):
        load_events(tmp_path / "u.parquet")
    assert load_events(tmp_path / "u.parquet", quarantine=tmp_path / "q.csv").src.tolist() == [5]
    reasons = [r["reason"].split(":")[0] for r in quarantined(tmp_path / "q.csv")]
    assert reasons == ["id out of range", "id out of range", "missing id"]
    floats = pa.table({"src": [1e19, 2.0**62], "dst": [1.0, 2.0], "time": [1.0, 2.0]})
    pq.write_table(floats, tmp_path / "f.parquet")
    with pytest.raises(LoaderError, match=r"f\.parquet: row 1: id out of range: 1e\+19"):
        load_events(tmp_path / "f.parquet")
    got = load_events(tmp_path / "f.parquet", quarantine=tmp_path / "q.csv")
    assert got.src.tolist() == [2**62]


def test_jodie_item_shift_past_int64_is_out_of_range(tmp_path: Path) -> None:
    text = f"user_id,item_id,timestamp,state_label\n0,{2**63 - 2},1,0\n1,2,2,0\n"
    path = write(tmp_path / "j.csv", text)
    with pytest.raises(
        LoaderError, match=r"j\.csv: line 2: id out of range: dst id 9223372036854775806 \+ num"
    ):
        load_events(path)
    assert load_events(path, quarantine=tmp_path / "q.csv").dst.tolist() == [4]
    huge_user = write(tmp_path / "h.csv", text.replace("1,2,2,0", "99999999999999999999,2,2,0"))
    with pytest.raises(LoaderError, match=r"h\.csv: line 3: id out of range: '9999"):
        load_events(huge_user)  # the first pass (max user id) skips it instead of failing
    kept = load_events(huge_user, quarantine=tmp_path / "q2.csv")
    assert kept.dst.tolist() == [2**63 - 1]  # num_users = 1


def test_header_expected_but_first_line_is_data(tmp_path: Path) -> None:
    path = write(tmp_path / "j.csv", "0,0,1,0,0.1\n2,1,2,1,0.3\n")
    positional = ColumnMap(src=0, dst=1, time=2)
    for options in ({"format": "jodie"}, {"format": "csv", "columns": positional}):
        with pytest.raises(LoaderError) as info:
            load_events(path, **options)
        assert info.value.line == 1 and str(info.value).startswith(f"{path}: line 1: no header")
        assert "header=False" in info.value.reason
    jodie = load_events(path, format="jodie", header=False)
    assert jodie.src.tolist() == [0, 2] and jodie.dst.tolist() == [3, 4]
    assert jodie.edge_feat.shape == (2, 1)
    with pytest.raises(LoaderError, match="5 columns and no header"):  # which one is time?
        load_events(path, format="csv", header=False)
    assert load_events(path, format="csv", header=False, columns=positional).src.tolist() == [0, 2]
    numeric_names = write(tmp_path / "n.csv", "0,1,2\n5,6,7\n")  # header=True: line 1 is one
    assert load_events(numeric_names, "csv", header=True, columns=positional).src.tolist() == [5]


def test_parquet_scalar_feature_columns_check_feature_dim(tmp_path: Path) -> None:
    table = pa.table({"src": [1, 2], "dst": [1, 2], "time": [1.0, 2.0], "a": [1.0, 2.0]})
    pq.write_table(table.append_column("b", pa.array([3.0, 4.0])), tmp_path / "w.parquet")
    columns = ColumnMap(features=("a", "b"))
    with pytest.raises(
        LoaderError, match=r"w\.parquet: feature width mismatch: 2 feature columns, expected 3"
    ):
        load_events(tmp_path / "w.parquet", columns=columns, feature_dim=3)
    got = load_events(tmp_path / "w.parquet", columns=columns, feature_dim=2)
    assert got.edge_feat.tolist() == [[1, 3], [2, 4]]


def test_parquet_empty_and_null_feature_lists(tmp_path: Path) -> None:
    base = {"src": [1, 2], "dst": [1, 2], "time": [1.0, 2.0]}
    columns = ColumnMap(features="f")
    pq.write_table(pa.table({**base, "f": [[], []]}), tmp_path / "z.parquet")
    for dim in (None, 0):
        assert load_events(
            tmp_path / "z.parquet", columns=columns, feature_dim=dim
        ).edge_feat.shape == (2, 0)
    pq.write_table(pa.table({**base, "f": [[], [1.0]]}), tmp_path / "e.parquet")
    with pytest.raises(
        LoaderError,
        match=r"e\.parquet: row 2: feature width mismatch: 1 values in column 'f', expected 0",
    ):
        load_events(tmp_path / "e.parquet", columns=columns)
    pq.write_table(pa.table({**base, "f": [[1.0], None]}), tmp_path / "n.parquet")
    with pytest.raises(
        LoaderError, match=r"n\.parquet: row 2: missing features: null in column 'f'"
    ):
        load_events(tmp_path / "n.parquet", columns=columns)
    kept = load_events(tmp_path / "n.parquet", columns=columns, quarantine=tmp_path / "q.csv")
    assert kept.edge_feat.tolist() == [[1.0]]


@pytest.mark.parametrize("chunk_rows", [1, 2, 100])
def test_first_bad_row_in_file_order_is_reported(tmp_path: Path, chunk_rows: int) -> None:
    path = write(tmp_path / "e.csv", "src,dst,time\n1,2,5\n3,4,2\n5,6,6\n7,8,x\n")
    with pytest.raises(LoaderError, match=r"e\.csv: line 3: time decreases"):
        load_events(path, chunk_rows=chunk_rows)
    load_events(path, chunk_rows=chunk_rows, quarantine=tmp_path / "q.csv")
    assert [r["line"] for r in quarantined(tmp_path / "q.csv")] == ["3", "5"]


def test_utf8_bom_is_ignored(tmp_path: Path) -> None:
    bom = b"\xef\xbb\xbf"
    csv_path = tmp_path / "b.csv"
    csv_path.write_bytes(bom + b"src,dst,time\n1,2,3\n")
    assert load_events(csv_path).src.tolist() == [1]
    jodie = tmp_path / "j.csv"
    jodie.write_bytes(bom + b"user_id,item_id,timestamp,state_label\n0,0,1,0\n")
    assert load_events(jodie).dst.tolist() == [1]
    snap = tmp_path / "s.txt"
    snap.write_bytes(bom + b"1 2 3\n")
    assert load_events(snap).src.tolist() == [1]


def test_snap_runs_of_whitespace_and_empty_files(tmp_path: Path) -> None:
    path = write(tmp_path / "s.txt", "# c\n  1  2  10 \n2\t\t3 11\n4 5\n6 7  12\n")
    with pytest.raises(LoaderError, match=r"s\.txt: line 4: wrong field count: row has 2 fields"):
        load_events(path)
    batch = load_events(path, quarantine=tmp_path / "q.csv")
    assert batch.src.tolist() == [1, 2, 6] and batch.dst.tolist() == [2, 3, 7]
    assert batch.t.tolist() == [10, 11, 12]
    assert quarantined(tmp_path / "q.csv")[0]["text"] == "4 5"
    for text in ("", "# comments only\n"):
        empty = write(tmp_path / "e.txt", text)
        for fmt in ("snap", "auto"):
            assert len(load_events(empty, fmt)) == 0


def test_tgl_feature_dim_applies_to_the_feature_tensor(tmp_path: Path) -> None:
    feats = make_tgl(tmp_path / "tgl", [1, 2, 3])
    assert torch.equal(load_events(tmp_path / "tgl", feature_dim=2).edge_feat, feats.float())


@pytest.mark.parametrize("typed", [True, False])
def test_features_beyond_float32_range_are_rejected_not_made_infinite(
    tmp_path: Path, typed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tidegraph.storage.ingest.text import CsvSource

    monkeypatch.setattr(CsvSource, "read_typed", typed)
    text = (
        "user_id,item_id,timestamp,state_label,features\n"
        "0,0,1.0,0,0.5,0.25\n"
        "1,0,2.0,0,1e39,0.5\n"  # finite, but float32 cannot hold it
        "2,1,3.0,0,0.25,-3e300\n"
        "3,1,4.0,0,0.25,inf\n"  # an infinity written as such poisons the model too
    )
    path = write(tmp_path / "big.csv", text)
    with pytest.raises(LoaderError) as info:
        load_events(path)
    assert str(info.value) == f"{path}: line 3: feature out of float32 range: 1e+39 in column 'f0'"
    batch = load_events(path, quarantine=tmp_path / "q.csv")
    assert batch.src.tolist() == [0] and batch.edge_feat[0].tolist() == [0.5, 0.25]
    rejected = quarantined(tmp_path / "q.csv")
    assert [r["line"] for r in rejected] == ["3", "4", "5"]
    assert rejected[2]["reason"] == "non-finite feature: inf in column 'f1'"


def test_parquet_list_features_beyond_float32_range_are_rejected(tmp_path: Path) -> None:
    table = pa.table(
        {"src": [0, 1], "dst": [1, 2], "ts": [1.0, 2.0], "x": pa.array([[1.0, 2.0], [5e38, 0.0]])}
    )
    pq.write_table(table, tmp_path / "e.parquet")
    columns = ColumnMap(src="src", dst="dst", time="ts", features="x")
    with pytest.raises(LoaderError, match=r"row 2: feature out of float32 range: 5e\+38"):
        load_events(tmp_path / "e.parquet", columns=columns)


def test_tgl_float64_features_beyond_float32_range_are_rejected(tmp_path: Path) -> None:
    make_tgl(tmp_path / "tgl", [1, 2, 3])
    feats = torch.arange(6, dtype=torch.float64).view(3, 2)
    feats[1, 1] = 1e39
    torch.save(feats, tmp_path / "tgl" / "edge_features.pt")
    with pytest.raises(LoaderError) as info:
        load_events(tmp_path / "tgl")
    assert str(info.value).endswith(
        "line 3: feature out of float32 range: 1e+39 in column 'edge_features.pt[:, 1]'"
    )
    batch = load_events(tmp_path / "tgl", quarantine=tmp_path / "q.csv")
    assert batch.edge_feat.tolist() == [[0.0, 1.0], [4.0, 5.0]]
