"""Throughput of the event loaders: rows per second on the bundled data and on synthetic files.

    python benchmarks/bench_loaders.py [--rows 2000000] [--json results.json]

Each case streams the whole file once through `open_events` (batches are consumed, not kept),
best of `--repeat` runs. Synthetic files are written to a temporary directory with pyarrow:
a sorted CSV, a gzipped CSV, a CSV whose rows are shuffled within 64 rows (read with sort=True),
a Parquet file, and a JODIE CSV with 172 feature columns (the layout of JODIE Wikipedia/Reddit,
`--wide-rows` rows, features written with 6 decimals). Peak RSS is reported to show that
streaming keeps memory flat.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from tidegraph.data import bundled_path
from tidegraph.storage.ingest import open_events


def synthetic(directory: Path, rows: int) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    t = np.sort(rng.integers(0, 10 * rows, rows))
    table = pa.table(
        {
            "src": rng.integers(0, 100_000, rows),
            "dst": rng.integers(0, 100_000, rows),
            "time": t,
            "label": rng.integers(0, 2, rows),
        }
    )
    paths = {"csv": directory / "sorted.csv", "csv.gz": directory / "sorted.csv.gz"}
    pacsv.write_csv(table, paths["csv"])
    with pa.CompressedOutputStream(str(paths["csv.gz"]), "gzip") as out:
        pacsv.write_csv(table, out)
    jitter = np.arange(rows) + rng.integers(0, 64, rows)
    paths["csv unsorted"] = directory / "unsorted.csv"
    pacsv.write_csv(table.take(np.argsort(jitter, kind="stable")), paths["csv unsorted"])
    paths["parquet"] = directory / "events.parquet"
    pq.write_table(table, paths["parquet"], row_group_size=1 << 20)
    return paths


def jodie_wide(directory: Path, rows: int, width: int = 172) -> Path:
    """A JODIE CSV `user_id,item_id,timestamp,state_label,f1..f<width>`, sorted by time."""
    rng = np.random.default_rng(1)
    columns = {
        "user_id": rng.integers(0, 8_000, rows),
        "item_id": rng.integers(0, 1_000, rows),
        "timestamp": np.sort(rng.integers(0, 10 * rows, rows)).astype(np.float64),
        "state_label": (rng.random(rows) < 0.01).astype(np.int64),
    }
    for j in range(width):
        columns[f"f{j + 1}"] = np.round(rng.standard_normal(rows), 6)
    path = directory / "jodie_wide.csv"
    header = "user_id,item_id,timestamp,state_label,comma_separated_list_of_features\n"
    with pa.OSFile(str(path), "wb") as out:
        out.write(header.encode())
        options = pacsv.WriteOptions(include_header=False)
        pacsv.write_csv(pa.table(columns), out, write_options=options)
    return path


def measure(path: Path, repeat: int, **options) -> dict:
    best, rows = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        reader = open_events(path, **options)
        rows = sum(len(batch) for batch in reader)
        best = min(best, time.perf_counter() - start)
    return {"rows": rows, "seconds": round(best, 4), "rows_per_s": round(rows / best)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--wide-rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = {}
    results["wikipedia (csv.gz)"] = measure(bundled_path("wikipedia"), args.repeat)
    results["uci (snap .gz)"] = measure(bundled_path("uci"), args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        paths = synthetic(Path(tmp), args.rows)
        results["synthetic csv"] = measure(paths["csv"], args.repeat)
        results["synthetic csv.gz"] = measure(paths["csv.gz"], args.repeat)
        results["synthetic csv, sort=True"] = measure(
            paths["csv unsorted"], args.repeat, sort=True, reorder_window=128
        )
        results["synthetic parquet"] = measure(paths["parquet"], args.repeat)
        wide = jodie_wide(Path(tmp), args.wide_rows)
        mib = wide.stat().st_size / 2**20
        results["jodie, 172 features"] = measure(wide, args.repeat) | {"file_mib": round(mib)}
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{'case':<28}{'rows':>12}{'seconds':>10}{'rows/s':>14}{'MiB/s':>8}")
    for name, r in results.items():
        rate = f"{r['file_mib'] / r['seconds']:>8.0f}" if "file_mib" in r else ""
        print(f"{name:<28}{r['rows']:>12,}{r['seconds']:>10.3f}{r['rows_per_s']:>14,}{rate}")
    print(f"peak RSS {peak_mib:.0f} MiB")
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "peak_rss_mib": peak_mib}, indent=2))


if __name__ == "__main__":
    main()
