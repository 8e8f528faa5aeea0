"""Hit rate and fetch time of the feature cache, replaying the sampler's id streams.

    python benchmarks/bench_cache.py                  # CPU: hit rates + CPU lookup times
    python benchmarks/bench_cache.py --quick          # a smaller run (fewer replays)
    python benchmarks/bench_cache.py --device cuda    # on the GPU machine: also GPU fetch time

Streams: the bundled Wikipedia data (157,474 events) and a 10M-edge synthetic power-law stream
(`common.power_law_stream`, 1M nodes). `PLANS` says how many of the last batches of each stream
are replayed (the earlier events are inserted in bulk first) and how many of those are warm-up,
not counted: by default Wikipedia TGN whole, the rest in part so that a CPU run stays near five
minutes; `--full` replays more (for the GPU machine). Where the cache is not full at the end of
the replay (column `fill`), the hit rate measures short-range reuse only.

For each batch of 600 events in time order: roots are the sources, destinations and one random
negative destination each, at the events' times; the sampler (TGN: recent [10]; TGAT: uniform
[10, 10]) runs; the valid sampled eids go to the edge cache (and, for TGN, the roots plus the
sampled node ids to the node cache); then the batch is inserted into the graph and its edge
rows appended to the store (capacity = ratio * edges so far, so it grows with the stream).

Hit rates count distinct ids per batch (one fetch per distinct missing id), cold start included
where there is no warm-up. They do not depend on the feature width, so the hit-rate replays use
1-wide rows; `edge_MB_per_batch` scales the bytes moved to 172 fp32 values per row. Fetch times
(Wikipedia, ratio 0.2, the best variant there) use 172-wide rows, fp32 and int8 (Wikipedia has
no edge features in this copy: they are random): a cached batch fetch against fetching every
row of the batch from host memory (pinned on CUDA) and decoding it on the device.

Variants: the five policies; `+write`: rows appended with new events are admitted too (a
trainer receives them with the events, so there they cost no extra transfer; here they are
counted in bytes); `+expiry`: after each batch, edges that a recent-10 sampler can no longer
return (`RecentWindowTracker`) are demoted (TGN only); `static` is re-seeded every `--round`
batches with the most touched ids of the next 3 pre-sampled batches.
"""

from __future__ import annotations

import argparse
import gzip
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from common import power_law_stream, print_table, sync, write_json

from tidegraph.sampling import TemporalSampler
from tidegraph.storage import DynamicGraph
from tidegraph.storage.cache import CachedFeatureStore, RecentWindowTracker
from tidegraph.storage.features import HostFeatureStore, decode, quantization_error

BATCH = 600
RATIOS = (0.05, 0.1, 0.2, 0.5)
CONFIGS = {
    "TGN": {"fanouts": [10], "strategy": "recent"},
    "TGAT": {"fanouts": [10, 10], "strategy": "uniform"},
}
VARIANTS = {  # name: cache options; "+expiry" variants also demote dead edges (recent only)
    "lru": {"policy": "lru"},
    "lfu": {"policy": "lfu"},
    "fifo": {"policy": "fifo"},
    "static": {"policy": "static"},
    "recency": {"policy": "recency"},
    "lru+write": {"policy": "lru", "admit_on_write": True},
    "recency+write": {"policy": "recency", "admit_on_write": True},
    "lfu+expiry": {"policy": "lfu"},
    "lru+write+expiry": {"policy": "lru", "admit_on_write": True},
}
# per mode and dataset, model: (batches replayed, None for all; warm-up batches not counted)
PLANS = {
    "quick": {"wikipedia": {"TGN": (None, 0)}, "synthetic": {"TGN": (100, 50)}},
    "default": {
        "wikipedia": {"TGN": (None, 0), "TGAT": (60, 20)},
        "synthetic": {"TGN": (300, 150), "TGAT": (30, 10)},
    },
    "full": {
        "wikipedia": {"TGN": (None, 0), "TGAT": (None, 0)},
        "synthetic": {"TGN": (3000, 1000), "TGAT": (300, 100)},
    },
}
WIKIPEDIA = Path(__file__).resolve().parents[1] / "tidegraph/data/wikipedia_u_i_ts_label.csv.gz"


@dataclass
class Stream:
    """The ids one replay looks up: per batch, sampled eids and node ids, then what it adds."""

    name: str
    config: str
    prefix_edges: int  # edges in the graph before the first replayed batch
    prefix_nodes: int
    warmup: int  # batches not counted
    eids: list[torch.Tensor] = field(default_factory=list)
    nodes: list[torch.Tensor] = field(default_factory=list)
    num_nodes_after: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    dead: list[torch.Tensor] | None = None  # per batch, eids a recent sampler can not return
    sample_seconds: float = 0.0


# ---- streams ----------------------------------------------------------------------------------


