"""Helpers of the serving tests: small runs with checkpoints, a reference learner at one of
them, and HTTP on loopback."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import torch

from tidegraph.orchestrator import Orchestrator, RunState
from tidegraph.orchestrator.rundir import RunDir
from tidegraph.storage.events import EventBatch
from tidegraph.training import ContinualLearner, RunConfig
from tidegraph.training.data import stream_for

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402
from test_job_submit import free_port  # noqa: E402,F401  (serving tests take it from here)


def run_config(model: str = "tgn", **cluster) -> RunConfig:
    raw = reference_run.reference_config(model)
    raw["data"]["max_events"] = 2000
    raw["continual"].update(num_increments=3, train_fraction=0.4)
    raw["model"]["slot_precision"] = "fp32"
    raw["cluster"] = {"backend": "local", "trainers": 2, "shards": 2, **cluster}
    raw["keep_checkpoints"] = 10
    return RunConfig.from_dict(raw)


def features_csv(path: Path, n: int = 2000) -> Path:
    """The first `n` Wikipedia events as a CSV of string ids ("u12", "i8300") with two edge
    features a, b (a function of the event's position): a run with `data.string_ids` and
    `data.features`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from tidegraph.training.data import load_stream

    ev = load_stream("wikipedia", n).events
    pos = np.arange(len(ev), dtype=np.float64)
    table = pa.table({
        "src": [f"u{x}" for x in ev.src.tolist()], "dst": [f"i{x}" for x in ev.dst.tolist()],
        "time": ev.t.numpy(), "a": np.sin(pos), "b": np.cos(0.5 * pos),
    })  # fmt: skip
    pacsv.write_csv(table, path)
    return path


def start_run(storage: Path, name: str, config: RunConfig) -> Orchestrator:
    """A run of `config` in `storage/name`, its group placed (step it on)."""
    run_dir = RunDir(str(storage), name)
    config.run_name, config.storage, config.out_dir = name, str(storage), run_dir.path
    orchestrator = Orchestrator(config, run_dir=run_dir)
    assert orchestrator.step() is RunState.RUNNING
    return orchestrator


def finish(orchestrator: Orchestrator) -> None:
    try:
        for _ in range(10_000):  # bounded: a few units per step
            if orchestrator.step() in (RunState.FINISHED, RunState.ERRORED):
                break
        assert orchestrator.error is None, orchestrator.error
    finally:
        orchestrator.close()


def make_run(storage: Path, name: str, config: RunConfig) -> Path:
    finish(start_run(storage, name, config))
    return storage / name


def reference_learner(source, tag: str) -> ContinualLearner:
    """The run's learner (local backend, its own W and P) at checkpoint `tag`, writing
    nothing."""
    config = RunConfig.from_dict(source.config())
    config.out_dir, config.progress = None, False
    learner = ContinualLearner(config, stream_for(config.data))
    learner.load_state_dict(source.checkpoints.load(tag)["learner"])
    return learner


def evaluate_next_increment(learner: ContinualLearner) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the learner's units through its next increment's evaluation pass (ingest, the
    node-state snapshot, every evaluation batch), stopping before the pass's end: its
    (pos, neg) logits."""
    for _ in range(10_000):
        unit = learner.schedule.unit(learner.cursor.unit)
        if unit.kind == "eval_end":
            break
        learner.run_unit(unit)
    ps = learner.pass_state
    return torch.cat(ps["pos"]), torch.cat(ps["neg"])


def learner_scores(learner: ContinualLearner, ev: EventBatch) -> torch.Tensor:
    """The learner's evaluation probabilities of events `ev` (dense ids) from its state now,
    recording nothing."""
    queries = EventBatch(ev.src, ev.dst, ev.t, torch.full_like(ev.src, -1))
    pos, _ = learner.group.eval_step(queries, torch.empty(len(ev), 0, dtype=torch.int64), False)
    return torch.sigmoid(pos)


def http(url: str, body=None, timeout: float = 60.0) -> tuple[int, dict]:
    """(status, JSON answer) of a GET (no body) or a POST of `body` (JSON, or raw bytes)."""
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
