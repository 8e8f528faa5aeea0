"""Runs that restart from their newest checkpoint (README, "Failures"): every trainer of a
Ray run SIGKILLed from outside at once (no replica is left, so the orchestrator starts a new
group from the newest checkpoint), and the driver of a Ray job SIGKILLed mid-run, then the
same command with --resume. Both replay the training steps logged since the checkpoint
(`cluster.update_log_every`) instead of computing them, and end bitwise as a run that was not
interrupted: parameters, optimizer, node state, shards and metrics.

The fault-free runs are made on the local backend (the same shards and trainers in this
process, bitwise what the Ray actors give: test_ray.py), which takes seconds instead of a
group of actors' start. In the default suite the jobs join this module's Ray, as jobs
submitted to a cluster do; the slow test starts a local Ray per job (token authentication on
and off) under a temporary directory, where every process of it is found and stopped by id."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from tidegraph.jobs.train import main
from tidegraph.orchestrator import Orchestrator, RunState
from tidegraph.orchestrator.cluster import until
from tidegraph.orchestrator.ray_group import RayGroup
from tidegraph.orchestrator.rundir import RunDir
from tidegraph.recovery.updatelog import logged_steps
from tidegraph.runtime import set_determinism
from tidegraph.storage.eventlog import EventLog
from tidegraph.training import ContinualLearner, RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402
from logcheck import assert_held_as_logged, node_rows  # noqa: E402
from recovery_run import assert_same_run, finish, outcome  # noqa: E402
from runstate import RAY_ONLY, assert_same_state, final_state, records  # noqa: E402
from test_job_submit import cluster_pids, stop_cluster  # noqa: E402
from threads import Watched  # noqa: E402

# ---- every trainer lost ------------------------------------------------------------------

CHECKPOINT = "increment-00001"  # the newest checkpoint when the trainers are killed
LOGGED = 2  # steps logged since it before the kill (of the 12 of the last retraining)


def config(**cluster) -> RunConfig:
    raw = reference_run.reference_config("tgn")
    raw["model"]["slot_precision"] = "fp32"
    raw["train"]["batch_size"] = 50
    raw["continual"]["retrain_epochs"] = 2  # a retraining long enough to be cut inside
    # one shard: the claim is about trainers, and every actor is a process start (seconds)
    raw["cluster"] = {"backend": "ray", "trainers": 2, "shards": 1, **cluster}
    raw["run_name"] = "tidegraph-kill-all-test"
    return RunConfig.from_dict(raw)


def local_run(cfg: RunConfig, stream, where: Path) -> dict:
    """The fault-free run on the local backend, read as `recovery_run.outcome` reads a run:
    once every partition was found to hold exactly the events of its event log."""
    raw, c = cfg.to_dict(), cfg.cluster
    raw["cluster"] = {"backend": "local", "trainers": c.trainers, "shards": c.shards}
    set_determinism(7, threads=1)
    log = EventLog(str(where))
    learner = ContinualLearner(RunConfig.from_dict(raw), stream, event_log=log)
    learner.run_phase1()
    while not learner.done:
        learner.step()
    group = learner.group
    shards = group.shard_states()
    counts = assert_held_as_logged(shards, group.partitioner, log, learner.stream.idmap,
                                   learner.cursor.ingested)  # fmt: skip
    report = group.report(stream.events.src, stream.events.dst)
    assert report["shard_events"] == counts
    return {"model": group.model_state(), "history": learner.history,
            "node_rows": [node_rows(s["node_state"]) for s in shards],
            "steps": learner.cursor.step, "shard_events": report}  # fmt: skip


def freeze_and_kill(pids: list[int]) -> None:
    """SIGSTOP every process, then SIGKILL them: the driver finds them all dead at once
    (never one replaced from another still alive)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def test_every_trainer_sigkilled_from_outside_restarts_from_the_newest_checkpoint(
    ray_session, tmp_path, monkeypatch
):
    stream = load_stream("wikipedia", 1500)
    want = local_run(config(), stream, tmp_path / "fault-free")
    monkeypatch.setattr(RayGroup, "progress_s", 0.01)
    cfg = config(update_log_every=1)
    cfg.checkpoint_every = 1
    run_dir = RunDir(str(tmp_path), "kill-all")
    loaded: list[str | None] = []  # the checkpoint each group start read
    read = run_dir.load_checkpoint

    def load_checkpoint(*args, **kwargs) -> dict:
        loaded.append(run_dir.latest_name())
        return read(*args, **kwargs)

    monkeypatch.setattr(run_dir, "load_checkpoint", load_checkpoint)
    updates = f"{run_dir.path}/updates"
    set_determinism(7, threads=1)
    orchestrator = Orchestrator(cfg, stream, run_dir=run_dir)
    seen: dict = {}
    stop = threading.Event()

    def kill_every_trainer() -> None:
        learner = orchestrator.learner
        units = learner.schedule.units  # the steps before the last increment's retraining
        since = sum(1 for u in units if u.kind == "train" and u.increment < 1)
        pids = ray.get([t.pid.remote() for t in learner.group.trainers], timeout=60)
        for _ in range(60_000):  # bounded: until steps since the checkpoint are logged
            if stop.is_set():
                return
            if (run_dir.latest_name() == CHECKPOINT
                    and len(logged_steps(updates, since)) >= LOGGED):  # fmt: skip
                freeze_and_kill(pids)
                seen.update(since=since, logged=logged_steps(updates, since))
                return
            time.sleep(0.005)
        raise AssertionError("the run never logged steps after its second checkpoint")

    thread = Watched(kill_every_trainer)
    try:
        assert orchestrator.step() is RunState.RUNNING  # the group is up
        thread.start()
        finish(orchestrator)
        got = outcome(orchestrator.learner, run_dir.event_log())
        replayed = orchestrator.learner.group.replay_stats()["replayed"]
    finally:
        stop.set()
        try:
            if thread.ident is not None:
                thread.join(30)  # raises what the thread raised
        finally:
            orchestrator.close()
    assert "logged" in seen, "the trainers were never killed"
    # one restart, from the checkpoint that was newest when the trainers died, which
    # replayed every step logged since it (those before the kill), in order
    assert orchestrator.restarts == 1
    assert loaded == [CHECKPOINT]
    plan = orchestrator.replay_plan
    assert plan == seen["logged"] and len(plan) >= LOGGED
    assert plan == list(range(seen["since"], seen["since"] + len(plan)))
    assert replayed == len(plan)
    assert_same_run(got, want)


