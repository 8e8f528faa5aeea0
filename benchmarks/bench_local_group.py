"""Training rate of the continual learner's `LocalGroup` for P shards and W trainers in one process.

Each measured run builds a fresh TGN learner over the first `--max-events` events of a bundled
dataset with `cluster.shards = P`, `cluster.trainers = W`, ingests phase 1 (the first
`continual.train_fraction`, default 30%) and times one phase-1 training pass (events before
the validation part) through `learner.train_pass`. The baseline ("direct") is what one trainer
does without the group: on a fresh P = W = 1 learner, a plain loop over the same batches that
draws the negatives, calls `trainer.train_slice` and `trainer.apply` on `group.trainers[0]`.
Runs alternate within the process (every configuration once per repetition, the order reversed
on odd repetitions) so load from other processes hits each alike, after `--warmup` untimed
rounds of all of them (first calls build kernels); `set_determinism` starts each run. Printed:
median events/s per configuration, its ratio to the direct trainer's median ("vs_direct"), the
median over repetitions of its rate / the direct trainer's rate in the same repetition
("paired": less sensitive to drift; target for P = W = 1: >= 0.95), and the pass's mean loss
(at P = W = 1 it equals the direct loop's).
JSON goes to benchmarks/out/local_group_<dataset>_<max-events>_<device>.json.

    python benchmarks/bench_local_group.py --dataset collegemsg
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

from tidegraph.runtime import set_determinism, tune_host_allocator  # noqa: E402
from tidegraph.training import ContinualLearner, RunConfig, load_stream  # noqa: E402
from tidegraph.training.schedule import batch_bounds, phase1_bounds  # noqa: E402

GRID = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]  # (shards P, trainers W)
DIRECT = "direct"


def _config(args, shards: int, trainers: int) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": "tgn"},
            "train": {"batch_size": args.batch_size},
            "cluster": {"shards": shards, "trainers": trainers},
            "device": args.device,
            "seed": args.seed,
            "threads": args.threads,
            "out_dir": None,
            "progress": False,
        }
    )


def _learner(args, stream, shards: int, trainers: int) -> tuple[ContinualLearner, int]:
    """A fresh learner with phase 1 ingested; returns it and the end of the training part."""
    set_determinism(args.seed, threads=args.threads)
    learner = ContinualLearner(_config(args, shards, trainers), stream)
    learner.ingest(0, learner.phase1_end)
    return learner, learner.val_start


def run_group(args, stream, shards: int, trainers: int) -> tuple[float, float]:
    """(events/s, mean loss) of `train_pass` over phase 1's training part."""
    learner, end = _learner(args, stream, shards, trainers)
    sync(args.device)
    t0 = time.perf_counter()
    _, loss = learner.train_pass(0, end, "x")
    sync(args.device)
    return end / (time.perf_counter() - t0), loss


def run_direct(args, stream) -> tuple[float, float]:
    """The same pass as one trainer's plain loop, no group: negatives, train_slice, apply."""
    learner, end = _learner(args, stream, 1, 1)
    trainer = learner.group.trainers[0]
    events, negatives, q = learner.events, learner.negatives, learner.train_negatives
    bounds = batch_bounds(0, end, args.batch_size)
    total = 0.0
    sync(args.device)
    t0 = time.perf_counter()
    for lo, hi in bounds:
        ev = events.select(slice(lo, hi))
        neg = negatives.sample(len(ev), q)
        result = trainer.train_slice(ev, None, neg, len(ev), len(ev))
        trainer.apply(result["grad"], [result["updates"]])
        total += result["loss"] * len(ev)
    sync(args.device)
    return end / (time.perf_counter() - t0), total / max(end, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="collegemsg")
    p.add_argument("--max-events", type=int, default=30_000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    tune_host_allocator()  # as the job does
    stream = load_stream(args.dataset, args.max_events)
    runs = [DIRECT, *GRID]
    rates: dict = {r: [] for r in runs}
    losses: dict = {r: [] for r in runs}
    for rep in range(-args.warmup, args.repeats):
        for run in runs if rep % 2 == 0 else runs[::-1]:
            if run == DIRECT:
                rate, loss = run_direct(args, stream)
            else:
                rate, loss = run_group(args, stream, *run)
            if rep < 0:
                continue
            rates[run].append(rate)
            losses[run].append(loss)
            name = run if run == DIRECT else f"P={run[0]} W={run[1]}"
            print(f"rep {rep + 1}: {name:>9}  {rate:,.0f} events/s  loss {loss:.6f}", flush=True)
    base = statistics.median(rates[DIRECT])
    rows = []
    for run in runs:
        shards, trainers = (1, 1) if run == DIRECT else run
        med = statistics.median(rates[run])
        rows.append(
            {
                "dataset": args.dataset,
                "run": "direct trainer" if run == DIRECT else "group",
                "P": shards,
                "W": trainers,
                "median_ev_s": med,
                "min_ev_s": min(rates[run]),
                "max_ev_s": max(rates[run]),
                "vs_direct": med / base,
                "paired": statistics.median(
                    r / d for r, d in zip(rates[run], rates[DIRECT], strict=True)
                ),
                "loss": losses[run][0],
            }
        )
    n_train = phase1_bounds(len(stream.events), _config(args, 1, 1).continual)[0]
    print(
        f"\n{stream.name}: {len(stream.events)} events loaded, phase-1 training pass over "
        f"events 0-{n_train}, TGN, batch {args.batch_size}, {args.threads} thread(s), "
        f"median of {args.repeats}, {machine()}"
    )
    print_table([{**r, "loss": f"{r['loss']:.6f}"} for r in rows])
    device = torch.device(args.device).type
    path = write_json(
        f"local_group_{args.dataset}_{args.max_events or 'all'}_{device}.json",
        {"args": vars(args), "train_events": n_train, "rows": rows, "rates": _listed(rates)},
    )
    print(f"wrote {path}")


def _listed(rates: dict) -> dict:
    return {k if k == DIRECT else f"P{k[0]}_W{k[1]}": v for k, v in rates.items()}


if __name__ == "__main__":
    main()
