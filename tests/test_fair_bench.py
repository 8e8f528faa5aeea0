"""bench_vs_pyg names its JSON after a bundled dataset or a file's stem, never a path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vs_pyg  # noqa: E402


@pytest.mark.parametrize(
    ("dataset", "part"),
    [
        ("wikipedia", "wikipedia"),
        ("collegemsg", "collegemsg"),
        ("/data/snap/email-Eu-core-temporal.txt", "email-Eu-core-temporal"),
        ("../CollegeMsg.txt.gz", "CollegeMsg"),
        ("runs/a b/events.csv", "events"),
        ("C:\\data\\x y.csv", "C_data_x_y"),
    ],
)
def test_json_name_part_has_no_directories(dataset, part, tmp_path):
    got = bench_vs_pyg._file_part(dataset)
    assert got == part
    (tmp_path / f"vs_pyg_{got}_cpu.json").write_text("{}")  # a valid file name
