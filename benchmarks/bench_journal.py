"""The cost of the shard journal (issue 13): with node state on the shards (`cluster.memory:
sharded`) and no replica, the driver keeps a driver-owned copy of every step's node-state
updates (and the order of ingests, resets, loads) so that a lost shard can be rebuilt from
its checkpoint snapshot. Measured: training events/s of the same run with the journal on and
off (`RayGroup._journaling` forced false), in alternating order, median per setting.

    python benchmarks/bench_journal.py [--events 20000] [--pairs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from tidegraph.orchestrator import make_group  # noqa: E402
from tidegraph.orchestrator.cluster import connect  # noqa: E402
from tidegraph.orchestrator.ray_group import RayGroup  # noqa: E402
from tidegraph.runtime import set_determinism  # noqa: E402
from tidegraph.training import ContinualLearner, RunConfig, load_stream  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402


def config(events: int) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"name": "tgn"},
        "data": {"dataset": "wikipedia", "max_events": events},
        "train": {"batch_size": 200},
        "continual": {"num_increments": 4},
        "cluster": {"backend": "ray", "trainers": 2, "shards": 2, "memory": "sharded"},
        "progress": False, "out_dir": None, "seed": 0, "run_name": "bench-journal",
    })  # fmt: skip


def one_run(stream, events: int, journal: bool) -> dict:
    original = RayGroup._journaling
    if not journal:
        RayGroup._journaling = property(lambda self: False)
    try:
        set_determinism(0, threads=1)
        learner = ContinualLearner(config(events), stream, make_group)
        try:
            t0 = time.perf_counter()
            learner.run_phase1()
            while not learner.done:
                learner.step()
            wall = time.perf_counter() - t0
            rates = [r["train_events_per_s"] for r in learner.history
                     if r.get("phase") == "increment" and "train_events_per_s" in r]  # fmt: skip
            kept = len(learner.group._journal)
        finally:
            learner.group.shutdown()
    finally:
        RayGroup._journaling = original
    return {"journal": journal, "wall_s": wall, "train_ev_s": statistics.median(rates),
            "journal_entries": kept, "load": os.getloadavg()[0]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--events", type=int, default=20000)
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args()
    stream = load_stream("wikipedia", args.events)
    connect(config(args.events))
    runs = []
    try:
        for i in range(args.pairs):
            for journal in (True, False) if i % 2 == 0 else (False, True):
                runs.append(one_run(stream, args.events, journal))
                print(json.dumps(runs[-1]))
    finally:
        ray.shutdown()
    on = statistics.median(r["train_ev_s"] for r in runs if r["journal"])
    off = statistics.median(r["train_ev_s"] for r in runs if not r["journal"])
    print(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                      "events": args.events, "train_ev_s_journal": on,
                      "train_ev_s_no_journal": off, "overhead": 1 - on / off}))  # fmt: skip


if __name__ == "__main__":
    main()
