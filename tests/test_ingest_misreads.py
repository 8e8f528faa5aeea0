"""No silent misreads: ambiguous headerless layouts, Parquet column types, invalid UTF-8 and
unreadable files all end in a clear LoaderError (or a quarantined row), never in wrong data."""

import csv
import datetime as dt
import gzip
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidegraph.data import bundled_names, bundled_path, is_bundled
from tidegraph.storage.ingest import (
    ColumnMap,
    LoaderError,
    load_events,
    parse_columns,
    parse_features,
)
from tidegraph.training.config import RunConfig
from tidegraph.training.data import load_stream


def write(path: Path, data: str | bytes) -> Path:
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def rows_of(path: Path) -> list[dict]:
    return list(csv.DictReader(path.open(encoding="utf-8")))


SIGNED = "1,2,-1,1300000000\n2,3,1,1300000100\n3,1,1,1300000200\n"  # src,dst,rating,time


# ------------------------------------------------------------------------ headerless layouts


@pytest.mark.parametrize("sep", [",", " ", "\t"])
def test_headerless_four_columns_stop_auto_detection(tmp_path: Path, sep: str) -> None:
    path = write(tmp_path / "signed.txt", SIGNED.replace(",", sep))
    with pytest.raises(LoaderError) as info:
        load_events(path)
    reason = info.value.reason
    assert info.value.line == 1 and reason.startswith("4 columns and no header")
    assert "0: '1', 1: '2', 2: '-1', 3: '1300000000'" in reason
    assert "--columns src=0,dst=1,time=3" in reason and "--no-header" in reason


def test_column_map_chooses_the_time_column(tmp_path: Path) -> None:
    path = write(tmp_path / "signed.csv", SIGNED)
    batch = load_events(path, columns=ColumnMap(src=0, dst=1, time=3))
    assert batch.t.tolist() == [1300000000.0, 1300000100.0, 1300000200.0]
    with_rating = load_events(path, columns=parse_columns("src=0,dst=1,time=3,features=2"))
    assert with_rating.edge_feat[:, 0].tolist() == [-1.0, 1.0, 1.0]


def test_format_csv_on_a_headerless_file(tmp_path: Path) -> None:
    path = write(tmp_path / "signed.csv", SIGNED)
    with pytest.raises(LoaderError, match="no header found"):  # csv expects a header
        load_events(path, "csv")
    with pytest.raises(LoaderError, match="4 columns and no header"):
        load_events(path, "csv", header=False)
    batch = load_events(path, "csv", header=False, columns=parse_columns("src=0,dst=1,time=3"))
    assert batch.src.tolist() == [1, 2, 3] and batch.t[0].item() == 1300000000.0


def test_three_headerless_columns_are_still_src_dst_time(tmp_path: Path) -> None:
    path = write(tmp_path / "e.txt.gz", "1 2 10\n2 3 20\n")
    assert load_events(path).t.tolist() == [10.0, 20.0]


def test_column_and_feature_specs() -> None:
    assert parse_columns("src=u,dst=i,time=ts,label=y") == ColumnMap(
        src="u", dst="i", time="ts", label="y"
    )
    assert parse_columns({"src": 0, "dst": 1, "time": 3, "features": [4, 5]}).features == (4, 5)
    assert parse_features("4-6,rating") == (4, 5, 6, "rating")
    assert parse_features("emb") == "emb"  # one name: perhaps a list column
    for bad, field in (("src0", "columns"), ("when=3", "columns"), ("5-2", "features")):
        with pytest.raises(ValueError, match=field):
            (parse_columns if field == "columns" else parse_features)(bad)


def test_data_section_validates_columns_and_features() -> None:
    cfg = RunConfig.from_dict({"data": {"columns": "src=0,dst=1,time=3", "features": [2]}})
    assert cfg.data.columns == "src=0,dst=1,time=3" and cfg.data.header is None
    with pytest.raises(ValueError, match=r"data\.columns: unknown roles \['when'\]"):
        RunConfig.from_dict({"data": {"columns": {"when": 3}}})
    with pytest.raises(ValueError, match=r"data\.features"):
        RunConfig.from_dict({"data": {"features": "9-1"}})


# ----------------------------------------------------------------------------- Parquet types


