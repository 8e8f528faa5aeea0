"""Run directories: the durable event log, checkpoints, resuming in a new process after the
driver died, and the errors that keep an earlier run's files safe."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tidegraph.jobs.train import main
from tidegraph.orchestrator import Orchestrator, RunState
from tidegraph.orchestrator.rundir import RunDir
from tidegraph.runtime import set_determinism
from tidegraph.storage.eventlog import EventLog
from tidegraph.storage.partition import build_partitioner
from tidegraph.training import RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
from logcheck import logged_counts  # noqa: E402

ARGS = ["--max-events", "2000", "--increments", "3", "--epochs", "1", "--no-progress",
        "--backend", "local", "--shards", "2", "--trainers", "2"]  # fmt: skip


def _main(args) -> int:
    threads = torch.get_num_threads()
    try:
        return main(args)
    finally:
        torch.set_num_threads(threads)


def records(path) -> list[dict]:
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in rows]


def test_a_resumed_run_ends_as_an_uninterrupted_one(tmp_path):
    assert _main(ARGS + ["--storage", str(tmp_path), "--run-name", "whole"]) == 0
    whole = tmp_path / "whole"
    # the same run, its driver lost after phase 1 and one increment (checkpoint after each)
    config = yaml.safe_load((whole / "config.yaml").read_text())
    config.update(run_name="cut", out_dir=str(tmp_path / "cut"), storage=str(tmp_path))
    cfg = RunConfig.from_dict(config)
    run_dir = RunDir(str(tmp_path), "cut")
    set_determinism(cfg.seed, 0, cfg.deterministic, cfg.threads)  # as the job does
    orchestrator = Orchestrator(cfg, run_dir=run_dir)
    for _ in range(3):  # SCHEDULING, phase 1, increment 1
        assert orchestrator.step() is RunState.RUNNING
    del orchestrator
    cmd = [sys.executable, "-m", "tidegraph.jobs.train", "--storage", str(tmp_path),
           "--run-name", "cut", "--resume"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cut = tmp_path / "cut"
    assert records(cut) == records(whole)  # metrics of every step, bitwise
    a, b = (json.loads((d / "summary.json").read_text()) for d in (whole, cut))
    assert a == b
    # the event log holds the stream, each event once, and every shard's count is the log's
    # events with an endpoint it owns (the partition function applied to the log here)
    logged = EventLog(str(cut)).read()
    stream = load_stream("wikipedia", 2000).events
    assert torch.equal(logged.src, stream.src) and torch.equal(logged.eid, stream.eid)
    assert torch.equal(logged.dst, stream.dst)  # and its ids are the run's node ids
    part = build_partitioner(cfg.cluster.partitioner, cfg.cluster.shards)
    assert b["partition"]["shard_events"] == logged_counts(logged.src, logged.dst, part)


def test_a_fresh_run_never_overwrites_a_run_and_bad_storage_fails_first(tmp_path, capsys):
    assert _main(ARGS + ["--storage", str(tmp_path), "--run-name", "r", "--increments", "1"]) == 0
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    assert _main(ARGS + ["--storage", str(tmp_path), "--run-name", "r"]) == 2
    assert "already holds a run: pass --resume" in capsys.readouterr().err
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before
    assert _main(ARGS + ["--storage", str(tmp_path), "--run-name", "new", "--resume"]) == 2
    assert "holds no run to resume" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert _main(ARGS + ["--storage", str(blocker), "--run-name", "x"]) == 2
    assert "storage: cannot write to" in capsys.readouterr().err


def test_event_log_is_atomic_per_batch_and_idempotent(tmp_path):
    events = load_stream("wikipedia", 500).events
    log = EventLog(str(tmp_path))
    log.append(events.select(slice(0, 200)), 0, 200)
    log.append(events.select(slice(300, 500)), 300, 500)
    assert log.offset == 200  # a gap: durable only up to it
    log.append(events.select(slice(200, 300)), 200, 300)
    log.append(events.select(slice(200, 300)), 200, 300)  # again, as a resumed run does
    assert log.offset == 500 and len(log.files()) == 3
    back = log.read(150, 450)
    assert torch.equal(back.eid, events.eid[150:450]) and torch.equal(back.t, events.t[150:450])
    assert not list(tmp_path.rglob("*.tmp"))
    with pytest.raises(ValueError, match="but 10 events"):
        log.append(events.select(slice(0, 10)), 0, 20)


STORED = RunConfig.from_dict({"model": {"name": "tgn"}, "continual": {"num_increments": 3}})

RESUMES = [
    # (given config fields, fields explicitly given, refused fields; [] when allowed)
    ({"model": {"name": "tgat"}}, {"model.name"}, ["model.name"]),
    ({"model": {"dim": 50}}, {"model.dim"}, ["model.dim"]),
    (
        {"continual": {"num_increments": 5}},
        {"continual.num_increments"},
        ["continual.num_increments"],
    ),  # fmt: skip
    (
        {"continual": {"increment_window": 60.0}},
        {"continual.increment_window"},
        ["continual.increment_window"],
    ),  # fmt: skip
    ({"data": {"dataset": "uci"}, "seed": 3}, {"data.dataset", "seed"}, ["data.dataset", "seed"]),
    ({"train": {"lr": 0.01}}, {"train"}, ["train.lr"]),  # a whole section asked for
    ({"comm": {"compression": "q8"}}, {"comm.compression"}, ["comm.compression"]),
    ({"model": {"name": "tgat"}}, set(), []),  # a default, not asked for: the stored one runs
    ({"threads": 4, "progress": False}, {"threads", "progress"}, []),
    ({"cluster": {"trainers": 4, "shards": 3}}, {"cluster.trainers", "cluster.shards"}, []),
    ({"checkpoint_every": 5, "run_name": "x"}, {"checkpoint_every", "run_name"}, []),
    ({"data": {"quarantine": "q.csv"}}, {"data.quarantine"}, []),
    ({}, {"model.name", "seed"}, []),  # asked for the stored values
]


@pytest.mark.parametrize("fields, explicit, refused", RESUMES)
def test_resuming_with_changed_fields_that_matter_is_refused_naming_them(fields, explicit, refused):
    from tidegraph.orchestrator.rundir import check_resume_config

    given = RunConfig.from_dict(fields).to_dict()
    if not refused:
        check_resume_config(STORED.to_dict(), given, explicit)
        return
    with pytest.raises(ValueError) as info:
        check_resume_config(STORED.to_dict(), given, explicit)
    message = str(info.value)
    assert "\n" not in message
    for field in refused:
        assert field in message
    assert "model.num_layers" not in message  # derived, not asked for


def test_explicit_fields_flatten_a_raw_config():
    from tidegraph.config_check import explicit_fields

    raw = {"model": {"name": "tgn"}, "cluster": {}, "seed": 1, "offline_split": [0.6, 0.2]}
    assert explicit_fields(raw) == {"model.name", "seed", "offline_split"}


def test_a_checkpoint_of_another_configuration_is_refused_naming_the_fields(tmp_path):
    run = RunDir(str(tmp_path), "r")
    config = STORED.to_dict()
    run.save_config(config)
    run.save_checkpoint({"config": config, "learner": {}}, "phase1")
    assert run.load_checkpoint()["learner"] == {}  # its own run's
    # the same run directory opened again (a resumed process) compares with config.yaml
    again = RunDir(str(tmp_path), "r", resume=True)
    assert again.load_checkpoint()["config"] == config
    other = RunConfig.from_dict({"model": {"dim": 50}, "train": {"batch_size": 100}}).to_dict()
    with pytest.raises(ValueError) as info:
        again.load_checkpoint(other)
    message = str(info.value)
    assert "model.dim (checkpoint 100, run 50)" in message
    assert "train.batch_size" in message and "phase1" in message and "\n" not in message
    neutral = dict(config, threads=8, cluster=dict(config["cluster"], trainers=5))
    assert again.load_checkpoint(neutral)["learner"] == {}
    # an older checkpoint (no configuration in it) still loads
    run.save_checkpoint({"learner": {"old": True}}, "increment-00001")
    assert again.load_checkpoint(other)["learner"] == {"old": True}


@pytest.mark.parametrize(
    "saved, loaded, words",
    [
        ({"name": "tgn"}, {"name": "tgn", "memory_dim": 50}, ["'memory'", "memory_dim"]),
        ({"name": "tgn"}, {"name": "apan"}, ["tables", "model.name"]),
    ],
)
def test_shard_node_state_of_another_model_is_refused_naming_the_table(saved, loaded, words):
    from tidegraph.models.config import ModelConfig, build_model
    from tidegraph.training.state import ShardNodeState

    def shard(fields):
        return ShardNodeState(build_model(ModelConfig(**fields), 0))

    a = shard(saved)
    a.add_nodes(torch.tensor([3, 5]))
    state = a.state_dict()
    shard(saved).load_state_dict(state)  # the same model loads it
    with pytest.raises(ValueError) as info:
        shard(loaded).load_state_dict(state)
    for word in words:
        assert word in str(info.value)
