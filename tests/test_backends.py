"""Every option of the job's command line and of the run config, on both backends.

Each option runs on `local` (shards and trainers in this process) and on `ray` (actors), both
with P = 2 shards, W = 2 trainers and the same seed, and the two runs are held to the same
assertions against each other: parameters, node state, every metric of every record and the
summary, bitwise (with two trainers gloo adds the two slice gradients once, as the local sum
does, and both backends run the same cores, sampler draws and gradient reducer). Where the
group's size may change during the run (elastic `{min, max}`: Ray may place the second
trainer only after the run started), both runs are in float64 (tests/numerics.py) and, when
the group did change, held to 1e-9: summation order shows at 1e-15, a semantic error at 1e-2.
Where a backend has something to show for an option (a replica, a spare, a recovery, the
update log, in-place sampling), it is checked as well; and the slow matrix checks that each
option takes effect: its run differs from the run without it (a value silently ignored on both
backends would pass the comparison), or, for options that must not change a result
(placement, redundancy, codecs, bookkeeping), equals it bitwise.

The slow matrix runs one option (or flag) at a time; the default suite covers every option in a
few combined runs (independent options together) with the same assertions, and a test checks
that every config field and flag is in both. Options of the command line alone (`--mode
offline`, `--dataset FILE --features`, `--quarantine`, `--string-ids`, `--follow`, `--resume`,
...) run through `main()` in this process, on the module's Ray (for `ray`, without `--backend`:
the job's default). An option no backend can run on this machine (`--device cuda` without
CUDA) is refused before any actor starts, with exit code 2 and one line.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
import yaml

from tidegraph.config_check import explicit_fields
from tidegraph.jobs.train import _config, _parser, main
from tidegraph.orchestrator import Orchestrator, RunState
from tidegraph.orchestrator.rundir import RunDir
from tidegraph.recovery.updatelog import logged_steps
from tidegraph.runtime import set_determinism
from tidegraph.storage.checkpoint import CheckpointStore, chunks_of
from tidegraph.storage.live import DirectorySource, GrowingFileSource
from tidegraph.timeline import load_trace, validate
from tidegraph.training import RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
from numerics import float64_everywhere, rel  # noqa: E402
from runstate import final_state  # noqa: E402

BACKENDS = ("local", "ray")
EVENTS = 1000  # of wikipedia: phase 1 of 600 (about 6 steps of 100), then 2 increments of 200
BASE = {
    "model": {"name": "tgn", "dim": 16, "time_dim": 8, "memory_dim": 16, "slot_precision": "fp32"},
    "data": {"dataset": "wikipedia", "max_events": EVENTS},
    "train": {"batch_size": 100, "epochs": 1, "eval_negatives": 3},
    "continual": {"num_increments": 2, "forget_sample": 100, "train_fraction": 0.6},
    "cluster": {"shards": 2, "trainers": 2},
    "seed": 7,
    "progress": False,
}
# compression from the first step and for every bucket (the test models' gradients are a few
# KB: under the defaults, warm-up and min_bucket_bytes would send all of them exact)
EAGER_Q = {"warmup_steps": 0, "min_bucket_bytes": 0}
# what backends may differ in: wall times; how many gradient buckets left during backward
# (`comm.overlap`: the local backend reduces after its trainers' backward passes; same bits);
# how many batch cuts the slice balancer made (Ray cuts the rest of a pass again after a
# recovery, counting those steps twice; the same cuts)
MECHANISM = ("_per_s", "_seconds", "_s", "buckets_sent_in_backward", "rebalanced")


# ---- data files ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Files of wikipedia's first events in every format the loaders read (`@name` in a
    case's config stands for the path of file `name`)."""
    d = tmp_path_factory.mktemp("data")
    ev = load_stream("wikipedia", EVENTS).events
    rows = list(zip(ev.src.tolist(), ev.dst.tolist(), ev.t.tolist(), strict=True))
    feats = [(math.sin(t / 5000 + u), math.cos(v), (i % 11) / 10)
             for i, (u, v, t) in enumerate(rows)]  # fmt: skip
    with_feats = list(zip(rows, feats, strict=True))
    out = {}

    def text(name: str, lines: list[str]) -> None:
        (d / name).write_text("".join(f"{x}\n" for x in lines))
        out[name] = str(d / name)

    text(
        "features.csv",
        ["src,dst,time,label,a,b,c"]
        + [f"{u},{v},{t!r},0,{a:.6g},{b:.6g},{c:.6g}" for (u, v, t), (a, b, c) in with_feats],
    )
    # a signed network's layout (Bitcoin-Alpha): src, dst, rating, time; no header
    text("headerless.csv", [f"{u},{v},{(7 * u + v) % 21 - 10},{int(t)}" for u, v, t in rows])
    text("strings.csv", ["src,dst,time"] + [f"user-{u},page {v},{t!r}" for u, v, t in rows])
    bad = [f"{u},{v},{t!r}" for u, v, t in rows]
    bad[100], bad[400], bad[700] = "1,2,soon", "3,4", "x,5,9.0"  # three bad rows
    text("bad.csv", ["src,dst,time"] + bad)
    # string ids, named feature columns and three bad rows, for the job's flags together
    mixed = [
        f"user-{u},page {v},{t!r},0,{a:.6g},{b:.6g},{c:.6g}" for (u, v, t), (a, b, c) in with_feats
    ]
    mixed[100], mixed[400], mixed[700] = "u,p,soon,0,1,2,3", "u,p", "u,p,9.0,0,x,2,3"
    text("mixed.csv", ["src,dst,time,label,a,b,c"] + mixed)
    first_item = min(v for _, v, _ in rows)
    text(
        "jodie.csv",
        ["user_id,item_id,timestamp,state_label,f0"]
        + [f"{u},{v - first_item},{t!r},0,{a:.6g}" for (u, v, t), (a, _, _) in with_feats],
    )
    text("snap.txt", [f"{u} {v} {int(t)}" for u, v, t in rows])
    # rows out of time order within blocks of 8: a reorder window of 10 sorts them
    shuffled = [rows[i ^ 5] if (i ^ 5) < len(rows) else rows[i] for i in range(len(rows))]
    text("unsorted.csv", ["src,dst,time"] + [f"{u},{v},{t!r}" for u, v, t in shuffled])
    tgl = d / "tgl"  # a TGL directory: edges.csv and its rows' features in edge_features.pt
    tgl.mkdir()
    (tgl / "edges.csv").write_text(
        "".join(f"{x}\n" for x in ["src,dst,time"] + [f"{u},{v},{t!r}" for u, v, t in rows])
    )
    torch.save(
        torch.tensor(feats, dtype=torch.float32)[:, :2].contiguous(), tgl / "edge_features.pt"
    )
    out["tgl"] = str(tgl)
    columns = {
        "src": [r[0] for r in rows],
        "dst": [r[1] for r in rows],
        "time": [r[2] for r in rows],
        "w": [f[0] for f in feats],
    }
    pq.write_table(pa.table(columns), d / "events.parquet")
    out["events.parquet"] = str(d / "events.parquet")
    out["quarantine.csv"] = str(d / "quarantine.csv")  # written by the runs that name it
    return out


def resolved(raw, files: dict[str, str]):
    """`raw` with every `@name` string replaced by the path of data file `name`."""
    if isinstance(raw, dict):
        return {k: resolved(v, files) for k, v in raw.items()}
    if isinstance(raw, list):
        return [resolved(v, files) for v in raw]
    if isinstance(raw, str) and raw.startswith("@"):
        return files[raw[1:]]
    return raw