# ---- the driver lost, the job resumed ----------------------------------------------------

REPLAYING = re.compile(r"replaying (\d+) logged training steps \(of steps (\d+)\.\.(\d+)\)")


def job_args(events: int, increments: int, yaml_path: Path, split: int) -> list[str]:
    """`split` shards and as many trainers."""
    return ["--max-events", str(events), "--increments", str(increments), "--epochs", "1",
            "--no-progress", "--shards", str(split), "--trainers", str(split), "--config",
            str(yaml_path), "--metrics-port", "-1"]  # fmt: skip


def write_yaml(tmp_path: Path, batch_size: int) -> Path:
    """Small batches (steps enough to cut a pass inside) and an update log of every step."""
    path = tmp_path / "run.yaml"
    path.write_text(f"train:\n  batch_size: {batch_size}\ncluster:\n  update_log_every: 1\n")
    return path


def in_process(args: list[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)


class OwnRay:
    """Jobs that start a local Ray each, under `ray_tmp` (a short path: socket paths have a
    length limit); `auth`: Ray's token authentication ("token", "disabled"; None: as this
    environment has it)."""

    def __init__(self, ray_tmp: str, auth: str | None = None) -> None:
        self.ray_tmp = ray_tmp
        self.env = {**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp}
        if auth is not None:
            self.env["RAY_AUTH_MODE"] = auth

    def poll(self) -> None:
        pass

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL the driver and every process of its Ray at once: all are stopped first
        (SIGSTOP), so that none goes on working (a trainer finishing its pass) while the rest
        die; Ray's workers are found as descendants of its raylet before it dies (they are
        in process groups of their own)."""
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGSTOP)  # the driver and its process group
        pids = cluster_pids(self.ray_tmp)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        stop_cluster(self.ray_tmp)  # anything left, by id


class Joined:
    """Jobs that join this process's Ray, as jobs submitted to a cluster do: a killed driver's
    actors are ended by Ray (they are owned by it); `actors`: its trainers and shard actors."""

    def __init__(self, namespace: str, actors: int) -> None:
        self.env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        self.namespace, self.actors = namespace, actors
        self.pids: list[int] | None = None

    def poll(self) -> None:
        """Once the run's trainers and shard actors are up, their process ids (asked early:
        an actor answers after the pass it runs)."""
        if self.pids is not None:
            return
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == self.namespace
                 and a["name"].startswith(("tidegraph-trainer-", "tidegraph-shard-"))]  # fmt: skip
        if len(names) == self.actors:
            actors = [ray.get_actor(n, namespace=self.namespace) for n in names]
            self.pids = ray.get([a.pid.remote() for a in actors], timeout=120)

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL the driver; wait (bounded) until Ray has ended the processes of its
        actors, so that none writes to the run directory any more."""
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert self.pids is not None, "the run's actors were never seen"
        until(lambda: not any(map(_running, self.pids)), 120, "the killed driver's actors to end")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def ray_tmp():
    """A directory for jobs' own Rays; what is left of them is stopped by process id."""
    path = tempfile.mkdtemp(prefix="tgres", dir="/tmp")
    try:
        yield path
    finally:
        stop_cluster(path)
        shutil.rmtree(path, ignore_errors=True)
    assert cluster_pids(path) == []


