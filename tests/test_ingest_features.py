"""Edge features in every format: named by `features` / `columns`, read, logged; a row with a
wrong width or a non-finite value is rejected (or quarantined), never kept."""

import csv
import logging
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tidegraph.storage.ingest import ColumnMap, LoaderError, load_events, open_events
from tidegraph.training.data import load_stream

INGEST = "tidegraph.storage.ingest"


def rows_of(path: Path) -> list[dict]:
    return list(csv.DictReader(path.open()))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------- CSV


def test_csv_extra_columns_are_logged_when_not_read(tmp_path: Path, caplog) -> None:
    path = write(tmp_path / "e.csv", "src,dst,time,w,z\n0,1,1,0.5,2\n1,2,2,0.25,3\n")
    with caplog.at_level(logging.INFO, logger=INGEST):
        batch = load_events(path)
    assert batch.edge_feat is None
    assert "columns ['w', 'z'] are not read" in caplog.text and "--features" in caplog.text


def test_csv_features_by_name_and_by_position(tmp_path: Path, caplog) -> None:
    path = write(tmp_path / "e.csv", "src,dst,time,w,z\n0,1,1,0.5,2\n1,2,2,0.25,3\n")
    with caplog.at_level(logging.INFO, logger=INGEST):
        by_name = load_events(path, features="w,z")
    assert by_name.edge_feat.tolist() == [[0.5, 2.0], [0.25, 3.0]]
    assert f"edge features: 2 columns from columns ['w', 'z'] of {path}" in caplog.text
    by_position = load_events(path, features="3-4")
    assert torch.equal(by_position.edge_feat, by_name.edge_feat)
    one = load_events(path, features=["z"])
    assert one.edge_feat.tolist() == [[2.0], [3.0]]


def test_headerless_csv_with_column_map_and_feature_range(tmp_path: Path, caplog) -> None:
    path = write(tmp_path / "e.csv", "0,1,0.5,0.75,10\n2,3,0.25,0.5,20\n")
    columns = ColumnMap(src=0, dst=1, time=4)
    with caplog.at_level(logging.INFO, logger=INGEST):
        batch = load_events(path, "csv", header=False, columns=columns, features="2-3")
    assert batch.t.tolist() == [10.0, 20.0]
    assert batch.edge_feat.tolist() == [[0.5, 0.75], [0.25, 0.5]]
    assert "edge features: 2 columns from columns at positions [2, 3]" in caplog.text


def test_features_named_twice_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "e.csv", "src,dst,time,w\n0,1,1,0.5\n")
    with pytest.raises(ValueError, match="LoaderConfig.features"):
        load_events(path, columns=ColumnMap(features=("w",)), features="w")


def test_csv_row_with_wrong_feature_width_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path / "e.csv", "src,dst,time,a,b\n0,1,1,0.5,1\n1,2,2,0.5\n2,3,3,1,2,3\n")
    with pytest.raises(LoaderError, match=r"e\.csv: line 3: wrong field count: row has 4 fields"):
        load_events(path, features="a,b")
    batch = load_events(path, features="a,b", quarantine=tmp_path / "q.csv")
    assert batch.src.tolist() == [0] and batch.edge_feat.tolist() == [[0.5, 1.0]]
    assert [r["line"] for r in rows_of(tmp_path / "q.csv")] == ["3", "4"]


@pytest.mark.parametrize("value", ["nan", "NaN", "-inf"])
def test_csv_non_finite_feature_names_line_and_column(tmp_path: Path, value: str) -> None:
    path = write(tmp_path / "e.csv", f"src,dst,time,a,b\n0,1,1,0.5,1\n1,2,2,0.5,{value}\n")
    kind = "NaN feature" if "nan" in value.lower() else "non-finite feature"
    with pytest.raises(LoaderError) as info:
        load_events(path, features="a,b")
    assert info.value.line == 3 and info.value.reason.startswith(f"{kind}: ")
    assert info.value.reason.endswith("in column 'b'")
    batch = load_events(path, features="a,b", quarantine=tmp_path / "q.csv")
    assert batch.src.tolist() == [0]
    assert rows_of(tmp_path / "q.csv")[0]["line"] == "3"


def test_jodie_nan_feature_is_quarantined(tmp_path: Path) -> None:
    path = write(
        tmp_path / "j.csv",
        "user_id,item_id,timestamp,state_label,f\n0,0,1,0,0.5,1\n1,0,2,0,nan,1\n2,1,3,0,1,1\n",
    )
    with pytest.raises(LoaderError, match=r"j\.csv: line 3: NaN feature: nan in column 'f0'"):
        load_events(path)
    batch = load_events(path, quarantine=tmp_path / "q.csv")
    assert batch.src.tolist() == [0, 2] and bool(torch.isfinite(batch.edge_feat).all())


# ----------------------------------------------------------------------------------- Parquet


def base_table(n: int = 3) -> dict:
    return {
        "src": list(range(n)),
        "dst": [i + 1 for i in range(n)],
        "time": [float(i) for i in range(n)],
    }


@pytest.mark.parametrize("fixed", [False, True])
def test_parquet_list_feature_column(tmp_path: Path, fixed: bool, caplog) -> None:
    type_ = pa.list_(pa.float32(), 2) if fixed else pa.list_(pa.float64())
    feat = pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], type_)
    pq.write_table(pa.table({**base_table(), "emb": feat}), tmp_path / "e.parquet")
    with caplog.at_level(logging.INFO, logger=INGEST):
        batch = load_events(tmp_path / "e.parquet", features="emb")
    assert batch.edge_feat.tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert "edge features: 2 columns from list column 'emb'" in caplog.text