def merged(*layers: dict) -> dict:
    """BASE-like dicts merged section by section (later layers win)."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **value}
            else:
                out[key] = copy.deepcopy(value)
    return out


# ---- one run, in this process, and what is compared ---------------------------------------------


@dataclass
class Outcome:
    params: dict  # trainer 0's model state: parameters, and node state where replicas hold it
    node: list  # node state: replica 0's, or every shard's, flattened
    records: list  # metrics.jsonl's records, wall times left out
    summary: dict  # summary.json, wall times left out
    state: dict  # the final checkpoint's group state: every shard and every trainer
    seen: dict = field(default_factory=dict)  # what the case's check observed


def untimed(x):
    """`x` without the entries of its records that say how, not what (wall times, buckets
    sent during backward)."""
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items() if not str(k).endswith(MECHANISM)}
    if isinstance(x, list):
        return [untimed(v) for v in x]
    return x


def flat(x) -> list:
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in flat(x[k])]
    if isinstance(x, list | tuple):
        return [t for v in x for t in flat(v)]
    return [torch.as_tensor(x)] if x is not None else []


def group_state(state: dict) -> dict:
    """The parts of a group's state both backends keep: partitioner, feature rounding, slice
    balancer, every partition's shard state, every trainer's state."""
    keys = ("memory_placement", "partitioner", "feature_gen", "balancer", "shards", "trainers")
    return untimed({k: state[k] for k in keys})


_runs = itertools.count()


def run(config: dict, backend: str, storage: Path, check=None) -> Outcome:
    """The run `config` describes on `backend` as the job makes it (an orchestrator with a run
    directory), stepped here; `check(backend, group, run_path)` sees the group before it is
    released and returns what it observed."""
    raw = merged(config, {"cluster": {"backend": backend}})
    raw["run_name"] = name = f"opt-{next(_runs)}-{backend}"
    raw["storage"], raw["out_dir"] = str(storage), str(storage / name)
    cfg = RunConfig.from_dict(raw)
    threads = torch.get_num_threads()
    set_determinism(cfg.seed, 0, cfg.deterministic, cfg.threads)  # as the job's entry point
    orchestrator = Orchestrator(cfg, run_dir=RunDir(str(storage), name))
    try:
        while orchestrator.step() not in (RunState.FINISHED, RunState.ERRORED):
            pass
        if orchestrator.error is not None:
            raise orchestrator.error
        group = orchestrator.learner.group
        seen = check(backend, group, storage / name) if check else {}
        out = Outcome(group.model_state(), flat(group.node_state()), records(storage / name),
                      untimed(orchestrator.result), group_state(group.state_dict()),
                      seen or {})  # fmt: skip
    finally:
        orchestrator.close()
        set_determinism(7, 0, True, threads)
    return out


MEMBERSHIP = ("resize", "recovery", "shard_move", "shard_resize")  # what the group went through


def records(path: Path, membership: bool = False) -> list[dict]:
    """metrics.jsonl's records without wall times: the run's (increments, phase 1, bits per
    bucket), or with `membership` the group's changes (resizes, recoveries: Ray's alone)."""
    rows = [untimed(json.loads(x)) for x in (path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if (r["phase"] in MEMBERSHIP) == membership]


def first_difference(a, b, where: str = "") -> str | None:
    """Where two nested structures of tensors, numbers and strings differ (None: nowhere;
    floats and tensors compared bitwise, NaNs equal to NaNs)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return f"{where}: tensor vs {type(b if torch.is_tensor(a) else a).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        return None if torch.equal(a, b) or _nan_equal(a, b) else f"{where}: values differ"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))} on one side only"
        for k in a:
            found = first_difference(a[k], b[k], f"{where}.{k}")
            if found:
                return found
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_floating_point():
        return False
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


def assert_same(a: Outcome, b: Outcome, label, bound: float = 0.0) -> None:
    """`a` and `b` are the same run: bitwise (bound 0), or parameters and node state within
    `bound` (relative) and every metric within 1e-3 with the records' other fields equal but
    the group's size (it changed in one of them)."""
    if bound == 0.0:
        for name in ("params", "node", "records", "summary", "state"):
            found = first_difference(getattr(a, name), getattr(b, name), name)
            assert found is None, (label, found)
        return
    assert a.params.keys() == b.params.keys(), label
    for key, x in a.params.items():
        if x.is_floating_point():
            assert rel(x, b.params[key]) < bound, (label, key, rel(x, b.params[key]))
        else:
            assert torch.equal(x, b.params[key]), (label, key)
    assert len(a.node) == len(b.node), label
    for i, (x, y) in enumerate(zip(a.node, b.node, strict=True)):
        assert (rel(x, y) < bound) if x.is_floating_point() else torch.equal(x, y), (label, i)
    assert_close_records(a.records, b.records, label)


def assert_close_records(a: list[dict], b: list[dict], label) -> None:
    """Every metric within 1e-3, the records' other fields equal but the group's size."""
    assert len(a) == len(b), label
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys(), label
        for k, v in x.items():
            close = abs(v - y[k]) < 1e-3 if isinstance(v, float) else v == y[k] or k == "trainers"
            assert close, (label, k, v, y[k])


def same_result(a: Outcome, b: Outcome) -> bool:
    """Whether two runs trained the same model: parameters, node state and every metric
    bitwise (their records may differ in bookkeeping: partition statistics, placement)."""
    keys = ("loss", "ap", "auc", "mrr", "old_ap", "val_ap", "val_auc", "val_mrr")

    def metrics(run: Outcome) -> list:
        rows = [r for r in run.records if r["phase"] in ("phase1", "increment")]
        return [[r.get(k) for k in keys] for r in rows]

    return (first_difference(a.params, b.params) is None
            and first_difference(a.node, b.node) is None and metrics(a) == metrics(b))  # fmt: skip


# ---- what a backend shows of an option ----------------------------------------------------------


def on_ray(look: Callable) -> Callable:
    """A check of something only the Ray backend has (actors, placement, recovery)."""
    return lambda backend, group, path: look(group, path) if backend == "ray" else {}


def on_both(look: Callable) -> Callable:
    return lambda backend, group, path: look(group, path)


def _replicas(group, path) -> dict:
    """Each partition has a read-only replica that took every event its shard took."""
    assert [len(r) for r in group.replicas] == [1, 1]
    held = ray.get([s.report.remote() for s in group.shards])
    copies = ray.get([r[0].report.remote() for r in group.replicas])
    assert [c["events"] for c in copies] == [h["events"] for h in held] != [0, 0]
    return {}


def _spare(group, path) -> dict:
    assert len(group.spares) == 1 and group.num_trainers == 2
    return {}


def _bundles(trainer_cpus: float, shard_cpus: float, trainer_extra: dict | None = None,
             shard_extra: dict | None = None) -> Callable:  # fmt: skip
    """Every shard and trainer bundle asks for its CPUs and the custom resources given."""

    def look(group, path) -> dict:
        from ray.util import placement_group_table

        shard = placement_group_table(group.shard_pg)["bundles"]
        want = {"CPU": shard_cpus, **(shard_extra or {})}
        assert list(shard.values()) == [want] * (2 * group.num_copies)
        want = {"CPU": trainer_cpus, **(trainer_extra or {})}
        for slot in group.member_slots.values():
            assert list(placement_group_table(slot)["bundles"].values()) == [want]
        return {}

    return look


def _sampling_in_place(want: list) -> Callable:
    def look(group, path) -> dict:
        assert ray.get([t.local_shards.remote() for t in group.trainers]) == [want] * 2
        return {}

    return look


def _task_per_step(group, path) -> dict:
    assert not group.runs_passes
    return {}


def _recovered(group, path) -> dict:
    """The injected fault killed trainer 1 once, and the group replaced it."""
    lost = [r["lost"] for r in records(path, membership=True) if r["phase"] == "recovery"]
    assert lost == [[1]], lost
    return {}


def _update_log(group, path) -> dict:
    """Steps are logged; those before the oldest kept checkpoint were dropped with it."""
    store = CheckpointStore.at(str(path / "checkpoints"))
    oldest = store.meta(store.tags()[0])["step"]
    steps = logged_steps(path / "updates")
    assert steps and min(steps) >= oldest > 0, (steps, oldest)
    return {}


def _sharded(group, path) -> dict:
    assert group.memory_placement == "sharded"
    return {}


def _elastic_trainers(group, path) -> dict:
    """The group ends at its maximum; `resized`: it started below it (Ray had not placed the
    second slot yet) and grew, so it trained at another size for a while: the same run up to
    float summation order, not bitwise."""
    assert (group.min_trainers, group.max_trainers, group.num_trainers) == (1, 2, 2)
    grew = [r for r in records(path, membership=True) if r["phase"] == "resize"]
    return {"resized": group.start_trainers != 2 or bool(grew)}


def _elastic_shards(group, path) -> dict:
    assert (group.min_shards, group.max_shards) == (1, 2)
    assert len({s.actor._actor_id for s in group.shards}) == 2  # one actor per partition
    return {}


def _recoveries_left(n: int) -> Callable:
    def look(group, path) -> dict:
        assert group.recoveries_left == n
        return {}

    return look


def _overlapped(group, path) -> dict:
    """Gradient buckets left during backward."""
    summary = json.loads((path / "summary.json").read_text())
    assert summary["comm"]["buckets_sent_in_backward"], summary["comm"]
    return {}


