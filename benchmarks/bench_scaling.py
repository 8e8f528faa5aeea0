"""Events/s trained on Ray for W trainers and P shards, against the single-process learner.

For each configuration a fresh learner ingests phase 1 of the stream, trains an untimed warm-up
pass, then one timed training pass over phase 1's training events (TGN, batch 200). Trainer
actors run one torch thread each; the single-process baselines run with 1 and 2 threads.
Per configuration it reports events/s and the per-step time split, averaged over trainers:
sample (hop requests to shards, merge), fetch (features, node state), compute (forward and
backward), all-reduce, optimizer, apply (node-state updates of every slice), and the rest of
the wall time (driver routing and negatives, Ray task dispatch and object transfer, waiting).

    python benchmarks/bench_scaling.py --dataset wikipedia --max-events 60000

With `--w-scan 1,2,4,8,16` it measures, per trainer, the optimizer and the apply of a step at
each W (local backend, the batch kept and grown with W; see `w_scan`).

With `--slices 25,50,100,200,400` it measures instead one trainer (P = W = 1, 1 thread) on the
local and the Ray backend at each of those batches, a trainer's slice at W = 200 / slice
trainers: events/s and the rate against the slice of 200 (a step's fixed cost shows as the
small slices' loss of rate), rounds interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on loopback

from common import machine, write_json  # noqa: E402

from tidegraph.orchestrator import make_group  # noqa: E402
from tidegraph.runtime import set_determinism  # noqa: E402
from tidegraph.timeline import timeline_meta, trace_document  # noqa: E402
from tidegraph.training import ContinualLearner, RunConfig, load_stream  # noqa: E402
from tidegraph.training.offline import train_pass
from tidegraph.training.schedule import phase1_bounds  # noqa: E402

PHASES = ("sample", "fetch", "compute", "allreduce", "optimizer", "apply", "exchange")
CONFIGS = [("local", 1, 1, 1), ("local", 1, 1, 2), ("ray", 1, 1, 1), ("ray", 2, 1, 1),
           ("ray", 1, 2, 1), ("ray", 2, 2, 1), ("ray", 2, 4, 1)]  # fmt: skip


def config(
    args, backend: str, shards: int, trainers: int, threads: int, batch: int | None = None
) -> RunConfig:
    tolerance = None if args.rebalance_tolerance == "none" else float(args.rebalance_tolerance)
    return RunConfig.from_dict({
        "model": {"name": "tgn"},
        "data": {"dataset": args.dataset, "max_events": args.max_events},
        "train": {"batch_size": batch or args.batch_size},
        "cluster": {"backend": backend, "shards": shards, "trainers": trainers,
                    "rebalance_tolerance": tolerance},
        "progress": False, "out_dir": None, "threads": threads, "run_name": "bench-scaling",
        "timeline": args.timeline, "comm": {"compression": args.compression,
                                            "overlap": args.overlap},
    })  # fmt: skip


def timed_pass(cfg: RunConfig, stream, warmup: int, counters=None) -> dict:
    """A fresh learner of `cfg` ingests phase 1 of `stream`, trains an untimed warm-up pass
    over its first `warmup` training events (at most half), then one timed pass over the
    rest. `counters()`, read right before and after the timed pass (a link's byte counts),
    gives `before` and `after`. Returns those, wall_s, events, steps, the trainers' seconds
    per phase, sampled edges per step, the timed pass's trace and its `timeline_meta`."""
    set_determinism(cfg.seed, threads=cfg.threads)
    learner = ContinualLearner(cfg, stream, make_group)
    try:
        val_start, end = phase1_bounds(len(stream.events), cfg.continual)
        learner.ingest(0, end)
        if cfg.comm.compression != "none":  # past the fp32 steps and the codec's first use
            warmup = max(warmup, (cfg.comm.warmup_steps + 5) * cfg.train.batch_size)
        warm = min(warmup, val_start // 2)
        train_pass(learner, 0, warm, "warm-up")
        learner.group.take_seconds()
        learner.group.take_step_edges()
        learner.group.take_trace()  # the warm-up's spans
        before = counters() if counters else None
        t0 = time.perf_counter()
        train_pass(learner, warm, val_start, "timed")
        wall = time.perf_counter() - t0
        after = counters() if counters else None
        g = learner.group
        return {"wall_s": wall, "events": val_start - warm,
                "steps": -(-(val_start - warm) // cfg.train.batch_size),
                "seconds": g.take_seconds(), "edges": g.take_step_edges(),
                "trace": g.take_trace(), "meta": timeline_meta(cfg, g),
                "before": before, "after": after}  # fmt: skip
    finally:
        learner.group.shutdown()


def measure(args, stream, backend, shards, trainers, threads, repeat=0, batch=None) -> dict:
    cfg = config(args, backend, shards, trainers, threads, batch)
    run = timed_pass(cfg, stream, args.warmup)
    wall, steps, seconds, meta = run["wall_s"], run["steps"], run["seconds"], run["meta"]
    split = {p: statistics.mean(s.get(p, 0.0) for s in seconds) / steps * 1e3 for p in PHASES}
    split["other"] = wall / steps * 1e3 - sum(split.values())
    # per step, the busiest trainer's sampled edges over the mean (1.0: balanced)
    skew = statistics.mean(max(e) / statistics.mean(e) for e in zip(*run["edges"], strict=True))
    if args.timeline:  # the timed pass's timeline, with what was measured beside it
        meta.update(events=run["events"], wall_s=wall, events_per_s=run["events"] / wall,
                    steps=steps, machine=machine())  # fmt: skip
        name = f"trace_{backend}_P{shards}_W{trainers}_t{threads}_{args.compression}"
        name += "_overlap" if args.overlap else ""
        batch = cfg.train.batch_size
        name += f"_b{batch}" if batch != 200 else ""  # a --batch-size run beside the default
        write_json(f"{name}{f'_r{repeat}' if args.repeats > 1 else ''}.json",
                   trace_document(run["trace"], meta))  # fmt: skip
    return {"events_per_s": run["events"] / wall, "ms_per_step": split, "steps": steps,
            "edge_skew": skew}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--max-events", type=int, default=60000)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cpus", type=int, default=6, help="the local Ray's CPUs")
    p.add_argument("--timeline", type=int, default=0,
                   help="record every K-th step's timeline (0: off); each configuration's "
                   "trace goes to trace_*.json, for jobs/whatif.py")  # fmt: skip
    p.add_argument("--compression", default="none")
    p.add_argument("--overlap", action="store_true")
    p.add_argument(
        "--rebalance-tolerance",
        default="0.1",
        help="cluster.rebalance_tolerance ('none': always even slices)",
    )
    p.add_argument(
        "--configs",
        default=None,
        help="only these, e.g. local:1:1:2,ray:1:2:1 (backend:P:W:threads)",
    )
    p.add_argument(
        "--slices",
        default=None,
        help="one trainer at these batches instead, e.g. 25,50,100,200,400",
    )
    p.add_argument(
        "--w-scan",
        default=None,
        help="per trainer, the optimizer and the apply of a step at these W instead, e.g. "
        "1,2,4,8,16 (local backend: one process, no core shared among trainers)",
    )
    args = p.parse_args()
    if args.w_scan:
        w_scan(args, load_stream(args.dataset, args.max_events),
               [int(w) for w in args.w_scan.split(",")])  # fmt: skip
        return
    import ray

    ray.init(_node_ip_address="127.0.0.1", num_cpus=args.cpus, include_dashboard=False,
             configure_logging=False)  # fmt: skip
    stream = load_stream(args.dataset, args.max_events)
    if args.slices:
        slice_rates(args, stream, [int(b) for b in args.slices.split(",")])
        ray.shutdown()
        return
    configs = CONFIGS
    if args.configs:
        parse = lambda c: (c[0], int(c[1]), int(c[2]), int(c[3]))  # noqa: E731
        configs = [parse(c.split(":")) for c in args.configs.split(",")]
    for base in (("local", 1, 1, 1), ("local", 1, 1, 2)):
        if base not in configs:
            configs.insert(0, base)
    rows = {c: [] for c in configs}
    for i in range(args.repeats):  # round robin, so drift on the box touches every config
        for c in configs:
            rows[c].append(measure(args, stream, *c, repeat=i))
    ray.shutdown()
    base1 = statistics.median(r["events_per_s"] for r in rows[("local", 1, 1, 1)])
    base2 = statistics.median(r["events_per_s"] for r in rows[("local", 1, 1, 2)])
    print(f"{machine()}; {args.dataset} {args.max_events} events, TGN, batch {args.batch_size}")
    head = ["backend", "P", "W", "thr", "ev/s", "x 1-thr", "x 2-thr", *PHASES, "other", "skew"]
    print(" ".join(f"{h:>9}" for h in head))
    out = []
    for c, runs in rows.items():
        best = max(runs, key=lambda r: r["events_per_s"])
        rate = statistics.median(r["events_per_s"] for r in runs)
        ms = best["ms_per_step"]
        cells = [c[0], c[1], c[2], c[3], f"{rate:.0f}", f"{rate / base1:.2f}",
                 f"{rate / base2:.2f}", *(f"{ms[k]:.2f}" for k in (*PHASES, "other")),
                 f"{best['edge_skew']:.3f}"]  # fmt: skip
        print(" ".join(f"{x:>9}" for x in cells))
        out.append({"backend": c[0], "shards": c[1], "trainers": c[2], "threads": c[3],
                    "events_per_s": rate, "vs_1_thread": rate / base1,
                    "vs_2_threads": rate / base2, "ms_per_step": ms,
                    "edge_skew": best["edge_skew"]})  # fmt: skip
    name = f"scaling_{args.dataset}_{args.max_events}_rebalance-{args.rebalance_tolerance}.json"
    write_json(name, {"args": vars(args), "rows": out})


def slice_rates(args, stream, batches: list[int]) -> None:
    """One trainer's events/s at each batch in `batches`, local and Ray (1 thread)."""
    rows = {(b, n): [] for b in ("local", "ray") for n in batches}
    for i in range(args.repeats):
        for backend, n in rows:
            rows[backend, n].append(measure(args, stream, backend, 1, 1, 1, i, batch=n))
    print(f"{machine()}; {args.dataset} {args.max_events} events, TGN, one trainer, 1 thread")
    head = ["backend", "slice", "ev/s", "x slice200", "ms/step", *PHASES, "other"]
    print(" ".join(f"{h:>10}" for h in head))
    out = []
    for (backend, n), runs in rows.items():
        rate = statistics.median(r["events_per_s"] for r in runs)
        ref = rows.get((backend, 200))
        ref = statistics.median(r["events_per_s"] for r in ref) if ref else float("nan")
        ms = min(runs, key=lambda r: sum(r["ms_per_step"].values()))["ms_per_step"]
        cells = [backend, n, f"{rate:.0f}", f"{rate / ref:.2f}", f"{sum(ms.values()):.2f}",
                 *(f"{ms[k]:.2f}" for k in (*PHASES, "other"))]  # fmt: skip
        print(" ".join(f"{x:>10}" for x in cells))
        out.append({"backend": backend, "slice": n, "events_per_s": rate,
                    "rates": [r["events_per_s"] for r in runs], "vs_slice_200": rate / ref,
                    "ms_per_step": ms})  # fmt: skip
    write_json(f"slices_{args.dataset}_{args.max_events}.json", {"args": vars(args), "rows": out})


def w_scan(args, stream, worlds: list[int]) -> None:
    """What a trainer pays a step for the optimizer and for applying every slice's
    node-state updates, at each W of `worlds`, the global batch kept (`--batch-size`) and
    grown with W (a slice of half of it a trainer): the local backend runs W trainers in one
    process one after another, so no trainer waits for a peer on its core, and the per-
    trainer seconds are what W costs a trainer with a core of its own. (The "apply" here is
    the trainer's "apply" phase: taking its own updates and applying every slice's; the
    what-if counts the first in compute and the second between steps.)"""
    print(f"{machine()}; {args.dataset} {args.max_events} events, TGN, local backend")
    print(" ".join(f"{h:>10}" for h in ("W", "rule", "batch", "optimizer", "apply", "sum")))
    out = []
    half = max(args.batch_size // 2, 1)
    for world in worlds:
        for rule, batch in (("keep", args.batch_size), ("linear", half * world)):
            runs = [measure(args, stream, "local", 1, world, 1, i, batch=batch)["ms_per_step"]
                    for i in range(args.repeats)]  # fmt: skip
            opt = statistics.median(r["optimizer"] for r in runs)
            apply = statistics.median(r["apply"] for r in runs)
            cells = [world, rule, batch, f"{opt:.3f}", f"{apply:.3f}", f"{opt + apply:.3f}"]
            print(" ".join(f"{x:>10}" for x in cells), flush=True)
            out.append({"trainers": world, "rule": rule, "global_batch": batch,
                        "optimizer_ms": opt, "apply_ms": apply})  # fmt: skip
    write_json(f"w_scan_{args.dataset}_{args.max_events}.json", {"args": vars(args), "rows": out})


if __name__ == "__main__":
    main()
