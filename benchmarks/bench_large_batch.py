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

`--optimizer lamb --lr 2.5e-3 --lr-rule sqrt` is the large-batch method (`train.optimizer:
lamb`): at batch B the rate is lr x sqrt(B / the smallest batch), as `cluster.scale_rule: sqrt`
sets it for W trainers; `--seeds 0 1 2` repeats each run; `--train-negatives Q` trains each
positive against Q negatives (`train.train_negatives`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, write_json  # noqa: E402

from tidegraph.runtime import set_determinism  # noqa: E402
from tidegraph.training import RunConfig  # noqa: E402
from tidegraph.training.offline import run_offline  # noqa: E402
from tidegraph.training.optim import OPTIMIZER_RULES  # noqa: E402

# a variant: a model name and what it sets in `model:` ("+static": model.static_memory)
VARIANTS = {"tgn": {"name": "tgn"}, "tgn+static": {"name": "tgn", "static_memory": True},
            "tgat": {"name": "tgat"}, "jodie": {"name": "jodie"}, "apan": {"name": "apan"},
            "sage": {"name": "sage"}}  # fmt: skip


WIDTHS = (10, 11, 6, 4, 7, 7, 7, 7, 8)  # the table's columns
RULES = {"fixed": lambda r: 1.0, "sqrt": math.sqrt, "linear": lambda r: r}


def one_run(variant: str, dataset: str, batch: int, seed: int, args) -> dict:
    lr = args.lr * RULES[args.lr_rule](batch / min(args.batches))
    cfg = RunConfig.from_dict({
        "model": VARIANTS[variant], "data": {"dataset": dataset, "max_events": args.max_events},
        "train": {"batch_size": batch, "epochs": args.epochs, "lr": lr,
                  "optimizer": args.optimizer, "warmup_steps": args.warmup_steps,
                  "train_negatives": args.train_negatives},
        "mode": "offline", "cluster": {"backend": "local"}, "progress": False,
        "out_dir": None, "threads": 1, "seed": seed,
    })  # fmt: skip
    set_determinism(cfg.seed, threads=1)
    t0 = time.perf_counter()
    out = run_offline(cfg)
    return {"variant": variant, "dataset": dataset, "batch": batch, "seed": seed, "lr": lr,
            "optimizer": args.optimizer, "train_negatives": args.train_negatives,
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
    p.add_argument("--lr", type=float, default=1e-3, help="at the smallest batch")
    p.add_argument("--lr-rule", choices=sorted(RULES), default="fixed",
                   help="the rate at batch B: lr x f(B / the smallest batch)")  # fmt: skip
    p.add_argument("--optimizer", choices=OPTIMIZER_RULES, default="adam")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--train-negatives", type=int, default=1, help="train.train_negatives")
    p.add_argument("--max-events", type=int, default=None)
    args = p.parse_args()
    rows = []
    for dataset in args.datasets:
        for variant in args.variants:
            for batch in args.batches:
                for seed in args.seeds:
                    rows.append(one_run(variant, dataset, batch, seed, args))
                    print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n{machine()}; offline, {args.epochs} epochs, one trainer, 1 thread, "
        f"{args.optimizer}, lr {args.lr} ({args.lr_rule}), {args.train_negatives} training "
        f"negative(s) a positive"
    )
    head = ["dataset", "variant", "batch", "seed", "AP", "MRR", "dAP", "dMRR", "epoch s"]
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, WIDTHS, strict=True)))
    for r in rows:
        key = (r["dataset"], r["variant"], min(args.batches), r["seed"])
        ref = next(x for x in rows if (x["dataset"], x["variant"], x["batch"], x["seed"]) == key)
        r["d_ap"], r["d_mrr"] = r["test_ap"] - ref["test_ap"], r["test_mrr"] - ref["test_mrr"]
        cells = [r["dataset"], r["variant"], r["batch"], r["seed"], f"{r['test_ap']:.4f}",
                 f"{r['test_mrr']:.4f}", f"{r['d_ap']:+.4f}", f"{r['d_mrr']:+.4f}",
                 f"{r['epoch_s']:.1f}"]  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, WIDTHS, strict=True)))
    negatives = f"_q{args.train_negatives}" if args.train_negatives != 1 else ""
    write_json(
        f"large_batch_{'_'.join(args.datasets)}_{args.optimizer}_{args.lr_rule}{negatives}.json",
        {"args": vars(args), "rows": rows},
    )


if __name__ == "__main__":
    main()