def _overlapped_exact(group, path) -> dict:
    """fp32 buckets left during backward, every one exact."""
    _overlapped(group, path)
    comm = json.loads((path / "summary.json").read_text())["comm"]
    assert comm["compressed_steps"] == 0 and comm["ratio"] == 1.0, comm
    return {}


def _checkpoints(group, path) -> dict:
    """checkpoint_every 2, keep_checkpoints 2: written after phase 1, every second increment
    and the last; the newest two are kept, and each loads."""
    n = sum(r["phase"] == "increment" for r in records(path))
    ends = dict.fromkeys([*range(2, n + 1, 2), n])
    written = ["phase1", *(f"increment-{k:05d}" for k in ends)]
    store = CheckpointStore.at(str(path / "checkpoints"))
    assert store.tags() == written[-2:] and store.latest() == written[-1]
    assert sorted(p.stem for p in (path / "checkpoints").glob("*.pt")) == sorted(written[-2:])
    for tag in written[-2:]:
        assert store.load(tag)["learner"]["orchestrator"]["cursor"]["phase1_done"]
    return {}


def _timeline(group, path) -> dict:
    """The run directory's timeline: valid Chrome trace files whose spans come from both
    trainers (every phase of a step, only the recorded steps), the shards and the driver."""
    doc = load_trace(str(path))
    validate(doc)
    every = group.config.timeline
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["name"] == "thread_name"}  # fmt: skip
    spans: dict = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            spans.setdefault(names[e["pid"], e["tid"]], []).append(e)
    for rank in range(2):
        mine = spans[f"trainer {rank}"]
        assert {"sample", "fetch", "forward", "backward", "optimizer", "apply"} <= {
            e["name"] for e in mine}  # fmt: skip
        steps = {e["args"]["step"] for e in mine if e["args"]["pass"] == "train"}
        assert steps and all(s % every == 0 for s in steps), (every, sorted(steps))
    assert {"ingest", "checkpoint", "evaluation"} <= {e["name"] for e in spans["driver"]}
    assert any(k.startswith("shard") for k in spans)
    return {}


def _quarantined(group, path) -> dict:
    """The three bad rows of bad.csv went to the quarantine file."""
    rejects = Path(group.config.data.quarantine).read_text().splitlines()
    assert len(rejects) == 4, rejects  # a header line, then one line per row
    return {}


def all_of(*checks: Callable) -> Callable:
    def check(backend, group, path) -> dict:
        seen = {}
        for c in checks:
            seen.update(c(backend, group, path))
        return seen

    return check