def wikipedia() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with gzip.open(WIKIPEDIA, "rt") as f:
        table = np.loadtxt(f, delimiter=",", skiprows=1)
    src, dst, t = (torch.from_numpy(table[:, i].copy()) for i in range(3))
    return src.long(), dst.long(), t.double()


def record(name, src, dst, t, config: str, batches: int | None, warmup: int, seed: int = 0):
    """Sample the last `batches` batches (None: all) of (src, dst, t) after inserting the rest
    in bulk. Node ids are kept for TGN only (the node-cache replay is run for TGN only)."""
    batches = batches or (src.shape[0] + BATCH - 1) // BATCH
    start = max(0, src.shape[0] - batches * BATCH)
    g = DynamicGraph(device="cpu")
    for lo in range(0, start, 1_000_000):
        hi = min(lo + 1_000_000, start)
        g.add_edges(src[lo:hi], dst[lo:hi], t[lo:hi])
    sampler = TemporalSampler(g, seed=seed, **CONFIGS[config])
    stream = Stream(name, config, start, g.num_nodes, warmup)
    tracker = None
    if CONFIGS[config]["strategy"] == "recent":
        tracker, stream.dead = RecentWindowTracker(max(CONFIGS[config]["fanouts"])), []
        for lo in range(0, start, 1_000_000):
            hi = min(lo + 1_000_000, start)
            tracker.add_edges(src[lo:hi], dst[lo:hi], torch.arange(lo, hi))
    gen = torch.Generator().manual_seed(seed)
    num_nodes = int(max(src.max(), dst.max())) + 1
    clock = time.perf_counter()
    for lo in range(start, src.shape[0], BATCH):
        s, d, ts = src[lo : lo + BATCH], dst[lo : lo + BATCH], t[lo : lo + BATCH]
        neg = torch.randint(0, num_nodes, s.shape, generator=gen)
        roots = torch.cat([s, d, neg])
        blocks = sampler.sample(roots, ts.repeat(3))
        stream.eids.append(torch.cat([b.nbr_eids[b.mask] for b in blocks]))
        if config == "TGN":
            stream.nodes.append(torch.cat([roots] + [b.nbr_ids[b.mask] for b in blocks]))
        g.add_edges(s, d, ts)
        stream.batch_sizes.append(int(s.shape[0]))
        if tracker is not None:
            stream.dead.append(tracker.add_edges(s, d, torch.arange(lo, lo + s.shape[0])))
        stream.num_nodes_after.append(max(g.num_nodes, int(neg.max()) + 1))
    stream.sample_seconds = time.perf_counter() - clock
    return stream


# ---- replays ----------------------------------------------------------------------------------


def make_caches(stream: Stream, variant: dict, ratio: float, dim: int, device: str, **store):
    edges = HostFeatureStore(dim=dim, **store)
    nodes = HostFeatureStore(dim=dim, **store)
    gen = torch.Generator().manual_seed(0)
    edges.append(torch.randn(stream.prefix_edges, dim, generator=gen))
    nodes.append(torch.randn(stream.prefix_nodes, dim, generator=gen))
    kw = {"ratio": ratio, "device": device, "enabled": True, **variant}
    return CachedFeatureStore(edges, **kw), CachedFeatureStore(nodes, **kw)


def replay(stream: Stream, name: str, ratio: float, round_batches: int) -> dict | None:
    """Hit rates of one variant; None for an expiry variant on a stream without expiry."""
    expiry = name.endswith("+expiry")
    if expiry and stream.dead is None:
        return None
    variant = VARIANTS[name]
    edge_cache, node_cache = make_caches(stream, variant, ratio, 1, "cpu")
    caches = [(edge_cache, stream.eids)] + ([(node_cache, stream.nodes)] if stream.nodes else [])
    static = variant["policy"] == "static"
    for i in range(len(stream.eids)):
        for cache, ids in caches:
            if i == stream.warmup:
                cache.reset_stats()
            if static and i % round_batches == 0:
                cache.restore(torch.cat(ids[i : i + 3]))
            cache.get(ids[i])
        _grow(stream, i, edge_cache, node_cache if stream.nodes else None, 1)
        if expiry:
            edge_cache.demote(stream.dead[i])
    e, n = edge_cache.stats(), node_cache.stats()
    counted = len(stream.eids) - stream.warmup
    return {
        "edge_hit": e["hit_rate"],
        "node_hit": n["hit_rate"] if stream.nodes else None,
        "fill": e["size"] / max(e["capacity"], 1),
        "edge_MB_per_batch": e["bytes_h2d"] * 172 / counted / 1e6,  # as if 172 x fp32
        "edge_ms_per_batch": 1000 * e["lookup_seconds"] / counted,
    }


def _grow(stream: Stream, i: int, edge_cache, node_cache, dim: int) -> None:
    """Append the batch's edge rows and rows for nodes first seen in it."""
    edge_cache.append(torch.zeros(stream.batch_sizes[i], dim))
    if node_cache is None:
        return
    first_new = node_cache.num_rows
    if stream.num_nodes_after[i] > first_new:
        new = torch.arange(first_new, stream.num_nodes_after[i])
        node_cache.put(new, torch.zeros(new.shape[0], dim))


