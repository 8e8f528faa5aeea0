"""Sampling throughput of the temporal sampler against the machine's random-gather bound.

    python benchmarks/bench_sampler.py                         # CPU, 1M-edge graph
    python benchmarks/bench_sampler.py --edges 1_000_000,100_000_000 --device cuda

Graphs: power-law degrees, timestamps increasing, built in 1M-edge batches. A batch is 600
consecutive events from the second half of the stream: roots are their sources, destinations
and one random negative each (1,800 roots) at the events' times. Configurations as in TGN
(recent, [10]), TGAT (uniform, [10, 10]) and DySAT (uniform, [10, 10], 3 snapshots), plus TGN
at 60,000 roots per batch, and TGAT with `dedup` (hop 2 over distinct (node, time) roots, as
training samples by default: fewer edges per batch for the same events). "sampled edges"
counts valid slots over all hops (and snapshots). The random-gather rate (int64 elements per
second read at random positions of an array as large as the graph's neighbour array, with
`index_select`, the fastest gather on the CPU) is measured in the same run: every sampled edge
needs at least one such read, so it bounds the sampler.
"""

from __future__ import annotations

import argparse

import torch
from common import power_law_stream, print_table, sync, timed, write_json

from tidegraph.sampling import TemporalSampler
from tidegraph.storage import DynamicGraph

CONFIGS = {
    "TGN": {"fanouts": [10], "strategy": "recent", "events": 600},
    "TGAT": {"fanouts": [10, 10], "strategy": "uniform", "events": 600},
    "DySAT": {"fanouts": [10, 10], "strategy": "uniform", "events": 600, "num_snapshots": 3},
    "TGN-60k": {"fanouts": [10], "strategy": "recent", "events": 20_000},
    # second hop over distinct (node, time) roots only (as training samples by default)
    "TGAT+dedup": {"fanouts": [10, 10], "strategy": "uniform", "events": 600, "dedup": True},
}


def build(num_edges: int, device: str) -> tuple[DynamicGraph, torch.Tensor, torch.Tensor]:
    gen_device = "cuda" if device == "pinned" else device
    src, dst, t = power_law_stream(num_edges, max(num_edges // 10, 1000), device=gen_device)
    g = DynamicGraph(device=device)
    step = 1_000_000
    for lo in range(0, num_edges, step):
        g.add_edges(src[lo : lo + step], dst[lo : lo + step], t[lo : lo + step])
    return g, torch.stack([src, dst]), t


def make_batches(events: torch.Tensor, t: torch.Tensor, size: int, count: int, num_nodes: int):
    gen = torch.Generator(device=t.device).manual_seed(1)
    n = t.shape[0]
    starts = torch.randint(n // 2, n - size, (count,), generator=gen, device=t.device).tolist()
    batches = []
    for s in starts:
        src, dst = events[:, s : s + size]
        neg = torch.randint(0, num_nodes, (size,), generator=gen, device=t.device)
        ts = t[s : s + size]
        batches.append((torch.cat([src, dst, neg]), ts.repeat(3)))
    return batches


def count_edges(out) -> torch.Tensor:
    blocks = [b for group in out for b in group] if isinstance(out[0], list) else out
    return sum(b.mask.sum() for b in blocks)


def bench_config(g, events, t, name: str, cfg: dict, iters: int) -> dict:
    cfg = dict(cfg)
    size = cfg.pop("events")
    window = float(t[-1] - t[0]) / 20
    sampler = TemporalSampler(
        g, snapshot_window=window if "num_snapshots" in cfg else 0.0, seed=0, **cfg
    )
    batches = make_batches(events, t, size, iters, g.num_nodes)
    for roots, ts in batches[:3]:  # warm-up
        sampler.sample(roots, ts)
    totals = []

    def loop():
        for roots, ts in batches:
            totals.append(count_edges(sampler.sample(roots, ts)))

    seconds = timed(loop, t.device)
    sampled = int(sum(x.item() for x in totals))
    return {
        "config": name,
        "roots": 3 * size,
        "batches_per_s": iters / seconds,
        "ms_per_batch": 1000 * seconds / iters,
        "sampled_edges_per_s": sampled / seconds,
        "edges_per_batch": sampled / iters,
    }


def gather_rate(n: int, device: torch.device) -> float:
    """Random int64 element reads per second from an n-element array."""
    table = torch.arange(n, device=device)
    idx = torch.randint(0, n, (min(n, 50_000_000),), device=device)
    table.index_select(0, idx).sum()
    sync(device)
    reps = 5
    seconds = timed(lambda: [table.index_select(0, idx) for _ in range(reps)], device)
    return reps * idx.numel() / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "pinned"])
    p.add_argument("--edges", default="1_000_000")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for num_edges in (int(x.replace("_", "")) for x in args.edges.split(",")):
        g, events, t = build(num_edges, args.device)
        bound = gather_rate(g.num_stored_edges, t.device)
        for name in args.configs.split(","):
            row = bench_config(g, events, t, name, CONFIGS[name], args.iters)
            row = {"graph_edges": num_edges, **row}
            row["fraction_of_gather_bound"] = row["sampled_edges_per_s"] / bound
            rows.append(row)
        print(f"graph {num_edges:,} edges: random gather {bound:,.0f} elements/s")
        del g, events, t
    print_table(rows)
    print(f"wrote {write_json(f'sampler_{args.device}.json', {'results': rows})}")


if __name__ == "__main__":
    main()