# ---- the options ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One option's run: `over` on top of BASE; `effect` against the run of `base` (on top of
    BASE; default BASE itself): "differs" (the option changes the result), "same" (it must not)
    or None (no claim); `check` looks at the group; `bound`: 0 for a bitwise comparison of the
    backends, else both run in float64 and are compared to `bound` (relative) when the group's
    size changed during the run (bitwise otherwise); `unequal`: parts of
    the outcomes (`summary.comm`, `state.trainers[].comm`) that say how, not what, for this
    option (left out of the comparison; its check looks at them)."""

    id: str
    over: dict
    effect: str | None = "differs"
    base: dict = field(default_factory=dict)
    check: Callable | None = None
    bound: float = 0.0
    unequal: tuple[str, ...] = ()


FEAT = {"data": {"dataset": "@features.csv", "features": "a,b,c"}}
HEADERLESS = {"data": {"dataset": "@headerless.csv", "columns": "src=0,dst=1,time=3",
                       "header": False}}  # fmt: skip
DYSAT = {"model": {"name": "dysat"}}
TGAT = {"model": {"name": "tgat"}, "sampler": {"fanouts": [5, 3]}}
Q8 = {"comm": {"compression": "q8", **EAGER_Q}}
Q4 = {"comm": {"compression": "q4", **EAGER_Q}}
ADAPTIVE = {"comm": {"compression": "adaptive", "adaptive_every": 3, **EAGER_Q}}
TOPK = {"comm": {"compression": "topk", **EAGER_Q}}
COST = merged(Q8, {"comm": {"bucketing": "cost_model"}})
IMPORTANCE = {"continual": {"replay": "importance"}}
FAULT = [{"trainer": 1, "step": 3, "at": "allreduce"}]


def _with(base: dict, **sections) -> dict:
    return merged(base, sections)


OTHER_MODELS = ("tgat", "dysat", "sage", "jodie", "apan", "graphmixer", "dygformer", "tpnet",
                "edgebank")  # fmt: skip
CASES = [
    # model
    *[Case(f"model.name={m}", {"model": {"name": m}}) for m in OTHER_MODELS],
    Case("model.dim", {"model": {"dim": 32}}),
    Case("model.time_dim", {"model": {"time_dim": 4}}),
    Case("model.memory_dim", {"model": {"memory_dim": 8}}),
    Case("model.heads", {"model": {"heads": 4}}),
    Case("model.num_layers", {"model": {"num_layers": 2}}),
    Case("model.time_trainable", {"model": {"time_trainable": True}}),
    Case("model.static_memory", {"model": {"static_memory": True}}),
    Case(
        "model.walk_decay",
        {"model": {"name": "tpnet", "walk_decay": 1e-4}},
        base={"model": {"name": "tpnet"}},
    ),  # fmt: skip
    Case(
        "model.edgebank_window",
        {"model": {"name": "edgebank", "edgebank_window": 3000.0}},
        base={"model": {"name": "edgebank"}},
    ),  # fmt: skip
    Case(
        "model.static_memory+sharded",
        {"model": {"static_memory": True}, "cluster": {"memory": "sharded"}},
        base={"cluster": {"memory": "sharded"}},
    ),  # fmt: skip
    Case("model.slot_precision=bf16", {"model": {"slot_precision": "bf16"}}),
    Case("model.slot_precision=auto", {"model": {"slot_precision": "auto"}}, None),
    # data: datasets and formats
    Case("data.dataset=uci", {"data": {"dataset": "uci"}}),
    Case("data.dataset=file", {"data": {"dataset": "@features.csv"}}, None),
    Case("data.max_events", {"data": {"max_events": 800}}),
    Case(
        "data.format=csv",
        {"data": {"dataset": "@features.csv", "format": "csv"}},
        "same",
        {"data": {"dataset": "@features.csv"}},
    ),
    Case("data.format=jodie", {"data": {"dataset": "@jodie.csv", "format": "jodie"}}, None),
    Case("data.format=snap", {"data": {"dataset": "@snap.txt", "format": "snap"}}, None),
    Case("data.format=tgl", {"data": {"dataset": "@tgl", "format": "tgl"}}, None),
    Case(
        "data.format=parquet",
        {"data": {"dataset": "@events.parquet", "format": "parquet", "features": "w"}},
        None,
    ),
    Case(
        "data.quarantine",
        {"data": {"dataset": "@bad.csv", "quarantine": "@quarantine.csv"}},
        None,
        check=on_both(_quarantined),
    ),
    Case(
        "data.columns",
        _with(HEADERLESS, data={"columns": {"src": 0, "dst": 1, "time": 3}}),
        "same",
        HEADERLESS,
    ),
    Case("data.header+features", _with(HEADERLESS, data={"features": "2"}), "differs", HEADERLESS),
    Case("data.features", FEAT, "differs", {"data": {"dataset": "@features.csv"}}),
    Case("data.string_ids", {"data": {"dataset": "@strings.csv", "string_ids": True}}, None),
    Case(
        "data.reorder_window",
        {"data": {"dataset": "@unsorted.csv", "reorder_window": 10}},
        "same",
        {"data": {"dataset": "@unsorted.csv", "reorder_window": None}},
    ),
    *[
        Case(
            f"data.feature_precision={p}",
            _with(FEAT, data={"feature_precision": p}),
            "differs",
            FEAT,
        )
        for p in ("fp16", "bf16", "int8")
    ],
    Case("data.feature_cache_ratio", _with(FEAT, data={"feature_cache_ratio": 0.5}), "same", FEAT),
    *[
        Case(
            f"data.feature_cache_policy={p}",
            _with(FEAT, data={"feature_cache_policy": p}),
            "same",
            FEAT,
        )
        for p in ("lfu", "fifo", "recency", "static")
    ],
    # sampler
    Case("sampler.fanouts", {"sampler": {"fanouts": [4]}}),
    Case("sampler.strategy=uniform", {"sampler": {"strategy": "uniform"}}),
    Case(
        "sampler.strategy=uniform,tgat",
        _with(TGAT, sampler={"strategy": "uniform"}),
        "differs",
        TGAT,
    ),
    Case("sampler.num_snapshots", _with(DYSAT, sampler={"num_snapshots": 2}), "differs", DYSAT),
    Case(
        "sampler.snapshot_window",
        _with(DYSAT, sampler={"snapshot_window": 5000.0}),
        "differs",
        DYSAT,
    ),
    Case("sampler.dedup", _with(TGAT, sampler={"dedup": False}), None),
    Case("sampler.history", {"sampler": {"history": "batch"}}),
    *[
        Case(f"sampler.root_dedup={v}", {"sampler": {"root_dedup": v}}, None)
        for v in ("always", "never")
    ],
    # train
    Case("train.batch_size", {"train": {"batch_size": 50}}),
    Case("train.lr", {"train": {"lr": 1e-2}}),
    Case("train.epochs", {"train": {"epochs": 2}}),
    Case("train.train_negatives", {"train": {"train_negatives": 2}}),
    Case("train.eval_negatives", {"train": {"eval_negatives": 5}}),
    Case("train.eval_max_roots", {"train": {"eval_max_roots": 30}}, None),
    Case("train.optimizer", {"train": {"optimizer": "lamb"}}),
    Case("train.warmup_steps", {"train": {"warmup_steps": 4}}),
    # continual
    Case("continual.train_fraction", {"continual": {"train_fraction": 0.5}}),
    Case("continual.val_fraction", {"continual": {"val_fraction": 0.3}}),
    Case("continual.num_increments", {"continual": {"num_increments": 3}}),
    Case("continual.increment_events", {"continual": {"increment_events": 150}}),
    Case("continual.increment_window", {"continual": {"increment_window": 5000.0}}),
    Case("continual.replay_ratio", {"continual": {"replay_ratio": 1.0}}),
    Case("continual.replay", IMPORTANCE),
    # a reservoir smaller than the history: a sample of it is replayed, not all of it
    Case("continual.replay_capacity", {"continual": {"replay_capacity": 200}}),
    Case(
        "continual.importance_floor",
        _with(IMPORTANCE, continual={"importance_floor": 0.5}),
        "differs",
        IMPORTANCE,
    ),
    Case("continual.retrain_epochs", {"continual": {"retrain_epochs": 2}}),
    Case("continual.fresh_optimizer", {"continual": {"fresh_optimizer": True}}),
    Case("continual.forget_sample", {"continual": {"forget_sample": 50}}),
    # a block handled a window at a time (ingest, passes, reads) learns as one handled at once
    Case("continual.window_events", {"continual": {"window_events": 150}}, "same"),
    # cluster
    Case(
        "cluster.trainers=min:max",
        {"cluster": {"trainers": {"min": 1, "max": 2}}},
        "same",
        check=on_ray(_elastic_trainers),
        bound=1e-9,
    ),
    Case(
        "cluster.shards=min:max",
        {"cluster": {"shards": {"min": 1, "max": 2}}},
        "same",
        check=on_ray(_elastic_shards),
    ),
    Case("cluster.elastic_poll_s", {"cluster": {"elastic_poll_s": 0.1}}, "same"),
    Case(
        "cluster.spare_trainers", {"cluster": {"spare_trainers": 1}}, "same", check=on_ray(_spare)
    ),
    Case("cluster.scale_rule", {"cluster": {"scale_rule": "linear"}}, "same"),
    Case(
        "cluster.shard_replicas",
        {"cluster": {"shard_replicas": 2}},
        "same",
        check=on_ray(_replicas),
    ),
    Case("cluster.partitioner", {"cluster": {"partitioner": "ldg"}}, "same"),
    Case(
        "cluster.memory=sharded", {"cluster": {"memory": "sharded"}}, None, check=on_both(_sharded)
    ),
    Case("cluster.memory=replicated", {"cluster": {"memory": "replicated"}}, "same"),
    Case(
        "cluster.memory_budget_mb",
        {"cluster": {"memory_budget_mb": 0.01}},
        None,
        check=on_both(_sharded),
    ),
    Case(
        # trainer_gpus: the share of a GPU on CUDA; on the CPU no bundle asks for one; custom
        # resources (conftest.TEST_RESOURCES offers them) mean nothing on the local backend
        "cluster.trainer_cpus+shard_cpus+trainer_gpus+resources",
        {
            "cluster": {
                "trainer_cpus": 0.5,
                "shard_cpus": 0.25,
                "trainer_gpus": 0.5,
                "trainer_resources": {"tg_trainer": 1},
                "shard_resources": {"tg_shard": 0.5},
            }
        },
        "same",
        check=on_ray(_bundles(0.5, 0.25, {"tg_trainer": 1}, {"tg_shard": 0.5})),
    ),
    Case("cluster.collective_timeout_s", {"cluster": {"collective_timeout_s": 30.0}}, "same"),
    Case(
        "cluster.local_sampling",
        {"cluster": {"local_sampling": False}},
        "same",
        check=on_ray(_sampling_in_place([])),
    ),
    Case(
        "cluster.whole_passes",
        {"cluster": {"whole_passes": False}},
        "same",
        check=on_ray(_task_per_step),
    ),
    *[
        Case(f"cluster.rebalance_tolerance={v}", {"cluster": {"rebalance_tolerance": v}}, None)
        for v in (0.0, None)
    ],
    Case(
        "cluster.max_recoveries",
        {"cluster": {"max_recoveries": 3}},
        "same",
        check=on_ray(_recoveries_left(3)),
    ),
    Case(
        "cluster.update_log_every",
        {"cluster": {"update_log_every": 2}},
        "same",
        check=on_ray(_update_log),
    ),
    Case("cluster.faults", {"cluster": {"faults": FAULT}}, "same", check=on_ray(_recovered)),
    # comm
    *[
        Case(f"comm.compression={c}", {"comm": {"compression": c, **EAGER_Q}})
        for c in ("q8", "q4", "q2", "adaptive", "topk")
    ],
    Case("comm.chunk_size", _with(Q8, comm={"chunk_size": 64}), "differs", Q8),
    Case("comm.warmup_steps", _with(Q8, comm={"warmup_steps": 4}), "differs", Q8),
    Case("comm.min_bucket_bytes", _with(Q8, comm={"min_bucket_bytes": 1 << 20}), "same"),
    Case("comm.error_feedback", _with(Q4, comm={"error_feedback": True}), "differs", Q4),
    Case("comm.adaptive_bits", _with(ADAPTIVE, comm={"adaptive_bits": [2]}), "differs", ADAPTIVE),
    Case("comm.adaptive_lambda", _with(ADAPTIVE, comm={"adaptive_lambda": 0.0}), None),
    Case("comm.adaptive_every", _with(ADAPTIVE, comm={"adaptive_every": 1}), None),
    Case("comm.topk_ratio", _with(TOPK, comm={"topk_ratio": 0.2}), "differs", TOPK),
    Case("comm.bucketing", COST, None),
    Case("comm.bucket_bytes", _with(Q8, comm={"bucket_bytes": 2048}), None),
    Case("comm.link_latency_s", _with(COST, comm={"link_latency_s": 1e-3}), None),
    Case("comm.link_bandwidth_gbps", _with(COST, comm={"link_bandwidth_gbps": 0.1}), None),
    Case("comm.latency_fraction", _with(COST, comm={"latency_fraction": 0.5}), None),
    Case("comm.rows_int8", _with(FEAT, comm={"rows_int8": True}), "differs", FEAT),
    Case("comm.codec", _with(Q8, comm={"codec": "eager"}), "same", Q8),
    Case("comm.pipeline_stages", _with(Q8, comm={"pipeline_stages": 1}), "same", Q8),
    # fp32 buckets sent during backward go through the trainers' gradient reducer, which counts
    # the (exact) bytes it sent in the Ray summary; the local backend sends nothing
    Case(
        "comm.overlap",
        {"comm": {"overlap": True}},
        "same",
        check=on_ray(_overlapped_exact),
        unequal=("summary.comm", "state.trainers[].comm"),
    ),
    Case("comm.overlap+q8", _with(Q8, comm={"overlap": True}), "same", Q8, on_ray(_overlapped)),
    # the run
    Case("seed", {"seed": 3}),
    Case("device", {"device": "cpu"}, "same"),
    Case("graph_device", {"graph_device": "cpu"}, "same"),
    Case(
        "checkpoint_every",
        {"checkpoint_every": 2, "keep_checkpoints": 2},
        "same",
        check=on_both(_checkpoints),
    ),
    Case("progress", {"progress": True}, "same"),
    Case("timeline", {"timeline": 2}, "same", check=on_both(_timeline)),
    Case("threads", {"threads": 2}, None),
    Case("deterministic", {"deterministic": False}, None),
]


# ---- one option at a time (slow) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def local_runs(files, storage):
    """Runs on the local backend by their overrides of BASE (in float64 with `float64`), each
    made once per module."""
    made: dict[str, Outcome] = {}

    def get(over: dict, float64: bool = False) -> Outcome:
        key = json.dumps([over, float64], sort_keys=True)
        if key not in made:
            with float64_everywhere() if float64 else contextlib.nullcontext():
                made[key] = run(resolved(merged(BASE, over), files), "local", storage)
        return made[key]

    return get


def drop(x, path: str) -> None:
    """Remove the entry at `path` ("a.b", "a[].b": b of every item of list a that has one)
    from `x`."""
    head, _, rest = path.partition(".")
    key = head.removesuffix("[]")
    inner = getattr(x, key) if isinstance(x, Outcome) else x[key]
    if not rest and isinstance(x, dict):
        del x[key]
    elif not rest:
        setattr(x, key, None)
    elif head.endswith("[]"):
        for item in inner:
            if not isinstance(item, dict) or rest.partition(".")[0].removesuffix("[]") in item:
                drop(item, rest)
    else:
        drop(inner, rest)


def compare(case: Case, files, storage) -> Outcome:
    """`case` on both backends, held to the same assertions; the local run."""
    config = resolved(merged(BASE, case.over), files)
    with float64_everywhere() if case.bound else contextlib.nullcontext():
        local = run(config, "local", storage, case.check)
        remote = run(config, "ray", storage, case.check)
    for path in case.unequal:
        drop(local, path)
        drop(remote, path)
    bound = case.bound if remote.seen.get("resized") else 0.0
    assert_same(local, remote, case.id, bound)
    return local


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_option_gives_the_same_run_on_both_backends(case, ray_session, files, storage, local_runs):
    local = compare(case, files, storage)
    if case.effect is not None:  # the option is not silently ignored (on both backends)
        changed = not same_result(local, local_runs(case.base, float64=bool(case.bound)))
        assert changed == (case.effect == "differs"), (case.id, case.effect)


# ---- every option in a few runs (default suite) -----------------------------------------------

COMBINED = [
    Case("tgn+cluster+q8", {
        "model": {"num_layers": 2, "dim": 32, "heads": 4, "memory_dim": 8, "time_dim": 4,
                  "time_trainable": True, "static_memory": True},
        "sampler": {"fanouts": [5, 3], "history": "batch", "root_dedup": "never"},
        "train": {"lr": 2e-3, "train_negatives": 2, "optimizer": "lamb", "warmup_steps": 3},
        "continual": {"increment_events": 150, "replay": "importance", "importance_floor": 0.3,
                      "replay_ratio": 0.8, "fresh_optimizer": True, "retrain_epochs": 2,
                      "replay_capacity": 300, "window_events": 250},
        "cluster": {"spare_trainers": 1, "shard_replicas": 2, "trainer_cpus": 0.5,
                    "shard_cpus": 0.25, "trainer_gpus": 0.5, "collective_timeout_s": 60.0,
                    "max_recoveries": 3,
                    "elastic_poll_s": 0.2, "scale_rule": "linear", "update_log_every": 2,
                    "faults": FAULT, "partitioner": "ldg", "rebalance_tolerance": 0.0,
                    "memory": "replicated", "trainer_resources": {"tg_trainer": 0.5},
                    "shard_resources": {"tg_shard": 0.25}},
        "comm": {"compression": "q8", "codec": "eager", "warmup_steps": 2,
                 "min_bucket_bytes": 0, "chunk_size": 64, "bucketing": "cost_model",
                 "link_latency_s": 1e-4, "link_bandwidth_gbps": 1.0, "latency_fraction": 0.2,
                 "pipeline_stages": 2, "overlap": True},
        "seed": 11, "checkpoint_every": 2, "keep_checkpoints": 2, "device": "cpu",
        "graph_device": "cpu", "timeline": 3,
        "deterministic": True, "threads": 1, "progress": True,
    }, None, check=all_of(on_ray(_replicas),
                          on_ray(_bundles(0.5, 0.25, {"tg_trainer": 0.5}, {"tg_shard": 0.25})),
                          on_ray(_recovered),
                          on_ray(_update_log), on_ray(_overlapped), on_both(_checkpoints),
                          on_both(_timeline)),
         # with the node table the gradient is two buckets: Ray's trainers send them during
         # backward (overlap), counting a flag byte a bucket where the in-process reduction
         # counts one a pipeline stage, so the bytes differ by how they were sent
         unequal=("records[].ratio", "summary.comm", "state.trainers[].comm")),
    Case("tgat+features+uniform+elastic", {
        "model": {"name": "tgat", "num_layers": 1, "slot_precision": "auto"},
        "data": {"dataset": "@features.csv", "format": "csv", "features": "a,b,c",
                 "columns": "src=src,dst=dst,time=time,label=label", "header": True,
                 "reorder_window": 50, "feature_precision": "int8",
                 "feature_cache_ratio": 0.5, "feature_cache_policy": "lfu"},
        "sampler": {"fanouts": [6], "strategy": "uniform", "dedup": False,
                    "root_dedup": "always"},
        "train": {"batch_size": 80, "eval_max_roots": 40, "eval_negatives": 4},
        "continual": {"increment_window": 8000.0, "forget_sample": 50, "val_fraction": 0.2,
                      "train_fraction": 0.5},
        "cluster": {"local_sampling": False, "whole_passes": False,
                    "trainers": {"min": 1, "max": 2}, "shards": {"min": 1, "max": 2}},
    }, None, check=all_of(on_ray(_sampling_in_place([])), on_ray(_task_per_step),
                          on_ray(_elastic_trainers), on_ray(_elastic_shards)), bound=1e-9),
]  # fmt: skip


@pytest.mark.parametrize("case", COMBINED, ids=lambda c: c.id)
def test_options_together_give_the_same_run_on_both_backends(case, ray_session, files, storage):
    compare(case, files, storage)


# ---- options of the command line ----------------------------------------------------------------

SMALL_MODEL = {"model": {"dim": 16, "time_dim": 8, "memory_dim": 16, "slot_precision": "fp32"},
               "train": {"batch_size": 100, "eval_negatives": 3},
               "continual": {"forget_sample": 100, "train_fraction": 0.6}}  # fmt: skip
OFFLINE_YAML = {**SMALL_MODEL, "offline_split": [0.6, 0.2]}
FOLLOW_DIR_YAML = {**SMALL_MODEL, "cluster": {"memory_budget_mb": 0.01}}
FOLLOW_FILE_YAML = merged(SMALL_MODEL, {
    "model": {"slot_precision": "bf16"},
    "sampler": {"num_snapshots": 2, "snapshot_window": 5000.0},
    "comm": {"compression": "adaptive", "adaptive_bits": [2, 4], "adaptive_lambda": 2.0,
             "adaptive_every": 2, "bucket_bytes": 1 << 16, "codec": "eager", **EAGER_Q},
})  # fmt: skip
# top-k compression with error feedback and int8 feature rows, under the job flags' run (a
# compressed run is exact only at a fixed group size: elastic runs above have none)
JOB_YAML = merged(SMALL_MODEL, {"comm": {"compression": "topk", "topk_ratio": 0.1,
                                         "error_feedback": True, "rows_int8": True,
                                         "codec": "eager", **EAGER_Q}})  # fmt: skip
CLUSTER = ["--shards", "2", "--trainers", "2", "--metrics-port", "-1", "--no-progress"]
# flags of the combined job runs (`@name`: a data file, or a path the test makes)
JOB_ARGS = [
    "--config", "@config", "--model", "apan", "--dataset", "@mixed.csv", "--format", "csv",
    "--columns", "src=src,dst=dst,time=time,label=label", "--header", "--features", "a,b,c",
    "--string-ids", "--quarantine", "@quarantine", "--max-events", "900", "--increments", "2",
    "--eval-protocol", "tgb", "--eval-negatives", "20", "--eval-prefix", "60",
    "--replay", "importance", "--epochs", "1", "--seed", "3", "--threads", "1",
    "--device", "cpu", "--checkpoint-every", "2", "--keep-checkpoints", "1", "--debug",
    "--memory", "sharded", "--timeline", "2",
    "--partitioner", "ldg", "--shards", "2", "--trainers", "2", "--metrics-port", "0",
    "--no-progress",
]  # fmt: skip
OFFLINE_ARGS = [
    "--mode", "offline", "--config", "@config", "--dataset", "@headerless.csv",
    "--columns", "src=0,dst=1,time=3", "--features", "2", "--no-header", "--model", "sage",
    "--epochs", "2", "--max-events", "800", *CLUSTER,
]  # fmt: skip
# TGB's protocol (its split, hist_rnd negatives, MRR and Hits@k), offline; the default suite's
# job on TPNet (node state, scored pair by pair) with its time decay
TGB_YAML = merged(SMALL_MODEL, {"eval": {"hist_ratio": 0.4, "hits_k": 5, "every_epoch": True}})
TPNET_TGB_YAML = merged(TGB_YAML, {"model": {"walk_decay": 1e-5}})
TGB_ARGS = [
    "--mode", "offline", "--config", "@config", "--model", "tpnet", "--eval-protocol",
    "tgb", "--eval-negatives", "30", "--eval-prefix", "120", "--epochs", "2", "--max-events",
    "1500", *CLUSTER,
]  # fmt: skip
# EdgeBank as the job's model under TGB's protocol (its test sets the window from the split)
EDGEBANK_ARGS = [
    "--mode", "offline", "--config", "@config", "--model", "edgebank", "--eval-protocol",
    "tgb", "--eval-negatives", "30", "--eval-prefix", "150", "--epochs", "2", "--max-events",
    "1500", "--seed", "7", *CLUSTER,
]  # fmt: skip
FOLLOW_DIR_ARGS = ["--follow", "@inbox", "--follow-timeout", "0.3", "--config", "@config",
                   "--model", "jodie", "--epochs", "1", *CLUSTER]  # fmt: skip
FOLLOW_FILE_ARGS = ["--follow", "@events.csv", "--follow-lines", "200", "--follow-timeout",
                    "0.3", "--config", "@config", "--model", "dysat", "--epochs", "1",
                    *CLUSTER]  # fmt: skip
# what each test adds: where the run goes (--storage and --run-name, or --out), the backend
# (--backend local; none for Ray, the job's default), --resume to continue a run
PER_RUN = ["--storage", "--run-name", "--out", "--backend", "--resume"]


def yaml_file(path: Path, raw: dict) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def job(args: list[str], backend: str) -> int:
    """`python -m tidegraph.jobs.train ARGS` on `backend` (Ray: without --backend, the job's
    default), in this process (on the module's Ray)."""
    threads = torch.get_num_threads()
    try:
        return main([*args, *([] if backend == "ray" else ["--backend", backend])])
    finally:  # the job sets threads and determinism for its process
        set_determinism(7, 0, True, threads)


def job_outcome(path: Path) -> dict:
    """What a job left in its run directory: its records and summary without wall times, and
    the final checkpoint's group (every shard and trainer) and position."""
    saved = final_state(path)  # the graph as segments, whatever the checkpoints' times
    return {"records": records(path), "summary": untimed(json.loads((path / "summary.json")
                                                                    .read_text())),
            "group": group_state(saved["group"]),
            "cursor": saved["orchestrator"]["cursor"]}  # fmt: skip


def released(namespace: str) -> bool:
    """Whether no actor of namespace `namespace` is left (bounded wait: kills are async)."""
    for _ in range(100):
        left = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == namespace]  # fmt: skip
        if not left:
            return True
        time.sleep(0.1)
    return False


