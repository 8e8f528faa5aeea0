"""TGB's link-prediction protocol on a bundled dataset (Wikipedia = tgbl-wiki): EdgeBank
(unlimited and time window, the whole test split) and each model offline, seeds apart, with
test MRR and Hits@10, train seconds an epoch and evaluation seconds per 1,000 positives.

    python benchmarks/bench_tgb.py [--dataset wikipedia] [--models tgn tgat ...] [--seeds 0 1 2]
        [--epochs 3] [--negatives 999] [--prefix 2000] [--out benchmarks/out/tgb.json]

Models are scored on the first `--prefix` positives of validation and test (the same for every
model; 0: all), EdgeBank on every positive and on the prefix. One thread, local backend, one
trainer and one shard: the figures are one process's, as the leaderboard's are.

    python benchmarks/bench_tgb.py --continual [--negatives 999] [--prefix 2000] [-- JOB FLAGS]

runs the default job (continual, the default backend) with `--eval-protocol tgb`, and prints
each increment's MRR and Hits@10 (its first `--prefix` positives) beside EdgeBank's on the same
negatives (memory every event before the increment, recorded batch by batch after scoring, as
TGB's EdgeBank runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tidegraph.models.edgebank import EdgeBank  # noqa: E402
from tidegraph.rng import seed_for  # noqa: E402
from tidegraph.training.config import RunConfig  # noqa: E402
from tidegraph.training.continual import ContinualLearner  # noqa: E402
from tidegraph.training.data import load_stream  # noqa: E402
from tidegraph.training.offline import run_offline  # noqa: E402
from tidegraph.training.tgb import HistRndNegatives, edgebank_block, edgebank_tgb  # noqa: E402


def edgebank_rows(stream, args, seed: int) -> list[dict]:
    rows = []
    for mode in ("unlimited", "window"):
        for prefix in (0, args.prefix) if args.prefix else (0,):
            t0 = time.perf_counter()
            r = edgebank_tgb(stream.events, stream.num_nodes, mode, k=args.negatives,
                             seed=seed_for(seed, "tgb negatives"), prefix=prefix)  # fmt: skip
            test, seconds = r["test"], time.perf_counter() - t0
            rows.append({"model": f"edgebank-{mode}", "seed": seed, "prefix": prefix,
                         "test_mrr": test["mrr"], "test_hits@10": test["hits@10"],
                         "val_mrr": r["val"]["mrr"], "seconds": seconds})  # fmt: skip
    return rows


def model_row(stream, args, model: str, seed: int) -> dict:
    config = RunConfig.from_dict({
        "mode": "offline", "seed": seed, "progress": False, "out_dir": None, "threads": 1,
        "model": {"name": model},
        "train": {"epochs": args.epochs},
        "eval": {"protocol": "tgb", "negatives": args.negatives, "prefix": args.prefix},
        "cluster": {"backend": "local", "trainers": 1, "shards": 1},
    })  # fmt: skip
    t0 = time.perf_counter()
    r = run_offline(config, stream)
    test = r["test"]
    return {"model": model, "seed": seed, "prefix": args.prefix, "test_mrr": test["mrr"],
            "test_hits@10": test["hits@10"], "test_ap": test["ap"], "val_mrr": r["val"]["mrr"],
            "epoch_s": r["epoch_s"], "eval_s_per_1k": 1000 * test["eval_s"] / test["positives"],
            "seconds": time.perf_counter() - t0}  # fmt: skip


def continual_rows(args, job_flags: list[str]) -> list[dict]:
    """The default job under TGB's protocol, per increment, beside EdgeBank on its negatives."""
    out = Path(tempfile.mkdtemp(prefix="tgb-continual-"))
    cmd = [sys.executable, "-m", "tidegraph.jobs.train", "--eval-protocol", "tgb",
           "--eval-negatives", str(args.negatives), "--eval-prefix", str(args.prefix),
           "--no-progress", "--out", str(out), *job_flags]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - t0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    increments = [r for r in records if r.get("phase") == "increment"]
    raw = yaml.safe_load((out / "config.yaml").read_text())
    raw["cluster"] = {"backend": "local", "trainers": 1, "shards": 1}
    raw["out_dir"] = None
    config = RunConfig.from_dict(raw)
    learner = ContinualLearner(config)  # the run's stream and increments (nothing trained)
    ev, e = learner.events, config.eval
    banks = {mode: EdgeBank(learner.stream.num_nodes, ev.src[: learner.phase1_end],
                            ev.dst[: learner.phase1_end], ev.t[: learner.phase1_end], mode)
             for mode in ("unlimited", "window")}  # fmt: skip
    rows = []
    for k, (lo, hi) in enumerate(learner.bounds):
        sampler = HistRndNegatives(ev.src[:lo], ev.dst[:lo], int(ev.dst[:hi].min()),
                                   int(ev.dst[:hi].max()), e.negatives, e.hist_ratio,
                                   seed_for(config.seed, "tgb negatives", k + 1))  # fmt: skip
        scored = hi - lo if e.prefix == 0 else min(hi - lo, e.prefix)
        neg, valid = sampler.sample(ev.src[lo:hi], ev.dst[lo:hi], ev.t[lo:hi], rows=scored)
        row = {"increment": k + 1, "events": hi - lo, "positives": scored,
               "mrr": increments[k]["mrr"], "hits@10": increments[k]["hits@10"],
               "ap": increments[k]["ap"]}  # fmt: skip
        for mode, bank in banks.items():
            m = edgebank_block(bank, ev.select(slice(lo, hi)), neg, valid,
                               config.train.batch_size)  # fmt: skip
            row[f"edgebank_{mode}_mrr"] = m["mrr"]
        rows.append(row)
    summary = json.loads((out / "summary.json").read_text())
    rows.append({"increment": "mean", "mrr": summary["mrr"], "hits@10": summary["hits@10"],
                 "ap": summary["ap"], "seconds": seconds, "run": str(out),
                 **{f"edgebank_{m}_mrr": statistics.fmean(r[f"edgebank_{m}_mrr"] for r in rows)
                    for m in banks}})  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--models", nargs="*", default=["tgn", "tgat", "jodie", "apan", "dysat",
                                                    "sage"])  # fmt: skip
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--negatives", type=int, default=999)
    p.add_argument("--prefix", type=int, default=2000)
    p.add_argument("--max-events", type=int)
    p.add_argument("--out", default="benchmarks/out/tgb.json")
    p.add_argument("--continual", action="store_true", help="the default job, per increment")
    p.add_argument("job_flags", nargs="*", help="--continual: flags for the job (after --)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.continual:
        rows = continual_rows(args, args.job_flags)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"\ndefault job, TGB protocol, {args.negatives} negatives, first {args.prefix} "
              f"positives an increment; {rows[-1]['seconds']:.0f} s")  # fmt: skip
        print(f"{'increment':>9} {'MRR':>7} {'Hits@10':>7} {'EB unl.':>7} {'EB win.':>7}")
        for r in rows:
            print(
                f"{r['increment']:>9} {r['mrr']:>7.4f} {r['hits@10']:>7.4f} "
                f"{r['edgebank_unlimited_mrr']:>7.4f} {r['edgebank_window_mrr']:>7.4f}"
            )
        return
    stream = load_stream(args.dataset, args.max_events)
    rows = []
    for seed in args.seeds:
        rows += edgebank_rows(stream, args, seed)
        for model in args.models:
            rows.append(model_row(stream, args, model, seed))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{args.dataset}, TGB protocol, {args.negatives} negatives, seeds {args.seeds}")
    print(f"{'model':>20} {'prefix':>7} {'test MRR':>14} {'Hits@10':>8} {'epoch s':>8} "
          f"{'eval s/1k':>9}")  # fmt: skip
    keys = sorted({(r["model"], r["prefix"]) for r in rows}, key=lambda k: (k[1], k[0]))
    for model, prefix in keys:
        rs = [r for r in rows if r["model"] == model and r["prefix"] == prefix]
        mrr = [r["test_mrr"] for r in rs]
        sd = statistics.stdev(mrr) if len(mrr) > 1 else 0.0
        hits = statistics.fmean(r["test_hits@10"] for r in rs)
        ep = statistics.fmean(r.get("epoch_s", float("nan")) for r in rs)
        ev = statistics.fmean(r.get("eval_s_per_1k", float("nan")) for r in rs)
        print(f"{model:>20} {prefix or 'all':>7} {statistics.fmean(mrr):>8.4f}±{sd:.4f} "
              f"{hits:>8.4f} {ep:>8.2f} {ev:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
