"""A run's report: what a run directory holds, read and summed up (`python -m
tidegraph.jobs.report`; the page and its figures are `tidegraph.report_page`).

Read from RUN_DIR:
- `metrics.jsonl` (required): the "phase1" record, one "increment" record per increment, and
  before each record what the group did since the last one (`training.records`): records of
  phase "recovery", "resize", "shard_resize", "shard_move" (the markers) and "comm_bits";
- `summary.json` (written at the end of a run: a run still going has none), `config.yaml`;
- `timeline/*.json` when the run was recorded with `--timeline` (`tidegraph.timeline`): each
  trainer's training steps split by phase, the all-reduce's bytes and bits per bucket, and the
  what-if model's bottleneck of the recorded step (`tidegraph.whatif`, ray backend only).

The increment axis: 0 is phase 1, k the k-th increment (as the job prints them). A marker
sits half-way before the record it preceded in metrics.jsonl: it happened after the previous
record was written (during that increment's evaluation or retraining, or at its ingest).

Forgetting is as `ContinualLearner.summary` defines it: per increment, its AP when evaluated
minus the AP on its events at the end of the run (`forgetting_per_increment` in summary.json)
and their mean (`forgetting`); per increment the records give `old_ap`, the AP on a sample
of older events after the increment was learned.

Bad input raises `ReportError` naming the file and the line or field.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tidegraph.timeline import load_trace, trainer_step_spans

__all__ = [
    "MARKERS",
    "SPLIT",
    "Marker",
    "ReportError",
    "Run",
    "bottleneck",
    "load_run",
    "lone_trainers",
    "step_split",
    "summary_lines",
    "traffic",
]

# marker record phases: (name in the report, plural, tag prefix)
MARKERS = {
    "recovery": ("recovery", "recoveries", "R"),
    "resize": ("resize", "resizes", "Z"),
    "shard_resize": ("shard resize", "shard resizes", "S"),
    "shard_move": ("partition move", "partition moves", "M"),
}
# a trainer's phases of a training step, in the order they run; the rest of a step is "other"
SPLIT = ("sample", "fetch", "forward", "updates", "exchange", "backward", "allreduce",
         "optimizer", "apply")  # fmt: skip
# a recorded step this many times a trainer's median step is a stall (`step_split`)
STALL = 5.0
# what an increment record must hold, with numbers
INCREMENT_FIELDS = ("increment", "events", "ap", "auc", "mrr", "old_ap", "eval_events_per_s",
                    "train_events_per_s")  # fmt: skip


class ReportError(ValueError):
    """A run directory the report cannot read: the message names the file, line or field."""


@dataclass
class Marker:
    kind: str  # the record's phase: recovery, resize, shard_resize, shard_move
    tag: str  # R1, Z1, S1, M1: the figure's label, the table's key
    label: str  # a few words: "resize 2->1"
    reason: str  # what happened and why, in words
    record: dict
    x: float = 0.0  # on the increment axis
    during: str = ""  # "phase 1", "increment 3", "after the last record"


@dataclass
class Run:
    path: Path
    name: str
    phase1: dict | None
    increments: list[dict]
    markers: list[Marker]
    comm_bits: list[dict]  # records of phase comm_bits, in order
    summary: dict  # {} without summary.json
    config: dict  # {} without config.yaml
    trace: dict | None  # the merged timeline; None without one
    notes: dict[str, str] = field(default_factory=dict)  # why a part is missing

    @property
    def backend(self) -> str:
        meta = (self.trace or {}).get("otherData", {})
        return meta.get("backend") or self.config.get("cluster", {}).get("backend", "?")

    def count(self, kind: str) -> int:
        return sum(m.kind == kind for m in self.markers)


def load_run(path: str | os.PathLike) -> Run:
    """The run in directory `path` (see the module's docstring); ReportError when it is not
    one or a file is damaged."""
    root = Path(path)
    if not root.is_dir():
        raise ReportError(f"{root}: no such run directory")
    metrics = root / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{metrics}: missing (not a run directory, or the run has not "
                          "finished phase 1)")  # fmt: skip
    run = Run(root, root.name, None, [], [], [], {}, {}, None)
    _read_metrics(run, metrics)
    run.summary = _read_mapping(root / "summary.json")
    run.config = _read_mapping(root / "config.yaml")
    run.trace = _read_trace(root, run.notes)
    return run


def _read_metrics(run: Run, path: Path) -> None:
    by_increment: dict[int, dict] = {}
    pending: list[Marker] = []  # markers before the next phase 1 or increment record
    counts: dict[str, int] = defaultdict(int)
    for i, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}: line {i} is not JSON ({e.msg})") from None
        if not isinstance(r, dict) or not isinstance(r.get("phase"), str):
            raise ReportError(f"{path}: line {i} has no 'phase' field")
        phase = r["phase"]
        if phase == "phase1":
            run.phase1 = r
            _place(pending, 0, "phase 1")
        elif phase == "increment":
            for key in INCREMENT_FIELDS:
                if not isinstance(r.get(key), int | float) or isinstance(r.get(key), bool):
                    raise ReportError(f"{path}: line {i}: increment record has no number "
                                      f"'{key}' (got {r.get(key)!r})")  # fmt: skip
            by_increment[int(r["increment"])] = r  # a resumed run's record made again wins
            _place(pending, r["increment"] + 1, f"increment {r['increment'] + 1}")
        elif phase in MARKERS:
            counts[phase] += 1
            label, reason = _describe(phase, r)
            tag = f"{MARKERS[phase][2]}{counts[phase]}"
            pending.append(Marker(phase, tag, label, reason, r))
            run.markers.append(pending[-1])
        elif phase == "comm_bits":
            run.comm_bits.append(r)
    if run.phase1 is None and not by_increment:
        raise ReportError(f"{path}: no phase1 or increment record (the run has not finished "
                          "phase 1)")  # fmt: skip
    run.increments = [by_increment[k] for k in sorted(by_increment)]
    last = run.increments[-1]["increment"] + 1 if run.increments else 0
    _place(pending, last + 1, "after the last record")


def _place(markers: list[Marker], x: int, during: str) -> None:
    """Put `markers` half-way before axis position `x` (the record they preceded), and empty
    the list."""
    for m in markers:
        m.x, m.during = x - 0.5, during
    markers.clear()


def _describe(phase: str, r: dict) -> tuple[str, str]:
    """(label, reason) of a marker record (shapes: orchestrator.recovering, roster,
    shard_recovery, shard_table, shard_hosts)."""
    secs = f"; {r['seconds']:.2f} s" if isinstance(r.get("seconds"), int | float) else ""
    if phase == "recovery" and "lost" in r:
        more = f", dropped {r['dropped']}" if r.get("dropped") else ""
        shards = f", shards {r['lost_shards']} lost too" if r.get("lost_shards") else ""
        copied = f"trainer {r.get('source')} copied to {r.get('copied_to')}"
        done = f"with {r.get('steps_done')} of the pass's steps done"
        return "recovery", (f"trainer {r['lost']} lost ({r.get('cause', '?')}){shards}; "
                            f"{copied} {done}{more}{secs}")  # fmt: skip
    if phase == "recovery":
        how = (f"replicas promoted for {r['promoted']}" if r.get("promoted") else
               f"rebuilt from {'a snapshot and ' if r.get('snapshot') else ''}"
               f"{r.get('replayed_batches', '?')} logged batches on {r.get('rebuilt_on', '?')} "
               "shard actors")  # fmt: skip
        return "shard recovery", f"shard {r.get('lost_shards')} lost; {how}{secs}"
    if phase == "resize":
        left = [m.get("rank") for m in r.get("left", [])]
        who = (f"; left: ranks {left}" if left else "") + (
            f"; joined: members {r['joined']}" if r.get("joined") else "")  # fmt: skip
        return (f"resize {r.get('from')}->{r.get('to')}",
                f"{r.get('reason', '?')} ({r.get('at', '?')}){who}{secs}")  # fmt: skip
    if phase == "shard_resize":
        return (f"shard actors {r.get('from')}->{r.get('to')}",
                f"{r.get('reason', '?')} ({r.get('moves', 0)} partitions moved, "
                f"{r.get('at', '?')}){secs}")  # fmt: skip
    why = f"{r['reason']}; " if r.get("reason") else ""
    where = f"from node {_node(r.get('from_node'))} to {_node(r.get('to_node'))}"
    return (f"partition {r.get('part')} moved",
            f"{why}partition {r.get('part')} ({r.get('events', '?')} events) {where} "
            f"({r.get('at', '?')}){secs}")  # fmt: skip


def _node(node) -> str:
    """A Ray node id as its log lines show it (its first 12 hex digits)."""
    return str(node)[:12] if node is not None else "?"


def _text(path: Path) -> str:
    """File `path`'s text; ReportError naming it when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ReportError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def _read_mapping(path: Path) -> dict:
    """The mapping in JSON (by its suffix) or YAML file `path`; {} when there is none
    (summary.json: a run still going)."""
    if not path.is_file():
        return {}
    is_json, text = path.suffix == ".json", _text(path)
    try:
        doc = json.loads(text) if is_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ReportError(f"{path}: not {'JSON' if is_json else 'YAML'} ({e})") from None
    if not isinstance(doc, dict):
        raise ReportError(f"{path}: not a mapping")
    return doc


def _read_trace(root: Path, notes: dict) -> dict | None:
    directory = root / "timeline"
    if not directory.is_dir():
        notes["timeline"] = "no timeline/ in the run directory (record one with --timeline K)"
        return None
    try:
        doc = load_trace(str(root))
    except FileNotFoundError as e:
        notes["timeline"] = str(e)
        return None
    # a file that is not JSON (or not UTF-8: a ValueError), not an object, or whose events
    # are not objects with the fields load_trace reads
    except (ValueError, AttributeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ReportError(_bad_trace_file(directory, e)) from None
    if not isinstance(doc.get("otherData"), dict):
        raise ReportError(f"{directory}: the first file's otherData is not an object")
    return doc


def _bad_trace_file(directory: Path, error: Exception) -> str:
    """Which of the timeline's files is not a trace document, and why (`error`: what
    reading them raised, for a damage this does not find)."""
    for p in sorted(directory.glob("*.json")):
        try:
            doc = json.loads(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            return f"{p}: not UTF-8 text (byte {e.start}: {e.reason})"
        except json.JSONDecodeError as e:
            return f"{p}: not JSON ({e.msg}, line {e.lineno})"
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            return f"{p}: no traceEvents list (not a Chrome trace)"
        if not all(isinstance(e, dict) for e in doc["traceEvents"]):
            return f"{p}: a traceEvents entry is not an object"
    return f"{directory}: not a timeline this version writes ({_why(error)})"


def _why(error: Exception) -> str:
    """An exception in words: a KeyError names the missing field."""
    if isinstance(error, KeyError):
        return f"no field {error.args[0]!r}" if error.args else "a field is missing"
    return f"{type(error).__name__}: {error}"


# ---- the timeline ---------------------------------------------------------------------------


def _train_steps(trace: dict) -> dict[str, list[list[dict]]]:
    """Trainer track name -> its recorded training steps in time order, each a list of spans
    (a trainer replaced after a loss: a new process under the same name, steps kept apart by
    pid)."""
    steps: dict = defaultdict(lambda: defaultdict(list))
    for name, e in trainer_step_spans(trace):
        steps[name][(e["pid"], e["args"].get("step"))].append(e)
    return {name: sorted(by.values(), key=lambda spans: min(e["ts"] for e in spans))
            for name, by in sorted(steps.items())}  # fmt: skip


def step_split(trace: dict) -> dict[str, dict[str, float]]:
    """Trainer track -> mean milliseconds per phase of its recorded training steps (`SPLIT`,
    plus "other": the rest of the step's wall span, from its first span's start to its last
    span's end), "steps" (how many) and "stalled" (how many were left out).

    A stalled step, one whose wall span exceeds `STALL` times the trainer's median step, is
    left out of the mean: it waited for a lost peer (a recovery), for a member starting, or
    paid a one-off cost (allocations, a kernel compile), and one such step in a few dozen
    would otherwise make the mean step's split that of the stall."""
    out = {}
    for name, steps in _train_steps(trace).items():
        rows = []
        for spans in steps:
            wall = max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)
            row = {k: sum(e["dur"] for e in spans if e["name"] == k) / 1e3 for k in SPLIT}
            row["other"] = max(wall / 1e3 - sum(row.values()), 0.0)
            rows.append((wall / 1e3, row))
        typical = statistics.median(wall for wall, _ in rows)
        kept = [row for wall, row in rows if wall <= STALL * typical]
        mean = {k: statistics.fmean(r[k] for r in kept) for k in (*SPLIT, "other")}
        out[name] = {**mean, "steps": len(kept), "stalled": len(rows) - len(kept)}
    return out


def _allreduce_spans(steps: list[list[dict]]) -> list[dict]:
    """A trainer's recorded all-reduce spans with bytes (the ray backend's), in step order."""
    return [e for s in steps for e in s if e["name"] == "allreduce" and "bytes" in e["args"]]


def _with_peers(span: dict) -> bool:
    return span["args"].get("world", 2) > 1


def lone_trainers(trace: dict) -> bool:
    """Whether trainers recorded all-reduce spans, but none in a step with peers: a W = 1
    run (a lone trainer sends nothing)."""
    spans = [e for steps in _train_steps(trace).values() for e in _allreduce_spans(steps)]
    return bool(spans) and not any(map(_with_peers, spans))


def traffic(trace: dict) -> dict[str, dict]:
    """Trainer track -> its all-reduce per recorded training step: mean "bytes" sent and
    "bytes_fp32" (what fp32 would send) over the steps it had peers in, "bits" (each recorded
    step's bits per bucket; [] for a step of a lone trainer, which sends nothing) and "steps"
    (their numbers), "alone" (how many such steps), and "bucket_bytes" (mean bytes per bucket
    index over the steps with peers: recorded per bucket with `comm.overlap` only). A trainer
    with no recorded step with peers is left out: empty when no trainer recorded an
    all-reduce with bytes (the local backend sums gradients in the driver) or every one was
    alone (`lone_trainers`)."""
    out = {}
    for name, steps in _train_steps(trace).items():
        spans = _allreduce_spans(steps)
        peers = [e for e in spans if _with_peers(e)]
        if not peers:
            continue
        sent = {(e["pid"], e["args"].get("step")) for e in peers}
        buckets: dict[int, list[float]] = defaultdict(list)
        for e in trace["traceEvents"]:
            a = e.get("args", {})
            if e.get("name") == "allreduce bucket" and (e.get("pid"), a.get("step")) in sent:
                buckets[a.get("bucket", 0)].append(a.get("bytes", 0))
        out[name] = {
            "bytes": _mean(e["args"]["bytes"] for e in peers),
            "bytes_fp32": _mean(e["args"].get("bytes_fp32", 0) for e in peers),
            "bits": [list(e["args"].get("bits", [])) if e in peers else [] for e in spans],
            "steps": [e["args"].get("step", i) for i, e in enumerate(spans)],
            "alone": len(spans) - len(peers),
            "bucket_bytes": {b: statistics.fmean(v) for b, v in sorted(buckets.items())},
        }
    return out


def bottleneck(run: Run) -> tuple[str, list[tuple[str, float]]]:
    """(a line naming the recorded step's bottleneck, the critical path's spans in ms) by the
    what-if model at the recorded group size; the path is empty, and the line says why, when
    the run has no timeline of the ray backend's training steps."""
    if run.trace is None:
        return f"not known: {run.notes.get('timeline', 'no timeline')}", []
    if run.backend != "ray":
        return (f"not known: the what-if model reads trainers' steps of the ray backend; this "
                f"timeline is of the {run.backend} backend"), []  # fmt: skip
    from tidegraph.whatif import Setting, predict, profile

    try:
        prof = profile(run.trace)
        pred = predict(prof, Setting(trainers=prof.world))
    except ValueError as e:
        return f"not known: the timeline has no usable training steps ({e})", []
    except (KeyError, TypeError, ZeroDivisionError) as e:  # spans without the args it reads
        return (f"not known: the what-if model cannot read the timeline's training steps "
                f"({_why(e)})"), []  # fmt: skip
    if not prof.period_ms > 0 or not pred.step_ms > 0:  # NaN too
        got = f"step period {prof.period_ms:.2f} ms, modelled step {pred.step_ms:.2f} ms"
        return f"not known: the what-if model read no usable step from the timeline ({got})", []
    ms = dict(pred.path).get(pred.bottleneck, 0.0)
    return (f"{pred.bottleneck}: {ms:.2f} ms of a {pred.step_ms:.2f} ms step at W = "
            f"{prof.world} (what-if model; recorded {prof.period_ms:.2f} ms a step, "
            f"{prof.events_per_s:,.0f} events/s)"), list(pred.path)  # fmt: skip


# ---- the one-screen summary -----------------------------------------------------------------


def _mean(values) -> float:
    values = [v for v in values if isinstance(v, int | float) and not math.isnan(v)]
    return statistics.fmean(values) if values else float("nan")


def summary_lines(run: Run, html: str | None, bottleneck_line: str | None = None) -> list[str]:
    """The report in at most 25 lines; `html`: where the page went (None: not written)."""
    s, cfg, inc = run.summary, run.config, run.increments
    p1 = run.phase1 or {}
    model = s.get("model") or cfg.get("model", {}).get("name", "?")
    dataset = s.get("dataset") or cfg.get("data", {}).get("dataset", "?")
    w, p = s.get("trainers", p1.get("trainers", "?")), s.get("shards", p1.get("shards", "?"))
    lines = [f"run {run.name} ({run.path})",
             f"  {model} on {dataset}; trainers W = {w}, shards P = {p} (at the end), "
             f"{run.backend} backend; {len(inc)} increments"]  # fmt: skip
    if p1:
        lines.append(
            f"  phase 1: {p1.get('train_events', '?')} events, val AP "
            f"{p1.get('val_ap', float('nan')):.4f}, "
            f"{p1.get('train_events_per_s', float('nan')):,.0f} train events/s"
        )
    if inc:
        last = inc[-1]
        lines += [
            f"  final (increment {last['increment'] + 1}): AP {last['ap']:.4f}  AUC "
            f"{last['auc']:.4f}  MRR {last['mrr']:.4f}  old AP {last['old_ap']:.4f}",
            f"  mean over increments: AP {_mean(r['ap'] for r in inc):.4f}  AUC "
            f"{_mean(r['auc'] for r in inc):.4f}  MRR {_mean(r['mrr'] for r in inc):.4f}",
            *_tgb_lines(cfg, inc),
            f"  forgetting: {_forgetting(s)}",
            f"  events/s: train {_mean(r['train_events_per_s'] for r in inc):,.0f}, eval "
            f"{_mean(r['eval_events_per_s'] for r in inc):,.0f} (mean over increments)",
        ]  # fmt: skip
    lines += _timeline_lines(run)
    lines.append(f"  feature cache: {_cache_line(inc)}")
    line = bottleneck_line if bottleneck_line is not None else bottleneck(run)[0]
    lines.append(f"  bottleneck: {line}")
    counts = ", ".join(f"{run.count(kind)} {one if run.count(kind) == 1 else many}"
                       for kind, (one, many, _) in MARKERS.items())  # fmt: skip
    lines.append(f"  events: {counts}")
    lines.append(f"  report: {html}" if html else "  report: no HTML written")
    return lines


def _cache_line(inc: list[dict]) -> str:
    rows = [r for r in inc if "edge_cache_hit_rate" in r]
    if not rows:
        return "none in this run"
    if not any(r.get("edge_cache_capacity", 1) for r in rows):
        return "a pass-through (capacity 0: it caches on CUDA)"
    return f"hit rate {rows[-1]['edge_cache_hit_rate']:.3f} (cumulative, end of run)"


def _tgb_lines(cfg: dict, inc: list[dict]) -> list[str]:
    """Under TGB's protocol: what the MRR above is, and Hits@k (last and mean)."""
    e = cfg.get("eval") or {}
    if e.get("protocol") != "tgb":
        return []
    hits = f"hits@{e.get('hits_k', 10)}"
    return [f"  MRR by TGB's protocol: {e.get('negatives', '?')} hist_rnd negatives a positive, "
            f"{_mean(r.get('positives') for r in inc):,.0f} positives an increment (mean); "
            f"{hits.capitalize()} {inc[-1].get(hits, float('nan')):.4f} final, "
            f"{_mean(r.get(hits) for r in inc):.4f} mean"]  # fmt: skip


def _forgetting(summary: dict) -> str:
    f = summary.get("forgetting")
    if not isinstance(f, int | float):
        return "not known (no summary.json: the run has not ended)"
    line = f"{f:.4f} (mean AP when evaluated minus AP at the end, summary.json)"
    worst = most_forgotten(summary)
    if worst is not None:
        line += f"; most: increment {worst['increment'] + 1}, {worst['drop']:+.4f}"
    return line


def most_forgotten(summary: dict) -> dict | None:
    """The entry of `forgetting_per_increment` with the largest drop (a NaN drop, of an
    increment with no AP, ranks last); None when the summary lists none."""
    per = summary.get("forgetting_per_increment") or []
    if not per:
        return None
    return max(per, key=lambda f: float("-inf") if math.isnan(f["drop"]) else f["drop"])


def _timeline_lines(run: Run) -> list[str]:
    if run.trace is None:
        return [f"  step split: {run.notes.get('timeline', 'no timeline')}"]
    split = step_split(run.trace)
    if not split:
        return ["  step split: the timeline holds no trainer's training step"]
    mean = {k: _mean(row[k] for row in split.values()) for k in (*SPLIT, "other")}
    total = sum(mean.values()) or 1.0
    top = sorted(mean.items(), key=lambda kv: -kv[1])[:3]
    out = [f"  step ({sum(mean.values()):.2f} ms, mean of {len(split)} trainers): "
           + ", ".join(f"{k} {v:.2f} ms ({v / total:.0%})" for k, v in top)]  # fmt: skip
    sent = traffic(run.trace)
    if sent:
        b = _mean(t["bytes"] for t in sent.values())
        f = _mean(t["bytes_fp32"] for t in sent.values())
        bits = next((x for x in reversed(next(iter(sent.values()))["bits"]) if x), "?")
        out.append(f"  all-reduce: {b / 1e6:.3f} MB sent a step per trainer (fp32 "
                   f"{f / 1e6:.3f} MB), bits per bucket at the end {bits}")  # fmt: skip
    elif lone_trainers(run.trace):
        out.append("  all-reduce: none (a lone trainer)")
    return out