def assert_same_job(outs: dict) -> None:
    found = first_difference(outs["local"], outs["ray"])
    assert found is None, found


def test_job_flags_give_the_same_run_on_both_backends(ray_session, files, tmp_path, capsys):
    """A file of string ids with named edge-feature columns and bad rows, read through the
    flags, with a YAML config under them: each backend ingests, quarantines and trains the
    same, and serves its metrics."""
    quarantine = tmp_path / "rejected.csv"
    paths = {**files, "config": yaml_file(tmp_path / "run.yaml", JOB_YAML),
             "quarantine": str(quarantine)}  # fmt: skip
    outs = {}
    for backend in BACKENDS:
        quarantine.unlink(missing_ok=True)
        name = f"flags-{backend}"
        args = [*resolved(JOB_ARGS, paths), "--storage", str(tmp_path), "--run-name", name]
        assert job(args, backend) == 0
        assert "metrics: http://127.0.0.1:" in capsys.readouterr().out
        assert len(quarantine.read_text().splitlines()) == 4  # a header, the three bad rows
        outs[backend] = job_outcome(tmp_path / name)
        # after phase 1 and increment 2 (--checkpoint-every 2); --keep-checkpoints 1
        assert CheckpointStore.at(str(tmp_path / name / "checkpoints")).tags() == [
            "increment-00002"]  # fmt: skip
        summary = outs[backend]["summary"]
        assert summary["memory_placement"] == "sharded" and summary["model"] == "apan"
        assert summary["partition"]["shard_events"] != [0, 0]
        # TGB's protocol, continual: each increment's first 60 positives, 20 negatives each
        assert summary["protocol"] == {"name": "tgb", "negatives": 20, "hist_ratio": 0.5,
                                       "prefix": 60}  # fmt: skip
        increments = [r for r in outs[backend]["records"] if r["phase"] == "increment"]
        assert [r["positives"] for r in increments] == [60, 60]
        assert all(0 < r["mrr"] < 1 and 0 <= r["hits@10"] <= 1 for r in increments)
    assert_same_job(outs)
    assert released("flags-ray")