def table(time, **extra) -> pa.Table:
    n = len(time)
    return pa.table({"src": list(range(n)), "dst": [1] * n, "time": time, **extra})


def test_parquet_boolean_time_is_refused_by_schema(tmp_path: Path) -> None:
    pq.write_table(table(pa.array([True, False, True])), tmp_path / "b.parquet")
    with pytest.raises(LoaderError) as info:
        load_events(tmp_path / "b.parquet", quarantine=tmp_path / "q.csv")
    assert info.value.line is None
    assert info.value.reason == "time column 'time' has type bool; it must hold a number, " \
        "timestamp or date"  # fmt: skip
    pq.write_table(table(["1", "2"]), tmp_path / "s.parquet")
    with pytest.raises(LoaderError, match="time column 'time' has type string"):
        load_events(tmp_path / "s.parquet")


def test_parquet_boolean_or_nested_ids_are_refused_by_schema(tmp_path: Path) -> None:
    t = table([1.0, 2.0]).set_column(0, "src", pa.array([True, False]))
    pq.write_table(t, tmp_path / "b.parquet")
    with pytest.raises(LoaderError, match=r"b\.parquet: src column 'src' has type bool"):
        load_events(tmp_path / "b.parquet")
    nested = table([1.0, 2.0]).set_column(1, "dst", pa.array([{"id": 1}, {"id": 2}]))
    pq.write_table(nested, tmp_path / "n.parquet")
    with pytest.raises(LoaderError, match=r"n\.parquet: dst column 'dst' has type struct"):
        load_events(tmp_path / "n.parquet")


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_parquet_timestamps_become_seconds(tmp_path: Path, unit: str, caplog) -> None:
    stamps = [dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc), dt.datetime(2020, 1, 2, 0, 0, 1)]
    times = pa.array(stamps, pa.timestamp(unit, tz="UTC" if unit == "ms" else None))
    pq.write_table(table(times), tmp_path / "t.parquet")
    with caplog.at_level(logging.INFO, logger="tidegraph.storage.ingest"):
        batch = load_events(tmp_path / "t.parquet")
    assert batch.t.tolist() == [1577836800.0, 1577836800.0 + 86401]
    assert "converted to seconds since the epoch" in caplog.text


def test_parquet_dates_become_seconds(tmp_path: Path) -> None:
    pq.write_table(table(pa.array([dt.date(1970, 1, 2), dt.date(1970, 1, 3)])), tmp_path / "d.pq")
    assert load_events(tmp_path / "d.pq").t.tolist() == [86400.0, 172800.0]


def test_parquet_null_timestamp_is_a_row_error(tmp_path: Path) -> None:
    times = pa.array([dt.datetime(2020, 1, 1), None], pa.timestamp("s"))
    pq.write_table(table(times), tmp_path / "t.parquet")
    with pytest.raises(LoaderError, match=r"row 2: missing time"):
        load_events(tmp_path / "t.parquet")


# ------------------------------------------------------------------------------ invalid UTF-8


def test_one_invalid_utf8_byte_quarantines_its_row(tmp_path: Path) -> None:
    path = write(tmp_path / "e.csv", b"src,dst,time\n1,2,3\n4,\xff5,6\n7,8,9\n")
    with pytest.raises(LoaderError) as info:
        load_events(path)
    assert str(info.value) == f"{path}: line 3: invalid UTF-8: column 'dst' holds b'\\xff5'"
    batch = load_events(path, quarantine=tmp_path / "q.csv")
    assert batch.src.tolist() == [1, 7]
    rejected = rows_of(tmp_path / "q.csv")
    assert [r["line"] for r in rejected] == ["3"] and rejected[0]["text"] == "4,\ufffd5,6"


def test_invalid_utf8_in_a_whitespace_edge_list_and_in_features(tmp_path: Path) -> None:
    snap = write(tmp_path / "e.txt", b"1  2 3\n4  5 \xfe6\n7  8 9\n")  # runs of spaces
    with pytest.raises(LoaderError, match=r"e\.txt: line 2: invalid UTF-8: the line holds"):
        load_events(snap)
    assert load_events(snap, quarantine=tmp_path / "q1.csv").src.tolist() == [1, 7]
    feat = write(tmp_path / "f.csv", b"src,dst,time,a\n1,2,3,0.5\n4,5,6,0.\xc35\n7,8,9,1\n")
    with pytest.raises(LoaderError, match=r"f\.csv: line 3: invalid UTF-8: column 'a'"):
        load_events(feat, features="a")
    kept = load_events(feat, features="a", quarantine=tmp_path / "q2.csv")
    assert kept.edge_feat[:, 0].tolist() == [0.5, 1.0]


