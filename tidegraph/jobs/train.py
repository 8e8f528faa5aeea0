"""Entry point: `python -m tidegraph.jobs.train [--config CONFIG.yaml] [flags]`.

With no arguments it starts a local Ray (or joins the cluster at `RAY_ADDRESS`) and runs
continuous learning of TGN on the bundled wikipedia stream with 2 graph shards and 2
data-parallel trainers as actors (phase 1 on the first 30%, then 10 increments: evaluate first,
then retrain with uniform replay), printing each increment's AP/AUC/MRR and events/s; metrics
go to the run directory `runs/RUN_NAME/` (`metrics.jsonl`, one JSON line per increment, and
`summary.json`, with the config, the event log and checkpoints).
`--shards P --trainers W` set the split (the same results as P = W = 1 up to float summation
order); `--backend local` runs the same shards and trainers in this process. A YAML file maps
onto `RunConfig` (sections `model`, `data`, `sampler`, `train`, `continual`, `cluster`); flags
override it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from tidegraph.config_check import explicit_fields
from tidegraph.jobs.preflight import conflicts, preflight
from tidegraph.models.config import MODELS
from tidegraph.orchestrator.backend import make_group
from tidegraph.runtime import set_determinism, tune_host_allocator
from tidegraph.training.config import RunConfig, read_config
from tidegraph.training.data import stream_for
from tidegraph.training.offline import run_offline

__all__ = ["main", "parse_config"]

log = logging.getLogger("tidegraph.jobs.train")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tidegraph.jobs.train", description=__doc__)
    p.add_argument("--config", help="YAML file mapped onto RunConfig")
    p.add_argument("--model", help=", ".join(MODELS))
    p.add_argument("--dataset", help="wikipedia, uci (alias collegemsg) or a file path")
    p.add_argument("--format", help="of a file: auto (default), jodie, tgl, snap, csv, parquet")
    p.add_argument("--quarantine", help="write a file's rejected rows here instead of failing")
    p.add_argument(
        "--columns",
        help="of a file: which columns hold the event, as role=column pairs (0-based positions "
        "or header names), e.g. src=0,dst=1,time=3 or src=u,dst=i,time=ts,label=y",
    )
    p.add_argument(
        "--features",
        help="of a file: its edge-feature columns, e.g. 4-175 (positions, inclusive ranges) or "
        "rating,weight (header names) or one Parquet list column",
    )
    p.add_argument(
        "--header",
        action=argparse.BooleanOptionalAction,
        help="of a file: whether line 1 names the columns (default: the format's; "
        "--no-header reads a headerless --format csv file by position)",
    )
    p.add_argument(
        "--string-ids",
        action="store_true",
        default=None,
        help="of a file: node ids are strings (mapped to dense ids; results speak them)",
    )
    p.add_argument("--max-events", type=int, help="use only the first N events")
    p.add_argument("--increments", type=int, help="number of equal-count increments")
    p.add_argument("--replay", help="uniform or importance")
    p.add_argument("--mode", help="continual (default) or offline (70/15/15)")
    p.add_argument("--epochs", type=int, help="phase-1 (or offline) epochs")
    p.add_argument("--eval-protocol", help="sampled (default) or tgb (the Temporal Graph "
                   "Benchmark's hist_rnd negatives and MRR; offline: its split too)")  # fmt: skip
    p.add_argument("--eval-negatives", type=int,
                   help="tgb: negatives a positive (default 999, TGB's tgbl-wiki)")  # fmt: skip
    p.add_argument("--eval-prefix", type=int,
                   help="tgb: score the first N positives of each split or increment "
                   "(0: all)")  # fmt: skip
    p.add_argument("--out", help="the run directory itself (instead of STORAGE/RUN_NAME)")
    p.add_argument("--storage", help="where run directories live: a path or s3://, gs:// URI")
    p.add_argument("--resume", action="store_true", help="continue the run named --run-name")
    p.add_argument("--checkpoint-every", type=int, help="increments between checkpoints")
    p.add_argument("--keep-checkpoints", type=int, metavar="N",
                   help="keep the newest N checkpoints (default 3)")  # fmt: skip
    p.add_argument("--timeline", type=int, nargs="?", const=1, metavar="K",
                   help="record a step timeline (Chrome trace, RUN_DIR/timeline/) of every "
                   "K-th step (default 1: every step)")  # fmt: skip
    p.add_argument(
        "--follow",
        help="a live source: a directory receiving event files (its first file is phase 1, "
        "each later one an increment) or a growing text file that lines are appended to (what "
        "it holds at the start is phase 1, then increments per --follow-lines); --resume "
        "continues after the last increment ingested",
    )
    p.add_argument(
        "--follow-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for new events before finishing (--follow)",
    )
    p.add_argument(
        "--follow-lines",
        type=int,
        default=0,
        help="a followed file's increment: the next N complete lines (the last may be shorter "
        "when the file goes quiet); 0: every complete line there at each poll",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus metrics on 127.0.0.1:PORT (0: a free port; -1: none)",
    )
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu or cuda")
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is fastest on a busy box)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--debug", action="store_true", help="errors with their traceback")
    p.add_argument("--backend", help="ray (actors; a local Ray unless RAY_ADDRESS) or local")
    p.add_argument("--run-name", help="names the run (its Ray namespace)")
    p.add_argument(
        "--trainers", type=_trainers,
        help="data-parallel trainers: W, or MIN:MAX for an elastic group (ray backend)",
    )  # fmt: skip
    p.add_argument(
        "--shards", type=_trainers,
        help="graph shards P, or MIN:MAX shard actors holding P = MAX partitions (ray backend)",
    )  # fmt: skip
    p.add_argument("--memory", help="node state placement: auto, replicated or sharded")
    p.add_argument("--partitioner", help="hash (default) or ldg")
    return p


def _trainers(text: str) -> int | dict:
    """`--trainers W` or `--trainers MIN:MAX` (and `--shards`)."""
    try:
        if ":" in text:
            lo, hi = text.split(":")
            return {"min": int(lo), "max": int(hi)}
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"W or MIN:MAX expected, got {text!r}") from None


def parse_config(argv: list[str] | None = None) -> RunConfig:
    return _config(_parser().parse_args(argv))


def _config(args: argparse.Namespace) -> RunConfig:
    raw = read_config(args.config) if args.config else {}
    from_yaml, overrides = dict(raw), {}  # overrides: dotted field -> the flag that set it
    if not -1 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be -1, 0 or a port number, got {args.metrics_port}")
    sections = {
        k: dict(raw.get(k) or {})
        for k in ("model", "data", "train", "continual", "cluster", "eval")
    }
    for flag, (section, key) in {
        "model": ("model", "name"),
        "dataset": ("data", "dataset"),
        "format": ("data", "format"),
        "quarantine": ("data", "quarantine"),
        "columns": ("data", "columns"),
        "features": ("data", "features"),
        "header": ("data", "header"),
        "string_ids": ("data", "string_ids"),
        "max_events": ("data", "max_events"),
        "increments": ("continual", "num_increments"),
        "replay": ("continual", "replay"),
        "epochs": ("train", "epochs"),
        "backend": ("cluster", "backend"),
        "trainers": ("cluster", "trainers"),
        "shards": ("cluster", "shards"),
        "memory": ("cluster", "memory"),
        "partitioner": ("cluster", "partitioner"),
        "eval_protocol": ("eval", "protocol"),
        "eval_negatives": ("eval", "negatives"),
        "eval_prefix": ("eval", "prefix"),
    }.items():
        if getattr(args, flag) is not None:
            sections[section][key] = getattr(args, flag)
            overrides[f"{section}.{key}"] = "--" + flag.replace("_", "-")
    # the job's own default: a local Ray (or RAY_ADDRESS's) with 2 shards and 2 trainers
    for key, value in (("backend", "ray"), ("shards", 2), ("trainers", 2)):
        sections["cluster"].setdefault(key, value)
    raw.update(sections)
    for flag, key in (
        ("out", "out_dir"),
        ("seed", "seed"),
        ("device", "device"),
        ("threads", "threads"),
        ("run_name", "run_name"),
        ("storage", "storage"),
        ("checkpoint_every", "checkpoint_every"),
        ("keep_checkpoints", "keep_checkpoints"),
        ("timeline", "timeline"),
    ):
        if getattr(args, flag) is not None:
            raw[key] = getattr(args, flag)
            overrides[key] = "--" + flag.replace("_", "-")
    if args.mode:
        raw["mode"] = args.mode
    if args.no_progress:
        raw["progress"] = False
    clash = conflicts(from_yaml, overrides)
    if clash:
        raise ValueError(clash[0])
    args.explicit = explicit_fields(raw)  # what the YAML and flags asked for (--resume checks)
    return RunConfig.from_dict(raw)


_debug = False  # --debug: errors come with their traceback


def _report(err: BaseException) -> None:
    """A data, config or I/O error: one line (and, with --debug, the traceback)."""
    if _debug:
        traceback.print_exception(err, file=sys.stderr)
    print(f"error: {err}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    global _debug
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    tune_host_allocator()
    args = _parser().parse_args(argv)
    _debug = args.debug
    try:
        config = _config(args)
        preflight(config, out=args.out, quarantine=args.quarantine, follow=args.follow)
    except ValueError as err:
        _report(err)
        return 2
    resume = args.resume
    try:
        config, run_dir = _open_run(config, resume, args.out, args.explicit)
    except ValueError as err:  # a run there already, nothing to resume, unwritable storage
        _report(err)
        return 2
    print(f"run {config.run_name}: {run_dir.path}", flush=True)
    set_determinism(config.seed, 0, config.deterministic, config.threads)
    log.info("config: %s", json.dumps(config.to_dict()))
    stream = None
    if not args.follow:  # read before any work starts: a data error ends the job at once
        try:
            # a run's stream is spooled to its directory, a chunk at a time: the driver
            # holds the block under way, never the file (offline runs hold it whole)
            spool = run_dir.spool_uri() if config.mode != "offline" else None
            stream = stream_for(config.data, spool, reuse=resume)
        except ValueError as err:  # LoaderError: file, line or row, reason
            _report(err)
            return 2
    started = False
    if config.cluster.backend == "ray":
        from tidegraph.orchestrator.cluster import connect

        started = connect(config)
    try:
        if config.mode == "offline":
            try:
                result = run_offline(config, stream, make_group)
            except ValueError as err:
                _report(err)
                return 2
            print("\n".join(_offline_lines(result, config.out_dir)))
            return 0
        return _run(config, run_dir, resume, args.metrics_port, args, stream)
    finally:
        if started:
            import ray

            ray.shutdown()


def _open_run(config: RunConfig, resume: bool, out: str | None, explicit=frozenset()):
    """The run directory (fresh, or resumed with its stored config) and the config to run;
    `out` (--out) names the run directory itself."""
    from tidegraph.orchestrator.rundir import RunDir, check_resume_config

    if out is not None:
        out = Path(out).absolute()
        storage, name = str(out.parent), out.name
    else:
        name = config.run_name or time.strftime("run-%Y%m%d-%H%M%S-") + os.urandom(2).hex()
        storage = config.storage
    run_dir = RunDir(storage, name, resume)
    if resume:
        stored = RunConfig.from_dict(run_dir.load_config())
        check_resume_config(stored.to_dict(), config.to_dict(), explicit)
        config = stored
    config.run_name, config.storage = name, storage
    config.out_dir = run_dir.path if run_dir.local else str(Path("runs") / name)
    return config, run_dir


def _live_source(config: RunConfig, args):
    """The followed directory or growing file (the orchestrator takes phase 1 from it, or,
    resuming, puts it back where the checkpoint left it)."""
    from tidegraph.storage.live import open_source

    d = config.data
    if args.follow_lines and Path(args.follow).is_dir():
        raise ValueError(f"--follow-lines applies to a growing file, not to the directory "
                         f"{args.follow}")  # fmt: skip
    return open_source(args.follow, d.format, d.quarantine, args.follow_lines, d.string_ids)


def _run(
    config: RunConfig, run_dir, resume: bool, metrics_port: int = -1, args=None, stream=None
) -> int:
    from tidegraph.orchestrator import Orchestrator, RunState

    source = None
    if args is not None and args.follow:
        try:
            source = _live_source(config, args)
        except ValueError as err:
            _report(err)
            return 2

    metrics = None
    if metrics_port >= 0:
        from tidegraph.orchestrator.metrics import RunMetrics

        try:
            metrics = RunMetrics(metrics_port)
        except OSError as err:
            print(f"error: --metrics-port {metrics_port}: {err}", file=sys.stderr)
            return 2
        print(f"metrics: http://127.0.0.1:{metrics.port}/metrics", flush=True)
    try:
        orchestrator = Orchestrator(
            config, stream, on_record=_print_record, run_dir=run_dir, resume=resume,
            metrics=metrics, source=source,
            follow_timeout=args.follow_timeout if args is not None else 60.0,
        )  # fmt: skip
    except ValueError as err:
        _report(err)
        return 2
    try:
        while orchestrator.step() not in (RunState.FINISHED, RunState.ERRORED):
            pass
    finally:
        orchestrator.close()
        if metrics is not None:
            metrics.close()
    err = orchestrator.error
    if err is not None:
        if isinstance(err, ValueError) or type(err).__name__ == "PlacementTimeout":
            _report(err)  # bad data, or a cluster too small
            return 2
        raise err
    summary = str(Path(config.out_dir) / "summary.json")
    print("\n".join(final_lines(orchestrator.result, run_dir, summary)), flush=True)
    return 0


def final_lines(result: dict, run_dir, summary: str) -> list[str]:
    """The job's last screen: the report's summary lines (at most 25) and where `summary`
    (summary.json) and the HTML report are; for remote storage, the mean figures."""
    from tidegraph.report import ReportError, load_run, summary_lines

    if run_dir.local:
        try:
            lines = summary_lines(load_run(run_dir.path), None)
        except ReportError as err:  # the run's files are its record; the screen is a courtesy
            lines = [f"run {run_dir.run_name}: no summary lines ({err})"]
        else:
            lines = [line for line in lines if not line.startswith("  report: ")]
        return lines + [f"  summary: {summary}",
                        f"  report: python -m tidegraph.jobs.report {run_dir.path} "
                        f"(writes {run_dir.path}/report.html)"]  # fmt: skip
    lines = [f"run {run_dir.run_name} ({run_dir.uri}): {result.get('model', '?')} on "
             f"{result.get('dataset', '?')}; trainers W = {result.get('trainers', '?')}, "
             f"shards P = {result.get('shards', '?')}"]  # fmt: skip
    if "ap" in result:
        lines.append(f"  mean over increments: AP {result['ap']:.4f}  AUC {result['auc']:.4f}"
                     f"  MRR {result['mrr']:.4f}  old AP {result['old_ap']:.4f}")  # fmt: skip
    return lines + [f"  summary: {summary}",
                    "  report: copy the run directory to a local disk, then "
                    "python -m tidegraph.jobs.report DIR"]  # fmt: skip


def _offline_lines(result: dict, out_dir: str | None) -> list[str]:
    """An offline run's last screen: its test figures, time per epoch, where offline.json is."""
    test, val = result["test"], result["val"]
    lines = [f"offline: {result['model']} on {result['dataset']}, {result['events']:,} events, "
             f"{len(result['epochs'])} epochs of {result['epoch_s']:.2f} s (mean)",
             f"  test: AP {test['ap']:.4f}  AUC {test['auc']:.4f}  MRR {test['mrr']:.4f}"
             + _tgb_part(result, test),
             f"  val (last epoch): AP {val['ap']:.4f}  AUC {val['auc']:.4f}  MRR "
             f"{val['mrr']:.4f}" + _tgb_part(result, val)]  # fmt: skip
    if out_dir:
        lines.append(f"  every epoch's figures: {Path(out_dir) / 'offline.json'}")
    return lines


def _tgb_part(result: dict, split: dict) -> str:
    """', Hits@10 ... (TGB protocol, N negatives, P positives)' for a TGB-protocol split."""
    protocol = result.get("protocol")
    if not protocol:
        return ""
    hits = next((k for k in split if k.startswith("hits@")), None)
    figure = f"  {hits.capitalize()} {split[hits]:.4f}" if hits else ""
    return (f"{figure}  (TGB protocol: {protocol['negatives']} negatives a positive, "
            f"{split['positives']:,} positives)")  # fmt: skip


_COLS = ("inc", "events", "AP", "AUC", "MRR", "oldAP", "eval/s", "train/s")


def _print_record(r: dict) -> None:
    if r["phase"] == "phase1":
        print(" ".join(f"{c:>8}" for c in _COLS), flush=True)
        return
    print(
        f"{r['increment'] + 1:>8} {r['events']:>8} {r['ap']:>8.4f} {r['auc']:>8.4f} "
        f"{r['mrr']:>8.4f} {r['old_ap']:>8.4f} {r['eval_events_per_s']:>8.0f} "
        f"{r['train_events_per_s']:>8.0f}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