def test_offline_mode_on_both_backends(ray_session, files, tmp_path, capsys):
    """`--mode offline` (GraphSAGE) on a headerless signed network (`--columns ... --features
    2 --no-header`): the same validation and test metrics, and a last screen of them; the Ray
    group is released after."""
    config = yaml_file(tmp_path / "run.yaml", OFFLINE_YAML)
    outs = {}
    for backend in BACKENDS:
        out = tmp_path / f"offline-{backend}"
        args = [*resolved(OFFLINE_ARGS, {**files, "config": config}), "--out", str(out)]
        capsys.readouterr()
        assert job(args, backend) == 0
        outs[backend] = untimed(json.loads((out / "offline.json").read_text()))
        assert outs[backend]["events"] == 800 and len(outs[backend]["epochs"]) == 2
        test = outs[backend]["test"]
        screen = capsys.readouterr().out.splitlines()[-4:]
        assert screen[0].startswith("offline: sage on ") and "800 events, 2 epochs" in screen[0]
        assert screen[1] == (f"  test: AP {test['ap']:.4f}  AUC {test['auc']:.4f}  MRR "
                             f"{test['mrr']:.4f}")  # fmt: skip
        assert screen[3] == f"  every epoch's figures: {out / 'offline.json'}"
    assert outs["local"] == outs["ray"]
    assert released("offline-ray")  # its actors and placement groups too


def test_the_tgb_protocol_on_both_backends(ray_session, files, tmp_path, capsys):
    """`--eval-protocol tgb` (TPNet): the same split, negatives, MRR and Hits@k on each
    backend, validation scored after every epoch (`eval.every_epoch`), and a last screen of
    them."""
    config = yaml_file(tmp_path / "run.yaml", TPNET_TGB_YAML)
    outs = {}
    for backend in BACKENDS:
        out = tmp_path / f"tgb-{backend}"
        capsys.readouterr()
        assert job([*resolved(TGB_ARGS, {**files, "config": config}), "--out", str(out)],
                   backend) == 0  # fmt: skip
        outs[backend] = untimed(json.loads((out / "offline.json").read_text()))
        test = outs[backend]["test"]
        screen = capsys.readouterr().out.splitlines()[-4:]
        assert screen[1].endswith(f"Hits@5 {test['hits@5']:.4f}  (TGB protocol: 30 negatives "
                                  f"a positive, 120 positives)"), screen  # fmt: skip
    result = outs["local"]
    assert result == outs["ray"]
    assert result["protocol"] == {"name": "tgb", "negatives": 30, "hist_ratio": 0.4,
                                  "prefix": 120}  # fmt: skip
    assert [e["positives"] for e in result["epochs"]] == [120, 120]  # scored every epoch
    assert result["test"]["positives"] == 120 and 0 < result["test"]["mrr"] < 1
    assert sum(result["split"].values()) == 1500
    assert released("tgb-ray")


