"""Steady-state training step rate (events/s) of models, comparing slot precisions side by side.

For each model, one learner is built over the first `--events` events of a bundled dataset, all
of them ingested; it trains on the first `--warmup` events, then runs `--reps` timed passes of
`--span` events for each slot precision in turn (fp32, then the others, alternating the order
per repetition so that load from other processes hits each alike). Node state is reset before
each pass so each precision sees the same stream. Printed: best and median events/s per model
and precision; JSON goes to benchmarks/out/step_<dataset>_<device>.json.

    python benchmarks/bench_step.py --models tgn tgat --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import machine, print_table, sync, write_json  # noqa: E402

from tidegraph.models.layers import TemporalAttention  # noqa: E402
from tidegraph.runtime import tune_host_allocator  # noqa: E402
from tidegraph.training import ContinualLearner, RunConfig, load_stream  # noqa: E402


def _set_precision(model: torch.nn.Module, precision: str) -> None:
    for module in model.modules():
        if isinstance(module, TemporalAttention):
            module.slot_precision = precision


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--models", nargs="+", default=["tgn", "tgat"])
    p.add_argument("--precisions", nargs="+", default=["fp32", "auto"])
    p.add_argument("--events", type=int, default=70_000)
    p.add_argument("--warmup", type=int, default=20_000)
    p.add_argument("--span", type=int, default=10_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.warmup + args.span > args.events:
        p.error("--warmup + --span must not exceed --events")
    tune_host_allocator()
    if args.threads:
        torch.set_num_threads(args.threads)
    stream = load_stream(args.dataset, args.events)
    rows = []
    for name in args.models:
        cfg = RunConfig.from_dict(
            {
                "model": {"name": name},
                "train": {"batch_size": args.batch_size, "lr": 1e-4},
                "device": args.device,
                "out_dir": None,
                "progress": False,
            }
        )
        learner = ContinualLearner(cfg, stream)
        learner.ingest(0, len(stream.events))
        learner.model.reset_state()
        learner.train_pass(0, args.warmup, "warm-up")
        rates = {prec: [] for prec in args.precisions}
        for rep in range(args.reps):
            order = args.precisions if rep % 2 == 0 else args.precisions[::-1]
            for prec in order:
                _set_precision(learner.model, prec)
                learner.model.reset_state()
                learner.train_pass(0, args.warmup, "state")  # same node state for every pass
                sync(args.device)
                t0 = time.perf_counter()
                learner.train_pass(args.warmup, args.warmup + args.span, "timed")
                sync(args.device)
                rates[prec].append(args.span / (time.perf_counter() - t0))
        base = max(rates[args.precisions[0]])
        for prec, r in rates.items():
            rows.append(
                {
                    "model": name,
                    "slot_precision": prec,
                    "best_ev_s": max(r),
                    "median_ev_s": statistics.median(r),
                    "vs_first": max(r) / base,
                }
            )
    print(f"\n{stream.name}: events {args.warmup}-{args.warmup + args.span}, {machine()}")
    print_table(rows)
    path = write_json(
        f"step_{args.dataset}_{torch.device(args.device).type}.json",
        {
            "args": vars(args),
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
