"""Insert rate and bytes per stored edge of the dynamic graph store.

    python benchmarks/bench_graph.py                          # CPU: 1k/100k/1M batches to 10M
    python benchmarks/bench_graph.py --device cuda --total 100_000_000
    python benchmarks/bench_graph.py --device pinned --total 1_000_000_000 --batches 1_000_000

Edges come from a power-law stream with increasing times, generated on the target device before
timing. The insert rate counts input events per second (each is stored twice with add_reverse);
the median is over the per-batch rates of the last half of the run, where compaction cost is
at its largest, and the overall rate is total events over total time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import power_law_stream, print_table, sync, write_json

from tidegraph.storage import DynamicGraph


def run(total: int, batch: int, device: str, add_reverse: bool, num_nodes: int) -> dict:
    g = DynamicGraph(device=device, add_reverse=add_reverse)
    # pinned: the stream stays on the host (at 1B edges it would not fit beside the GPU work)
    gen_device = "cpu" if device == "pinned" else g.device
    src, dst, t = power_law_stream(total, num_nodes, device=gen_device)
    rates = []
    sync(g.device)
    start = time.perf_counter()
    for lo in range(0, total, batch):
        hi = min(lo + batch, total)
        t0 = time.perf_counter()
        g.add_edges(src[lo:hi], dst[lo:hi], t[lo:hi])
        sync(g.device)
        rates.append((hi - lo) / (time.perf_counter() - t0))
    elapsed = time.perf_counter() - start
    report = g.memory_report()
    return {
        "device": device,
        "batch": batch,
        "events": total,
        "stored_edges": report["num_stored_edges"],
        "segments": report["segments"],
        "median_events_per_s": statistics.median(rates[len(rates) // 2 :]),
        "overall_events_per_s": total / elapsed,
        "bytes_per_stored_edge": report["bytes_per_stored_edge"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "pinned"])
    p.add_argument("--total", type=lambda s: int(s.replace("_", "")), default=10_000_000)
    p.add_argument("--batches", default="1000,100000,1000000")
    p.add_argument("--nodes", type=int, default=1_000_000)
    p.add_argument("--no-reverse", action="store_true")
    p.add_argument("--out", default=None, help="JSON file name under benchmarks/out/")
    args = p.parse_args()
    rows = [
        run(args.total, int(b.replace("_", "")), args.device, not args.no_reverse, args.nodes)
        for b in args.batches.split(",")
    ]
    print_table(rows)
    path = write_json(args.out or f"graph_{args.device}.json", {"results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