@pytest.mark.parametrize("mode", ["unlimited", "window"])
def test_edgebank_as_the_jobs_model_is_tgbs_edgebank_on_both_backends(ray_session, tmp_path, mode):
    """`--model edgebank` under TGB's protocol: the job's EdgeBank (its memory every event a
    step or an evaluation recorded, held by each of two trainers) scores exactly as TGB's
    EdgeBank run on the same split and negatives, on each backend; the window mode with
    `model.edgebank_window` set to 0.15 of the train split's span, TGB's window."""
    from tidegraph.rng import seed_for
    from tidegraph.training.tgb import edgebank_tgb, tgb_bounds

    events = load_stream("wikipedia", 1500).events
    train_end, _ = tgb_bounds(events.t)
    span = float(events.t[train_end - 1] - events.t[0])
    window = 0.15 * span if mode == "window" else 0.0
    config = yaml_file(tmp_path / "run.yaml", {"model": {"edgebank_window": window}})
    want = edgebank_tgb(events, int(max(events.src.max(), events.dst.max())) + 1, mode, k=30,
                        seed=seed_for(7, "tgb negatives"), prefix=150)  # fmt: skip
    for backend in BACKENDS:
        out = tmp_path / f"edgebank-{backend}"
        args = [*resolved(EDGEBANK_ARGS, {"config": config}), "--out", str(out)]
        assert job(args, backend) == 0
        got = json.loads((out / "offline.json").read_text())
        for split in ("val", "test"):
            assert got[split]["positives"] == 150
            assert got[split]["mrr"] == pytest.approx(want[split]["mrr"], abs=1e-6), split
            assert got[split]["hits@10"] == pytest.approx(want[split]["hits@10"], abs=1e-6)
        assert 0 < got["test"]["mrr"] < 1


def _write_csv(path: Path, events) -> None:
    """`events` as a CSV file in a followed directory (written aside, then renamed: whole)."""
    cols = (events.src.tolist(), events.dst.tolist(), events.t.tolist())
    lines = "".join(f"{s},{d},{t!r}\n" for s, d, t in zip(*cols, strict=True))
    path.with_suffix(".part").write_text("src,dst,time\n" + lines)
    path.with_suffix(".part").rename(path)


def test_a_followed_directory_resumed_on_both_backends(ray_session, tmp_path, monkeypatch):
    """`--follow DIR` (its first file phase 1, each later one an increment, until none comes
    for `--follow-timeout`), then `--resume` once another file arrived: both backends end
    with the same run (jodie, node state sharded by `cluster.memory_budget_mb`). On Ray the
    resumed driver reads none of the shards' and trainers' state: each actor reads its own."""
    monkeypatch.setattr(DirectorySource, "poll_interval", 0.02)
    read_here: set[str] = set()  # chunks this process (the driver) read
    tensor = CheckpointStore._tensor

    def recorded(store, ref, *args, **kwargs):
        read_here.update(ref.chunks)
        return tensor(store, ref, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "_tensor", recorded)
    events = load_stream("wikipedia", EVENTS).events
    config = yaml_file(tmp_path / "run.yaml", FOLLOW_DIR_YAML)
    outs = {}
    for backend in BACKENDS:
        inbox = tmp_path / backend / "inbox"  # the same names: the runs record them
        inbox.mkdir(parents=True)
        _write_csv(inbox / "part-000.csv", events.select(slice(0, 600)))
        _write_csv(inbox / "part-001.csv", events.select(slice(600, 800)))
        args = [*resolved(FOLLOW_DIR_ARGS, {"inbox": str(inbox), "config": config}),
                "--storage", str(tmp_path / backend), "--run-name", "follow"]  # fmt: skip
        assert job(args, backend) == 0
        _write_csv(inbox / "part-002.csv", events.select(slice(800, 1000)))
        store = CheckpointStore.at(str(tmp_path / backend / "follow" / "checkpoints"))
        saved = store.load(resolve=False)
        group = saved["learner"]["group"]
        bulk = chunks_of([group["shards"], group["trainers"]])
        read_here.clear()
        assert job([*args, "--resume"], backend) == 0
        assert bulk, "the checkpoint's shard and trainer states hold no refs"
        if backend == "ray":
            assert not bulk & read_here, "the driver read the actors' state"
        else:  # in one process the pieces read their own state, here
            assert bulk <= read_here
        outs[backend] = job_outcome(tmp_path / backend / "follow")
        rows = outs[backend]["records"]
        assert [r.get("events") for r in rows if r["phase"] == "increment"] == [200, 200]
        assert outs[backend]["summary"]["memory_placement"] == "sharded"
    assert_same_job(outs)


def test_a_followed_growing_file_on_both_backends(ray_session, tmp_path, monkeypatch):
    """`--follow FILE --follow-lines 200`: the lines the file holds are phase 1, then each
    200 appended lines an increment; the writer appends once phase 1 is read (so the cut does
    not depend on timing). DySAT over two snapshot windows, bf16 slot projections, adaptive
    bits per gradient bucket (the YAML)."""
    monkeypatch.setattr(GrowingFileSource, "poll_interval", 0.02)
    events = load_stream("wikipedia", EVENTS).events
    cols = (events.src.tolist(), events.dst.tolist(), events.t.tolist())
    lines = [f"{s},{d},{t!r}\n" for s, d, t in zip(*cols, strict=True)]
    later: dict[Path, str] = {}
    read = GrowingFileSource.next_events

    def next_events(source, timeout):
        got = read(source, timeout)
        rest = later.pop(source.path, None)
        if rest is not None:  # phase 1 is read: the writer appends the rest in one write
            with source.path.open("a") as f:
                f.write(rest)
        return got

    monkeypatch.setattr(GrowingFileSource, "next_events", next_events)
    config = yaml_file(tmp_path / "run.yaml", FOLLOW_FILE_YAML)
    outs = {}
    for backend in BACKENDS:
        path = tmp_path / backend / "events.csv"  # the same names: the runs record them
        path.parent.mkdir()
        path.write_text("src,dst,time\n" + "".join(lines[:600]))
        later[path] = "".join(lines[600:])
        args = [*resolved(FOLLOW_FILE_ARGS, {"events.csv": str(path), "config": config}),
                "--out", str(tmp_path / backend / "run")]  # fmt: skip
        assert job(args, backend) == 0
        outs[backend] = job_outcome(tmp_path / backend / "run")
        rows = outs[backend]["records"]
        assert [r.get("events") for r in rows if r["phase"] == "increment"] == [200, 200]
    assert_same_job(outs)


def assert_refused(args: list[str], backend: str, name: str, capsys, says: str) -> None:
    """The job ends with exit code 2 and one line saying `says`, before any actor starts (no
    actor of the run's namespace, no Ray resources taken) and before any run directory."""
    total = ray.cluster_resources()["CPU"]
    for _ in range(100):  # earlier tests' groups are released asynchronously: bounded wait
        if ray.available_resources().get("CPU") == total:
            break
        time.sleep(0.1)
    assert job(args, backend) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [x for x in err if x.startswith("error: ")] == [err[-1]] and says in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert released(name) and ray.available_resources().get("CPU") == total


