"""The job streams its file: `--max-events` reads a prefix only, time order comes from a
bounded reorder window (or, asked for, an in-memory sort), and the results are those of the
in-memory path."""

import logging
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
import torch

from tidegraph.jobs.train import main
from tidegraph.storage.ingest import LoaderError
from tidegraph.training.config import RunConfig
from tidegraph.training.continual import ContinualLearner
from tidegraph.training.data import DEFAULT_REORDER_WINDOW, load_stream

ROWS = 3_000_000


def write_csv(path, src, dst, t) -> None:
    table = pa.table({"src": src, "dst": dst, "t": t})
    pacsv.write_csv(table, str(path), pacsv.WriteOptions(quoting_style="none"))


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A sorted CSV of 3M events (about 58 MB)."""
    path = tmp_path_factory.mktemp("big") / "big.csv"
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 1000, ROWS), rng.integers(1000, 2000, ROWS)
    write_csv(path, src, dst, np.arange(ROWS, dtype=np.float64))
    return path


def test_max_events_reads_a_prefix_of_a_sorted_file(big):
    stream = load_stream(str(big), 1000)
    assert len(stream.events) == 1000
    assert stream.events.t.tolist() == [float(i) for i in range(1000)]  # file order
    # the reorder window's rows past the 1000th (a later row may be an earlier event), and
    # the chunks that hold them, never the file
    assert stream.rows_read <= 1000 + DEFAULT_REORDER_WINDOW + 2 * 65_536 < ROWS // 10


def test_the_job_with_max_events_reads_a_prefix(big, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tidegraph.training.data")
    out = str(tmp_path / "run")
    code = main(["--dataset", str(big), "--max-events", "1000", "--increments", "2",
                 "--epochs", "1", "--backend", "local", "--trainers", "1", "--shards", "1",
                 "--no-progress", "--metrics-port", "-1", "--out", out])  # fmt: skip
    assert code == 0
    read = [r for r in caplog.messages if "rows for the first 1000 events" in r]
    assert len(read) == 1, caplog.messages
    rows = int(re.search(r"read (\d+) rows", read[0]).group(1))
    assert rows < ROWS // 10
    assert any("reorder window of 100000 rows" in m for m in caplog.messages)


# the peak resident set of the load alone: imports (torch, pyarrow) peak higher than a small
# load, so the kernel's high-water mark is reset after them (`clear_refs` 5) and read after it
PEAK = """
import sys
from tidegraph.training.data import load_stream
def kb(key):
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith(key))
base = kb("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
stream = load_stream(sys.argv[1], None if sys.argv[2] == "all" else int(sys.argv[2]))
print(base, kb("VmHWM:"), len(stream.events))
"""


def peak_kb(path, max_events: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PEAK, str(path), max_events], check=True,
                         capture_output=True, text=True).stdout.split()  # fmt: skip
    return int(out[1]) - int(out[0]), int(out[2])


@pytest.mark.slow
def test_peak_memory_follows_the_events_read_not_the_file(big):
    prefix, n = peak_kb(big, "1000")
    assert n == 1000
    whole, n = peak_kb(big, "all")
    assert n == ROWS
    assert prefix * 2 < whole  # the whole stream costs more than a prefix (~100 MB here:
    # chunks, the reorder window and pyarrow's pools, which the prefix pays too)


def small_file(path, shuffle: int = 0):
    """1500 events, sorted, or with each block of `shuffle` rows shuffled in place."""
    rng = np.random.default_rng(1)
    n = 1500
    src, dst = rng.integers(0, 80, n), rng.integers(80, 200, n)
    t = np.sort(rng.integers(0, 100_000, n)).astype(np.float64)
    order = np.arange(n)
    if shuffle:
        for lo in range(0, n, shuffle):
            rng.shuffle(order[lo : lo + shuffle])
    write_csv(path, src[order], dst[order], t[order])
    return path


def config(path, window) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"name": "tgn", "dim": 16, "time_dim": 8, "memory_dim": 16},
        "data": {"dataset": str(path), "reorder_window": window},
        "train": {"batch_size": 100, "epochs": 1},
        "continual": {"num_increments": 2, "forget_sample": 50},
        "progress": False,
    })  # fmt: skip


@pytest.mark.parametrize("shuffle", [0, 50])
def test_streamed_results_equal_the_in_memory_sort(tmp_path, shuffle):
    path = small_file(tmp_path / "small.csv", shuffle)
    results = []
    for window in (DEFAULT_REORDER_WINDOW, 64, None):
        learner = ContinualLearner(config(path, window))
        summary = learner.run()
        results.append((learner.events, {k: summary[k] for k in ("ap", "auc", "mrr")}))
    (ev, first), *others = results
    for other_ev, other in others:
        assert torch.equal(ev.src, other_ev.src) and torch.equal(ev.t, other_ev.t)
        assert other == first


def test_a_row_later_than_the_window_is_an_error_naming_it_or_is_quarantined(tmp_path):
    path = tmp_path / "late.csv"
    rows = [f"{i % 7},{10 + i % 5},{float(i)}" for i in range(300)]
    rows.insert(250, "1,12,3.5")  # 247 rows after events with later times
    path.write_text("src,dst,t\n" + "\n".join(rows) + "\n")
    with pytest.raises(LoaderError, match=r"line 252: too late for the reorder window"):
        load_stream(str(path), reorder_window=100)
    bad = tmp_path / "bad.csv"
    stream = load_stream(str(path), reorder_window=100, quarantine=str(bad))
    assert len(stream.events) == 300 and "line" in bad.read_text()
    assert len(load_stream(str(path), reorder_window=None).events) == 301  # sorted in memory
    assert len(load_stream(str(path), reorder_window=300).events) == 301


def test_data_reorder_window_is_checked_and_reaches_the_loader(tmp_path):
    with pytest.raises(ValueError, match="data.reorder_window must be >= 0 or null"):
        config(tmp_path / "x.csv", -1)
    path = small_file(tmp_path / "s.csv", shuffle=10)
    with pytest.raises(LoaderError, match="time decreases"):
        ContinualLearner(config(path, 0))
