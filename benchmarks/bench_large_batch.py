"""Accuracy at large global batches: test AP and MRR of the offline protocol per batch size.

For each model, dataset and global batch (and each model variant given), one offline run
(`mode: offline`: 70/15/15 split by time, `train.epochs` epochs, one trainer, 1 thread): test
AP, MRR (`train.eval_negatives` random destinations a positive; evaluation batches are the
training batch, as a run at that batch evaluates) and seconds a training epoch, and each
batch's loss against the smallest one. W trainers at a global batch give what one trainer
gives at it (DESIGN.md), so the table is what `cluster.scale_rule: linear` costs at W = batch /
slice trainers.

    python benchmarks/bench_large_batch.py --datasets wikipedia uci --batches 200 800 1600 3200 \\
        --variants tgn tgn+static tgat
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, write_json  # noqa: E402

from tidegraph.runtime import set_determinism  # noqa: E402
from tidegraph.training import RunConfig  # noqa: E402
from tidegraph.training.offline import run_offline  # noqa: E402

# a variant: a model name and what it sets in `model:` ("+static": model.static_memory)
VARIANTS = {"tgn": {"name": "tgn"}, "tgn+static": {"name": "tgn", "static_memory": True},
            "tgat": {"name": "tgat"}, "jodie": {"name": "jodie"}, "apan": {"name": "apan"},
            "sage": {"name": "sage"}}  # fmt: skip


def one_run(variant: str, dataset: str, batch: int, args) -> dict:
    cfg = RunConfig.from_dict({
        "model": VARIANTS[variant], "data": {"dataset": dataset, "max_events": args.max_events},
        "train": {"batch_size": batch, "epochs": args.epochs, "lr": args.lr},
        "mode": "offline", "cluster": {"backend": "local"}, "progress": False,
        "out_dir": None, "threads": 1, "seed": args.seed,
    })  # fmt: skip
    set_determinism(cfg.seed, threads=1)
    t0 = time.perf_counter()
    out = run_offline(cfg)
    return {"variant": variant, "dataset": dataset, "batch": batch,
            "test_ap": out["test"]["ap"], "test_mrr": out["test"]["mrr"],
            "val_ap": out["val"]["ap"], "epoch_s": out["epoch_s"],
            "run_s": time.perf_counter() - t0}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--datasets", nargs="+", default=["wikipedia", "uci"])
    p.add_argument("--batches", nargs="+", type=int, default=[200, 800, 1600, 3200])
    p.add_argument("--variants", nargs="+", default=["tgn", "tgn+static"],
                   choices=sorted(VARIANTS))  # fmt: skip
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-events", type=int, default=None)
    args = p.parse_args()
    rows = []
    for dataset in args.datasets:
        for variant in args.variants:
            for batch in args.batches:
                rows.append(one_run(variant, dataset, batch, args))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{machine()}; offline, {args.epochs} epochs, one trainer, 1 thread")
    print(f"{'dataset':>10} {'variant':>11} {'batch':>6} {'AP':>7} {'MRR':>7} {'dAP':>7} "
          f"{'dMRR':>7} {'epoch s':>8}")  # fmt: skip
    for r in rows:
        key = (r["dataset"], r["variant"], min(args.batches))
        ref = next(x for x in rows if (x["dataset"], x["variant"], x["batch"]) == key)
        r["d_ap"], r["d_mrr"] = r["test_ap"] - ref["test_ap"], r["test_mrr"] - ref["test_mrr"]
        print(
            f"{r['dataset']:>10} {r['variant']:>11} {r['batch']:>6} {r['test_ap']:7.4f} "
            f"{r['test_mrr']:7.4f} {r['d_ap']:+7.4f} {r['d_mrr']:+7.4f} {r['epoch_s']:8.1f}"
        )
    write_json(
        f"large_batch_{'_'.join(args.datasets)}_seed{args.seed}.json",
        {"args": vars(args), "rows": rows},
    )


if __name__ == "__main__":
    main()
