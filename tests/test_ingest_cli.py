"""Data problems reach the job's user as one line `error: FILE: ... reason`, exit code 2, no
traceback; the column map, header and feature flags reach the loaders."""

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidegraph.jobs.train import main, parse_config

sys.path.insert(0, str(Path(__file__).parent))
from test_ingest_misreads import truncated_gzip  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_job(tmp_path: Path, capsys, *argv: str) -> tuple[int, str]:
    code = main([*argv, "--backend", "local", "--out", str(tmp_path / "run"), "--no-progress",
                 "--metrics-port", "-1", "--trainers", "1", "--shards", "1"])  # fmt: skip
    return code, capsys.readouterr().err


def error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def signed(path: Path, n: int = 600) -> Path:
    rng = random.Random(0)
    rows = [f"{rng.randrange(30)},{rng.randrange(30, 60)},{rng.choice((-1, 1))},{1000 + i}"
            for i in range(n)]  # fmt: skip
    path.write_text("\n".join(rows) + "\n")
    return path


def corrupt_parquet(path: Path) -> Path:
    path.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    return path


def nested_parquet(path: Path) -> Path:
    pq.write_table(pa.table({"src": [1, 2], "dst": [2, 3], "time": [{"s": 1}, {"s": 2}]}), path)
    return path


def nan_feature(path: Path) -> Path:
    path.write_text("src,dst,time,w\n1,2,1,0.5\n2,3,2,nan\n")
    return path


# each case: (how to write the bad file, its name, what the error line says)
BAD_FILES = {
    "truncated gzip": (truncated_gzip, "cut.txt.gz", "cannot read the file"),
    "corrupt parquet": (corrupt_parquet, "corrupt.parquet", "cannot read: "),
    "nested parquet": (nested_parquet, "nested.parquet", "time column 'time' has type struct"),
    "ambiguous layout": (signed, "signed.csv", "4 columns and no header"),
    "NaN feature": (nan_feature, "nan.csv", "line 3: NaN feature: nan in column 'w'"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_data_errors_are_one_line_and_exit_code_2(tmp_path: Path, capsys, case: str) -> None:
    write, name, reason = BAD_FILES[case]
    path = write(tmp_path / name)
    extra = ["--features", "w"] if case == "NaN feature" else []
    code, err = run_job(tmp_path, capsys, "--dataset", str(path), *extra)
    assert code == 2
    line = error_line(err)
    assert line.startswith(f"error: {path}: ") and reason in line


def test_quarantine_lets_the_nan_row_go(tmp_path: Path, capsys) -> None:
    path = tmp_path / "e.csv"
    rows = [f"{i % 20},{20 + i % 7},{i},{i % 3}.5" for i in range(400)]
    rows[50] = "1,21,50,nan"
    path.write_text("src,dst,time,w\n" + "\n".join(rows) + "\n")
    q = tmp_path / "q.csv"
    code, _ = run_job(tmp_path, capsys, "--dataset", str(path), "--features", "w",
                      "--quarantine", str(q), "--epochs", "1", "--increments", "2")  # fmt: skip
    assert code == 0
    assert "NaN feature: nan in column 'w'" in q.read_text()


def test_flags_reach_the_data_section() -> None:
    cfg = parse_config(["--dataset", "x.csv", "--format", "csv", "--no-header",
                        "--columns", "src=0,dst=1,time=3", "--features", "2"])  # fmt: skip
    d = cfg.data
    assert (d.format, d.header, d.columns, d.features) == ("csv", False, "src=0,dst=1,time=3", "2")
    assert parse_config(["--header"]).data.header is True
    assert parse_config([]).data.header is None
    with pytest.raises(ValueError, match=r"data\.columns"):
        parse_config(["--columns", "src:0"])


def test_headerless_csv_trains_with_column_and_feature_flags(
    tmp_path: Path, capsys, caplog
) -> None:
    path = signed(tmp_path / "signed.csv")
    with caplog.at_level(logging.INFO):
        code, err = run_job(tmp_path, capsys, "--dataset", str(path), "--format", "csv",
                            "--no-header", "--columns", "src=0,dst=1,time=3", "--features", "2",
                            "--epochs", "1", "--increments", "2")  # fmt: skip
    assert code == 0, err
    assert "edge features: 1 columns from columns at positions [2]" in caplog.text
    stored = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stored["dataset"] == "signed.csv"


def test_bundled_uci_name_runs(tmp_path: Path, capsys) -> None:
    code, err = run_job(tmp_path, capsys, "--dataset", "uci", "--max-events", "400",
                        "--epochs", "1", "--increments", "2")  # fmt: skip
    assert code == 0, err


def test_module_entry_point_reports_a_data_error_without_traceback(tmp_path: Path) -> None:
    path = truncated_gzip(tmp_path / "cut.txt.gz")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "tidegraph.jobs.train", "--dataset", str(path),
         "--backend", "local", "--out", str(tmp_path / "run"), "--metrics-port", "-1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    line = error_line(done.stderr)
    assert line.startswith(f"error: {path}: cannot read the file")


def test_yaml_data_section_names_columns_and_features(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "data:\n  dataset: signed.csv\n  format: csv\n  header: false\n"
        "  columns: {src: 0, dst: 1, time: 3}\n  features: [2]\n"
    )
    d = parse_config(["--config", str(config)]).data
    assert d.columns == {"src": 0, "dst": 1, "time": 3} and d.features == [2]
    assert d.header is False
    assert parse_config(["--config", str(config), "--header"]).data.header is True