CUDA_ONLY = {"device": ["--device", "cuda"], "graph_device": ["--config", "@pinned"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("option", sorted(CUDA_ONLY))
def test_cuda_on_a_machine_without_it_is_refused_before_any_actor_starts(
    backend, option, ray_session, tmp_path, capsys
):
    pinned = yaml_file(tmp_path / "pinned.yaml", {"graph_device": "pinned"})
    name = f"refused-{option}-{backend}"
    args = [*resolved(CUDA_ONLY[option], {"pinned": pinned}), "--max-events", "400",
            "--storage", str(tmp_path), "--run-name", name, *CLUSTER]  # fmt: skip
    assert_refused(args, backend, name, capsys, "needs CUDA")
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_how_to_read_a_dataset_file_with_follow_is_refused_not_ignored(
    backend, ray_session, files, tmp_path, capsys
):
    """A followed file is read by its own header and format: `--features` (and `--columns`,
    `--header`) would be ignored there, so the job refuses them."""
    name = f"refused-follow-{backend}"
    args = ["--follow", files["features.csv"], "--features", "a,b,c", "--storage",
            str(tmp_path), "--run-name", name, *CLUSTER]  # fmt: skip
    assert_refused(args, backend, name, capsys, "--features/data.features")
    assert not (tmp_path / name).exists()


# ---- one flag at a time (slow) ------------------------------------------------------------------

SLOW_BASE = ["--config", "@config", "--max-events", str(EVENTS), "--increments", "2",
             "--epochs", "1", *CLUSTER]  # fmt: skip
SLOW_JOBS = {
    "features": ["--dataset", "@features.csv", "--features", "a,b,c"],
    "headerless": ["--dataset", "@headerless.csv", "--columns", "src=0,dst=1,time=3",
                   "--features", "2", "--no-header"],
    "string-ids": ["--dataset", "@strings.csv", "--string-ids"],
    "quarantine": ["--dataset", "@bad.csv", "--quarantine", "@quarantine"],
    "format": ["--dataset", "@snap.txt", "--format", "snap"],
    "header": ["--dataset", "@features.csv", "--format", "csv", "--header"],
    "model": ["--model", "apan"],
    "replay": ["--replay", "importance"],
    "seed": ["--seed", "5"],
    "threads": ["--threads", "2"],
    "memory": ["--memory", "sharded"],
    "partitioner": ["--partitioner", "ldg"],
    "min:max": ["--trainers", "1:2", "--shards", "1:2"],
    "checkpoint-every": ["--checkpoint-every", "2", "--keep-checkpoints", "2"],
    "metrics-port": ["--metrics-port", "0"],
    "device": ["--device", "cpu"],
    "debug": ["--debug"],
    "timeline": ["--timeline"],
    "offline": ["--mode", "offline"],
    "eval-protocol": ["--mode", "offline", "--eval-protocol", "tgb", "--eval-negatives", "20",
                      "--eval-prefix", "80"],
}  # fmt: skip
# the YAML under a flag's run (default SMALL_MODEL)
SLOW_YAML = {"offline": OFFLINE_YAML, "eval-protocol": TGB_YAML}


@pytest.mark.slow
@pytest.mark.parametrize("flag", sorted(SLOW_JOBS))
def test_job_flag_gives_the_same_run_on_both_backends(flag, ray_session, files, tmp_path):
    config = yaml_file(tmp_path / "run.yaml", SLOW_YAML.get(flag, SMALL_MODEL))
    paths = {**files, "config": config, "quarantine": str(tmp_path / "rejected.csv")}
    outs, grew = {}, False
    elastic = flag == "min:max"  # in float64: the group may grow during the run
    with float64_everywhere() if elastic else contextlib.nullcontext():
        for backend in BACKENDS:
            out = tmp_path / f"{flag}-{backend}"
            args = [*resolved([*SLOW_BASE, *SLOW_JOBS[flag]], paths), "--out", str(out)]
            assert job(args, backend) == 0
            if flag in ("offline", "eval-protocol"):
                outs[backend] = untimed(json.loads((out / "offline.json").read_text()))
                continue
            outs[backend] = job_outcome(out)
            grew |= any(r["phase"] == "resize" for r in records(out, membership=True))
    if grew:  # `--trainers 1:2` started below its maximum: the same run to summation order
        assert outs["ray"]["summary"]["trainers"] == 2
        assert_close_records(outs["local"]["records"], outs["ray"]["records"], flag)
        a, b = (outs[k]["group"]["trainers"][0]["model"] for k in BACKENDS)
        for key, x in a.items():
            assert rel(x, b[key]) < 1e-9 if x.is_floating_point() else torch.equal(x, b[key])
    else:
        assert_same_job(outs)


@pytest.mark.slow
def test_a_resumed_run_ends_as_an_uninterrupted_one_on_both_backends(ray_session, files, tmp_path):
    """The driver lost after phase 1 and an increment, the job run again with `--resume`:
    on either backend the run ends as the uninterrupted local one."""
    from tidegraph.jobs.train import parse_config

    config = yaml_file(tmp_path / "run.yaml", SMALL_MODEL)
    args = [*resolved(SLOW_BASE, {"config": config}), "--increments", "3",
            "--storage", str(tmp_path)]  # fmt: skip
    assert job([*args, "--run-name", "whole"], "local") == 0
    outs = {"whole": job_outcome(tmp_path / "whole")}
    for backend in BACKENDS:
        name = f"cut-{backend}"
        cfg = parse_config([*args, "--run-name", name, "--backend", backend])
        cfg.out_dir = str(tmp_path / name)
        threads = torch.get_num_threads()
        set_determinism(cfg.seed, 0, cfg.deterministic, cfg.threads)
        run = Orchestrator(cfg, run_dir=RunDir(str(tmp_path), name))
        try:
            for _ in range(3):  # the group, phase 1, an increment; then the driver is lost
                assert run.step() is RunState.RUNNING
        finally:
            run.close()
            set_determinism(7, 0, True, threads)
        assert job([*args, "--run-name", name, "--resume"], backend) == 0
        outs[backend] = job_outcome(tmp_path / name)
    for backend in BACKENDS:
        found = first_difference(outs["whole"], outs[backend])
        assert found is None, (backend, found)


# ---- every option is in both suites -----------------------------------------------------------

# fields derived from others (`cluster.trainers: {min, max}` sets them), and the backend itself
DERIVED = {"cluster.min_trainers", "cluster.max_trainers", "cluster.min_shards",
           "cluster.max_shards", "cluster.backend"}  # fmt: skip
# the job runs of each suite: their flags and the YAML file under them
DEFAULT_JOBS = [
    (JOB_ARGS, JOB_YAML),
    (OFFLINE_ARGS, OFFLINE_YAML),
    (TGB_ARGS, TPNET_TGB_YAML),
    (FOLLOW_DIR_ARGS, FOLLOW_DIR_YAML),
    (FOLLOW_FILE_ARGS, FOLLOW_FILE_YAML),
    (EDGEBANK_ARGS, {"model": {"edgebank_window": 1.0}}),
]
SLOW_JOB_RUNS = [([*SLOW_BASE, *args], SLOW_YAML.get(flag, SMALL_MODEL))
                 for flag, args in SLOW_JOBS.items()]  # fmt: skip


def config_fields() -> set[str]:
    """Every field of `RunConfig`, a section's as `section.field`."""
    default, out = RunConfig(), set()
    for f in dataclasses.fields(RunConfig):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out |= {f"{f.name}.{g.name}" for g in dataclasses.fields(value)}
        else:
            out.add(f.name)
    return out - DERIVED


class _AnyPath(dict):
    def __missing__(self, key: str) -> str:
        return f"/nowhere/{key}"


def job_fields(args: list[str], raw: dict, tmp: Path) -> set[str]:
    """The config fields a job's flags and YAML file set (with where it writes: --storage,
    --run-name, --out)."""
    paths = _AnyPath(config=yaml_file(tmp / "run.yaml", raw))
    where = ["--storage", "s", "--run-name", "r", "--out", "o"]
    ns = _parser().parse_args([*resolved(args, paths), *where])
    _config(ns)  # sets what the YAML and the flags asked for
    return set(ns.explicit)


def flags_of(runs) -> set[str]:
    return {a for args, _ in runs for a in args if a.startswith("-")} | set(PER_RUN)


def test_every_option_runs_on_both_backends_in_each_suite(tmp_path):
    """Every field of the run config and every flag of the job is run on both backends by
    the default suite (combined runs) and by the slow matrix (one at a time); a new option
    fails this until it is added to both."""
    fields = config_fields()
    base = explicit_fields(BASE)
    default = base.union(*(explicit_fields(c.over) for c in COMBINED),
                         *(job_fields(a, r, tmp_path) for a, r in DEFAULT_JOBS))  # fmt: skip
    slow = base.union(*(explicit_fields(c.over) for c in CASES),
                      *(job_fields(a, r, tmp_path) for a, r in SLOW_JOB_RUNS))  # fmt: skip
    assert fields - default == set(), "not in the default suite"
    assert fields - slow == set(), "not in the slow matrix"
    flags = {s for a in _parser()._actions for s in a.option_strings} - {"-h", "--help"}
    assert flags - flags_of(DEFAULT_JOBS) == set(), "flags not in the default suite"
    # --follow and its flags run in the default suite's runs alone (a live source per run)
    slow_flags = flags_of([*SLOW_JOB_RUNS, DEFAULT_JOBS[3], DEFAULT_JOBS[4]])
    assert flags - slow_flags == set(), "flags not in the slow matrix"