def test_parquet_named_feature_columns(tmp_path: Path) -> None:
    table = pa.table({**base_table(2), "a": [1.0, 2.0], "b": pa.array([3, 4], pa.int32())})
    pq.write_table(table, tmp_path / "e.parquet")
    batch = load_events(tmp_path / "e.parquet", features=["a", "b"])
    assert batch.edge_feat.tolist() == [[1.0, 3.0], [2.0, 4.0]]


def test_parquet_unread_columns_are_logged(tmp_path: Path, caplog) -> None:
    pq.write_table(pa.table({**base_table(2), "emb": [[1.0], [2.0]]}), tmp_path / "e.parquet")
    with caplog.at_level(logging.INFO, logger=INGEST):
        assert load_events(tmp_path / "e.parquet").edge_feat is None
    assert "columns ['emb'] are not read" in caplog.text


def test_parquet_list_of_wrong_width_and_nan_are_quarantined(tmp_path: Path) -> None:
    feat = pa.array([[1.0, 2.0], [3.0], [math.nan, 1.0], [4.0, None]], pa.list_(pa.float64()))
    pq.write_table(pa.table({**base_table(4), "emb": feat}), tmp_path / "e.parquet")
    with pytest.raises(LoaderError, match=r"e\.parquet: row 2: feature width mismatch"):
        load_events(tmp_path / "e.parquet", features="emb")
    batch = load_events(tmp_path / "e.parquet", features="emb", quarantine=tmp_path / "q.csv")
    assert batch.src.tolist() == [0]
    reasons = [(r["line"], r["reason"]) for r in rows_of(tmp_path / "q.csv")]
    assert reasons[0][0] == "2" and reasons[0][1].startswith("feature width mismatch")
    assert reasons[1] == ("3", "NaN feature: nan in column 'emb'")
    assert reasons[2] == ("4", "NaN feature: nan in column 'emb'")  # a null inside the list


def test_parquet_non_numeric_feature_column_is_refused_by_schema(tmp_path: Path) -> None:
    pq.write_table(pa.table({**base_table(2), "tag": ["x", "y"]}), tmp_path / "e.parquet")
    with pytest.raises(LoaderError, match=r"feature column 'tag' has type string"):
        load_events(tmp_path / "e.parquet", features="tag")


# --------------------------------------------------------------------------------------- TGL


def make_tgl(directory: Path, n: int = 4, width: int = 3) -> torch.Tensor:
    directory.mkdir()
    lines = ["src,dst,time"] + [f"{i},{i + 1},{i}" for i in range(n)]
    (directory / "edges.csv").write_text("\n".join(lines) + "\n")
    feats = torch.arange(n * width, dtype=torch.float32).view(n, width)
    torch.save(feats, directory / "edge_features.pt")
    torch.save(torch.ones(n + 1, 2), directory / "node_features.pt")
    return feats


def test_tgl_edges_csv_path_reads_edge_features_beside_it(tmp_path: Path, caplog) -> None:
    feats = make_tgl(tmp_path / "tgl")
    edges = tmp_path / "tgl" / "edges.csv"
    with caplog.at_level(logging.INFO, logger=INGEST):
        reader = open_events(edges)
        batch = load_events(edges)
    assert reader.format == "tgl" and torch.equal(batch.edge_feat, feats)
    assert "edge features: 3 columns from" in caplog.text and "edge_features.pt" in caplog.text
    assert reader.node_features().shape == (5, 2)
    assert torch.equal(load_events(edges, "tgl").edge_feat, feats)
    stream = load_stream(str(edges))
    assert stream.edge_dim == 3


def test_tgl_nan_edge_feature_names_its_line(tmp_path: Path) -> None:
    feats = make_tgl(tmp_path / "tgl")
    feats[2, 1] = math.nan
    torch.save(feats, tmp_path / "tgl" / "edge_features.pt")
    with pytest.raises(LoaderError) as info:
        load_events(tmp_path / "tgl")
    assert info.value.line == 4  # header is line 1
    assert info.value.reason == "NaN feature: nan in column 'edge_features.pt[:, 1]'"
    kept = load_events(tmp_path / "tgl", quarantine=tmp_path / "q.csv")
    assert kept.src.tolist() == [0, 1, 3]


def test_tgl_feature_columns_with_a_feature_tensor_are_refused(tmp_path: Path) -> None:
    make_tgl(tmp_path / "tgl")
    with pytest.raises(LoaderError, match="edge features come from edge_features.pt"):
        load_events(tmp_path / "tgl", features="time")


def test_corrupt_feature_tensor_names_the_file(tmp_path: Path) -> None:
    make_tgl(tmp_path / "tgl")
    (tmp_path / "tgl" / "edge_features.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(LoaderError, match=r"edge_features\.pt: cannot load the tensor"):
        load_events(tmp_path / "tgl")


# ------------------------------------------------------------------------------ load_stream


def test_load_stream_takes_the_data_section_options(tmp_path: Path) -> None:
    path = write(tmp_path / "r.csv", "".join(f"{i},{i + 1},{i % 5},{100 + i}\n" for i in range(20)))
    stream = load_stream(str(path), columns="src=0,dst=1,time=3", features="2")
    assert stream.edge_dim == 1 and stream.events.t[0].item() == 100.0
    assert stream.events.edge_feat[:5, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_feature_columns_do_not_apply_to_jodie(tmp_path: Path) -> None:
    path = write(tmp_path / "j.csv", "user_id,item_id,timestamp,state_label,f\n0,0,1,0,0.5\n")
    with pytest.raises(LoaderError, match=r"j\.csv: LoaderConfig\.features does not apply"):
        load_events(path, features="f")
    batch = load_events(path, "csv", features="4")  # as a plain CSV, by position
    assert batch.edge_feat.tolist() == [[0.5]]