JOB = [sys.executable, "-m", "tidegraph.jobs.train", "--backend", "ray"]


def cut_and_resume(cmd: list[str], jobs, run: Path, cut_at: str,
                   logged: int) -> tuple[list[int], str]:  # fmt: skip
    """Start the job, SIGKILL its driver (`jobs.kill`) once the newest checkpoint is `cut_at`
    and `logged` steps since it are in the update log, then run the same command with
    --resume. Returns (the steps logged since that checkpoint when the job was killed, the
    resumed job's stderr)."""
    latest, updates = run / "checkpoints" / "latest", run / "updates"
    log = run.parent / f"{run.name}-killed.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=jobs.env, stdout=subprocess.DEVNULL, stderr=out,
                                start_new_session=True)  # fmt: skip
    try:
        since, deadline = None, time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:  # bounded
            jobs.poll()
            if since is None and latest.exists() and latest.read_text() == cut_at:
                since = final_state(run, cut_at)["orchestrator"]["cursor"]["step"]
            if since is not None and len(logged_steps(updates, since)) >= logged:
                break
            time.sleep(0.005)
        assert proc.poll() is None, f"the run ended before it was cut: {log.read_text()[-3000:]}"
    finally:
        jobs.kill(proc)
    assert latest.read_text() == cut_at  # no checkpoint came after the cut
    plan = logged_steps(updates, since)
    done = subprocess.run(cmd + ["--resume"], env=jobs.env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return plan, done.stderr


def assert_replayed(stderr: str, plan: list[int]) -> None:
    """The resumed job started from the checkpoint the killed one wrote last and replayed
    every step logged since it, in order."""
    assert plan == list(range(plan[0], plan[0] + len(plan))), plan
    found = REPLAYING.findall(stderr)
    assert [tuple(map(int, f)) for f in found] == [(len(plan), plan[0], plan[-1])], stderr[-3000:]


def test_a_ray_job_killed_mid_increment_resumes_to_the_uninterrupted_state(ray_session, tmp_path):
    """A short run with one shard and one trainer (each actor is a process start), joining
    this module's Ray: killed in its first increment's retraining, after the phase-1
    checkpoint and two logged steps; compared with the same run on the local backend,
    uninterrupted."""
    args = job_args(1500, 2, write_yaml(tmp_path, 50), split=1)
    in_process([*args, "--backend", "local", "--storage", str(tmp_path), "--run-name", "whole"])
    cmd = [*JOB, *args, "--storage", str(tmp_path), "--run-name", "cut", "--checkpoint-every", "1"]
    plan, stderr = cut_and_resume(cmd, Joined("cut", 2), tmp_path / "cut", "phase1", logged=2)
    assert len(plan) >= 2
    assert_replayed(stderr, plan)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert_same_state(final_state(cut), final_state(whole), ignore=RAY_ONLY)
    assert records(cut) == records(whole)


@pytest.mark.slow
@pytest.mark.parametrize("auth", ["token", "disabled"])
def test_a_ray_job_killed_between_checkpoints_resumes_to_the_uninterrupted_state(
    tmp_path, ray_tmp, auth
):
    """Longer, each job with a local Ray of its own (with Ray's token authentication on and
    off): checkpoints every other increment, the driver and its Ray killed in the second
    increment (12 steps logged since the phase-1 checkpoint, of 10 a retraining). The resumed
    run ends bitwise as an uninterrupted Ray run (every piece of the group's state) and as
    the same run on the local backend."""
    args = job_args(2000, 3, write_yaml(tmp_path, 50), split=2)
    in_process([*args, "--backend", "local", "--storage", str(tmp_path), "--run-name", "local"])
    jobs = OwnRay(ray_tmp, auth)
    storage = ["--storage", str(tmp_path), "--checkpoint-every", "2"]
    done = subprocess.run([*JOB, *args, *storage, "--run-name", "whole"], env=jobs.env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    stop_cluster(ray_tmp)
    cmd = [*JOB, *args, *storage, "--run-name", "cut"]
    plan, stderr = cut_and_resume(cmd, jobs, tmp_path / "cut", "phase1", logged=12)
    assert len(plan) >= 12
    assert_replayed(stderr, plan)
    local, whole, cut = (tmp_path / n for n in ("local", "whole", "cut"))
    assert_same_state(final_state(cut), final_state(whole))
    assert_same_state(final_state(cut), final_state(local), ignore=RAY_ONLY)
    assert records(cut) == records(whole) == records(local)
