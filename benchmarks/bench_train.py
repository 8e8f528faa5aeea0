"""Accuracy and speed of the training loops on a bundled dataset: continual vs offline.

For each model: the continual run (phase 1 on the first 30%, then increments: evaluate first,
retrain with replay) with uniform and with importance-weighted replay, and the offline 70/15/15
run. Printed: AP/AUC/MRR (continual: mean over increments' evaluate-first metrics; offline: the
test split), forgetting (AP when first seen minus AP at the end, mean over increments), old-event
AP after retraining, and events/s. JSON goes to
benchmarks/out/train_<dataset>_<models>_<device>.json.

    python benchmarks/bench_train.py --models tgn tgat --threads 1
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import print_table, write_json  # noqa: E402

from tidegraph.runtime import tune_host_allocator  # noqa: E402
from tidegraph.training import ContinualLearner, RunConfig, load_stream, run_offline  # noqa: E402


def _config(args, model: str, mode: str, replay: str = "uniform") -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": model},
            "train": {"epochs": args.epochs},
            "continual": {"replay": replay, "num_increments": args.increments},
            "mode": mode,
            "device": args.device,
            "seed": args.seed,
            "out_dir": None,
            "progress": False,
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--max-events", type=int, default=None)
    p.add_argument("--models", nargs="+", default=["tgn", "tgat"])
    p.add_argument("--replays", nargs="+", default=["uniform", "importance"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--increments", type=int, default=10)
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    tune_host_allocator()  # as the job does (in bench_vs_pyg: for both systems, one process)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    stream = load_stream(args.dataset, args.max_events)
    rows = []
    for model in args.models:
        for replay in args.replays:
            start = time.perf_counter()
            learner = ContinualLearner(_config(args, model, "continual", replay), stream)
            s = learner.run()
            inc = [r for r in learner.history if r["phase"] == "increment"]
            rows.append(
                {
                    "model": model,
                    "run": f"continual/{replay}",
                    "ap": s["ap"],
                    "auc": s["auc"],
                    "mrr": s["mrr"],
                    "old_ap": s["old_ap"],
                    "forgetting": s["forgetting"],
                    "train_ev_s": sum(r["train_events_per_s"] for r in inc) / len(inc),
                    "eval_ev_s": sum(r["eval_events_per_s"] for r in inc) / len(inc),
                    "wall_s": time.perf_counter() - start,
                }
            )
            print_table(rows[-1:])
        if not args.no_offline:
            start = time.perf_counter()
            out = run_offline(_config(args, model, "offline"), stream)
            n_train = int(0.7 * len(stream.events))
            rows.append(
                {
                    "model": model,
                    "run": "offline 70/15/15",
                    **{k: out["test"][k] for k in ("ap", "auc", "mrr")},
                    "old_ap": float("nan"),
                    "forgetting": float("nan"),
                    "train_ev_s": n_train / out["epoch_s"],
                    "eval_ev_s": float("nan"),
                    "wall_s": time.perf_counter() - start,
                }
            )
            print_table(rows[-1:])
    print(f"\n{stream.name}: {len(stream.events)} events")
    print_table(rows)
    path = write_json(
        f"train_{args.dataset}_{'_'.join(args.models)}_{torch.device(args.device).type}.json",
        {"args": vars(args), "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