def test_invalid_utf8_among_many_rows_is_found_exactly(tmp_path: Path) -> None:
    lines = [f"{i},{i + 1},{i}".encode() for i in range(50_000)]
    for i in (7, 31_000, 49_999):
        lines[i] = lines[i] + b"\x80"
    path = write(tmp_path / "e.csv", b"src,dst,time\n" + b"\n".join(lines) + b"\n")
    batch = load_events(path, quarantine=tmp_path / "q.csv", chunk_rows=4096)
    assert len(batch) == 50_000 - 3
    assert [r["line"] for r in rows_of(tmp_path / "q.csv")] == ["9", "31002", "50001"]


# --------------------------------------------------------------------------- unreadable files


def truncated_gzip(path: Path) -> Path:
    """The first half of a gzipped 300,000-line file: the stream ends mid-way."""
    lines = "".join(f"{i} {i + 1} {i}\n" for i in range(300_000))
    data = gzip.compress(lines.encode(), compresslevel=1)  # 0.2 s (level 9: 4 s)
    path.write_bytes(data[: len(data) // 2])
    return path


def test_truncated_gzip_names_the_file(tmp_path: Path) -> None:
    path = truncated_gzip(tmp_path / "cut.txt.gz")
    with pytest.raises(LoaderError) as info:
        load_events(path, quarantine=tmp_path / "q.csv")  # not a row problem: no quarantine
    assert info.value.path == str(path) and "cannot read the file" in info.value.reason


def test_corrupt_parquet_names_the_file(tmp_path: Path) -> None:
    pq.write_table(table([1.0, 2.0]), tmp_path / "ok.parquet")
    good = (tmp_path / "ok.parquet").read_bytes()
    for name, data in (("garbage.parquet", b"PAR1" + b"x" * 40 + b"PAR1"),
                       ("cut.parquet", good[: len(good) // 2])):  # fmt: skip
        write(tmp_path / name, data)
        with pytest.raises(LoaderError) as info:
            load_events(tmp_path / name)
        assert info.value.path == str(tmp_path / name)
        assert info.value.reason.startswith("cannot read: ")


# ------------------------------------------------------------------------------ one registry


def test_one_registry_of_bundled_datasets() -> None:
    assert bundled_names() == ["uci", "wikipedia"]
    assert is_bundled("UCI") and is_bundled("collegemsg") and not is_bundled("reddit")
    assert bundled_path("collegemsg") == bundled_path("uci")
    uci = load_stream("uci", 100)
    assert uci.name == "CollegeMsg.txt.gz" and len(uci.events) == 100
    assert load_stream("collegemsg", 100).events.src.tolist() == uci.events.src.tolist()
    with pytest.raises(ValueError, match=r"neither a bundled dataset \['uci', 'wikipedia'\]"):
        load_stream("reddit")


def test_parquet_dictionary_columns_are_read_by_their_values(tmp_path: Path) -> None:
    ids = pa.array(["7", "8", "7"]).dictionary_encode()  # as pandas writes categoricals
    t = table([1.0, 2.0, 3.0]).set_column(0, "src", ids)
    pq.write_table(t, tmp_path / "c.parquet")
    assert load_events(tmp_path / "c.parquet").src.tolist() == [7, 8, 7]


def test_stream_options_for_bundled_data_and_twice_named_features(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="tidegraph.training.data"):
        load_stream("uci", 50, format="csv")
    assert "format apply to files only: uci is read with its known layout" in caplog.text
    path = write(tmp_path / "e.csv", "src,dst,time,w\n0,1,1,0.5\n")
    with pytest.raises(ValueError, match=r"data\.features \(--features\): the feature columns"):
        load_stream(str(path), columns="src=0,dst=1,time=2,features=3", features="3")