# ---- fetch time -------------------------------------------------------------------------------


def fetch_times(stream: Stream, name: str, ratio: float, device: str, precision: str) -> dict:
    """ms per batch: cached edge fetch vs every row from (pinned, on CUDA) host memory."""
    pinned = device == "cuda"
    edge_cache, _ = make_caches(
        stream, VARIANTS[name], ratio, 172, device, precision=precision, pin_memory=pinned
    )
    store = edge_cache.store
    cached_s, direct_s, counted = 0.0, 0.0, 0
    for i, eids in enumerate(stream.eids):
        eids_dev = eids.to(device)
        sync(device)
        a = time.perf_counter()
        out = edge_cache.get(eids_dev)
        sync(device)
        b = time.perf_counter()
        direct = decode(store.fetch(eids).to(device, non_blocking=pinned))
        sync(device)
        c = time.perf_counter()
        if i >= stream.warmup:
            cached_s, direct_s, counted = cached_s + b - a, direct_s + c - b, counted + 1
        if i == stream.warmup:
            assert torch.equal(out, direct)
        edge_cache.append(torch.randn(stream.batch_sizes[i], 172))
        if name.endswith("+expiry") and stream.dead is not None:
            edge_cache.demote(stream.dead[i])
    return {
        "cached_ms": 1000 * cached_s / counted,
        "uncached_ms": 1000 * direct_s / counted,
        "speedup": direct_s / cached_s,
        "hit_rate": edge_cache.stats()["hit_rate"],
    }


# ---- main -------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="TGN only, shorter synthetic replay")
    p.add_argument("--full", action="store_true", help="whole streams (for the GPU machine)")
    p.add_argument("--synthetic-edges", type=int, default=10_000_000)
    p.add_argument("--round", type=int, default=50, help="batches per retraining round")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default); "
                   "1 on a busy machine, where thread barriers dominate small ops")  # fmt: skip
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    plan = PLANS["quick" if args.quick else "full" if args.full else "default"]

    streams = []
    src, dst, t = wikipedia()
    for model, (batches, warmup) in plan["wikipedia"].items():
        streams.append(record("wikipedia", src, dst, t, model, batches, warmup))
    src, dst, t = power_law_stream(args.synthetic_edges, args.synthetic_edges // 10)
    name = f"powerlaw-{args.synthetic_edges / 1e6:g}M"
    for model, (batches, warmup) in plan["synthetic"].items():
        streams.append(record(name, src, dst, t, model, batches, warmup))
    del src, dst, t

    rows = []
    for s in streams:
        ids_per_batch = sum(x.numel() for x in s.eids) / len(s.eids)
        per_batch = 1000 * s.sample_seconds / len(s.eids)
        print(f"{s.name} {s.config}: {len(s.eids)} batches, {ids_per_batch:,.0f} eids/batch, "
              f"sampling {per_batch:.1f} ms/batch", flush=True)  # fmt: skip
        for ratio in RATIOS:
            for v in args.variants.split(","):
                result = replay(s, v, ratio, args.round)
                if result is not None:
                    row = {"stream": s.name, "model": s.config, "ratio": ratio, "policy": v}
                    rows.append({**row, **result})
    print_table(rows)

    timing = []
    for s in streams[: len(plan["wikipedia"])]:  # not synthetic: 172-wide rows of 10M edges
        best = _best(rows, s.name, s.config, 0.2)
        for precision in ("fp32", "int8"):
            t_row = fetch_times(s, best, 0.2, args.device, precision)
            timing.append({"stream": s.name, "model": s.config, "policy": best,
                           "precision": precision, "device": args.device, **t_row})  # fmt: skip
    print_table(timing)
    errors = [
        {"precision": pr, **quantization_error(torch.randn(10_000, 172), pr)}
        for pr in ("fp16", "bf16", "int8")
    ]
    print_table(errors)
    mode = "quick" if args.quick else "full" if args.full else "default"
    payload = {
        "mode": mode,
        "plan": plan,
        "hit_rates": rows,
        "fetch": timing,
        "precision_error": errors,
        "best_policy_wikipedia_tgn_0.2": _best(rows, "wikipedia", "TGN", 0.2),
        "gpu_timing_measured": args.device == "cuda",
        "threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - started,
    }
    path = write_json(f"cache_{args.device}_{mode}.json", payload)
    print(f"wrote {path}")


def _best(rows: list[dict], stream: str, model: str, ratio: float) -> str:
    pick = [r for r in rows if (r["stream"], r["model"], r["ratio"]) == (stream, model, ratio)]
    return max(pick, key=lambda r: r["edge_hit"])["policy"]


if __name__ == "__main__":
    main()
