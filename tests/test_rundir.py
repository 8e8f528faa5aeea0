"""Run directories: the durable event log, checkpoints, resuming in a new process after the
driver died, and the errors that keep an earlier run's files safe."""

import json
import subprocess
import sys

import pytest
import torch
import yaml

from tidegraph.jobs.train import main
from tidegraph.orchestrator import Orchestrator, RunState
from tidegraph.orchestrator.rundir import RunDir
from tidegraph.runtime import set_determinism
from tidegraph.storage.eventlog import EventLog
from tidegraph.training import RunConfig, load_stream

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
    # the event log holds the stream, each event once, and every shard's count matches it
    logged = EventLog(str(cut)).read()
    stream = load_stream("wikipedia", 2000).events
    assert torch.equal(logged.src, stream.src) and torch.equal(logged.eid, stream.eid)
    assert sum(b["partition"]["shard_events"]) >= len(stream)


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


@pytest.mark.slow
def test_a_ray_run_whose_driver_is_killed_resumes_to_the_local_result(tmp_path):
    """The driver process dies (SIGKILL) after its first checkpoints; the same command with
    --resume in a new process ends with the metrics an uninterrupted local run gives."""
    import os
    import signal
    import time

    assert _main(ARGS + ["--storage", str(tmp_path), "--run-name", "local"]) == 0
    ray_args = [a if a != "local" else "ray" for a in ARGS]  # --backend ray
    cmd = [sys.executable, "-m", "tidegraph.jobs.train", *ray_args, "--storage", str(tmp_path),
           "--run-name", "cut", "--metrics-port", "-1"]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    latest = tmp_path / "cut" / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().startswith("increment"):
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be cut"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started
    proc.wait(timeout=30)
    done = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert records(tmp_path / "cut") == records(tmp_path / "local")
