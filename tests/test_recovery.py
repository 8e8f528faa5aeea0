"""Trainer recovery on Ray: a lost trainer is replaced from a surviving replica, with no
rollback, and the run ends exactly where a fault-free run ends."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from tidegraph.orchestrator import Orchestrator, RunState
from tidegraph.orchestrator.ray_group import RayGroup
from tidegraph.orchestrator.rundir import RunDir
from tidegraph.recovery import NoReplicaLeft
from tidegraph.runtime import set_determinism
from tidegraph.storage.checkpoint import CheckpointStore
from tidegraph.training import RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402
from recovery_run import assert_same_run, finish, outcome, reference, run  # noqa: E402
from threads import Watched  # noqa: E402


def slow(*values):
    """A parameter set of the slow suite."""
    return pytest.param(*values, marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", 1500)


def config(faults=(), trainers: int = 2, shards: int = 2, **cluster) -> RunConfig:
    raw = reference_run.reference_config("tgn")
    raw["model"]["slot_precision"] = "fp32"
    raw["train"]["batch_size"] = 50  # more steps per pass
    raw["cluster"] = {"backend": "ray", "trainers": trainers, "shards": shards,
                      "faults": list(faults), **cluster}  # fmt: skip
    raw["run_name"] = "tidegraph-recovery-test"
    return RunConfig.from_dict(raw)


@pytest.fixture(scope="module")
def fault_free(wiki):
    return reference(config(), wiki)


# slow: the default suite loses trainers in their forward pass and at their all-reduce in
# test_failures_one_after_another_end_as_the_fault_free_run (sources and steps done asserted)
@pytest.mark.slow
@pytest.mark.parametrize(("at", "done"), [("forward", 3), ("allreduce", 3), ("after_step", 4)])
def test_a_trainer_dying_in_a_step_is_replaced_from_a_replica_bitwise(
    ray_session, wiki, fault_free, at, done
):
    got = run(config([{"trainer": 1, "step": 3, "at": at}]), wiki)
    (event,) = got["recoveries"]
    assert event["lost"] == [1] and event["source"] == 0
    assert event["steps_done"] == done  # the survivor's whole steps: none is repeated
    assert got["trainer_steps"] == [fault_free["steps"]] * 2
    assert_same_run(got, fault_free)


def overlapped(faults=()) -> RunConfig:
    """`config` with gradient buckets sent during backward (q8, some buckets exact)."""
    cfg = config(faults)
    comm = {"compression": "q8", "warmup_steps": 2, "min_bucket_bytes": 4096, "codec": "eager",
            "chunk_size": 64, "bucket_bytes": 16_384, "overlap": True}  # fmt: skip
    cfg.comm = RunConfig.from_dict({"comm": comm}).comm
    return cfg


@pytest.fixture(scope="module")
def overlapped_free(ray_session, wiki):
    return run(overlapped(), wiki)


# slow: the default suite has a trainer lost at its all-reduce with buckets sent in backward
# (q8) in test_backends' combined run "tgn+cluster+q8", bitwise to the local backend's run
@pytest.mark.slow
@pytest.mark.parametrize("at", ["forward", "allreduce"])
def test_a_trainer_dying_while_its_buckets_are_under_way_is_replaced_bitwise(
    ray_session, wiki, overlapped_free, at
):
    """`comm.overlap`: gradient buckets leave during backward, so a trainer dying before its
    backward or at its all-reduce leaves its peer inside collectives already started; the
    recovered run ends as the fault-free one of the same config."""
    got = run(overlapped([{"trainer": 1, "step": 3, "at": at}]), wiki)
    (event,) = got["recoveries"]
    assert event["lost"] == [1]
    assert_same_run(got, overlapped_free)


@pytest.mark.slow  # the default suite has it in test_failures_one_after_another_...
def test_two_failures_in_a_row_the_second_of_a_replacement_source(ray_session, wiki, fault_free):
    faults = [
        {"trainer": 1, "step": 2, "at": "forward"},
        {"trainer": 0, "step": 9, "at": "allreduce"},
    ]  # noqa: E501
    got = run(config(faults), wiki)
    assert [(e["lost"], e["source"]) for e in got["recoveries"]] == [([1], 0), ([0], 1)]
    assert [e["generation"] for e in got["recoveries"]] == [1, 2]
    assert_same_run(got, fault_free)


@pytest.mark.slow  # the default suite has it in test_failures_one_after_another_...
def test_a_trainer_sigkilled_from_outside_mid_pass_is_replaced(
    ray_session, wiki, fault_free, quick_polls
):
    got = run(config(), wiki, during=kill_when(4, lambda g: g.trainers[1]))
    assert [e["lost"] for e in got["recoveries"]] == [[1]]
    assert_same_run(got, fault_free)


# slow: the default suite restarts from the newest checkpoint and replays every logged step
# after every trainer is SIGKILLed from outside (test_checkpoint_restart, bitwise, the plan
# and the replayed count asserted); every trainer lost to the fault knob: NoReplicaLeft below
@pytest.mark.slow
@pytest.mark.parametrize("log_every", [0, 1, 2])
def test_losing_every_trainer_restarts_the_group_from_the_last_checkpoint(
    ray_session, wiki, fault_free, tmp_path, log_every
):
    """No replica left: the orchestrator starts a new group from the newest checkpoint (after
    the previous increment) and computes the steps since it again, to the same end; with an
    update log (every step, or every other one) the logged steps are replayed from it
    instead (optimizer step with the logged gradient, logged node-state updates)."""
    late = fault_free["steps"] - 2  # in the last increment's retraining
    cfg = config([{"trainer": w, "step": late, "at": "forward"} for w in (0, 1)],
                 update_log_every=log_every)  # fmt: skip
    cfg.checkpoint_every = 1
    set_determinism(7, threads=1)
    orchestrator = Orchestrator(cfg, wiki, run_dir=RunDir(str(tmp_path), "restart"))
    try:
        finish(orchestrator)
        assert orchestrator.restarts == 1
        learner = orchestrator.learner
        plan = orchestrator.replay_plan
        if log_every:  # steps since the checkpoint, up to the failure, logged and replayed
            assert plan and plan[-1] < late and all(s % log_every == 0 for s in plan)
            assert learner.group.replay_stats()["replayed"] == len(plan)
        else:
            assert plan == []
        got = outcome(learner, orchestrator.run_dir.event_log())
    finally:
        orchestrator.close()
    assert_same_run(got, fault_free)


def test_losing_every_trainer_without_a_run_directory_is_no_replica_left(ray_session, wiki):
    faults = [{"trainer": w, "step": 3, "at": "forward"} for w in (0, 1)]
    with pytest.raises(NoReplicaLeft, match="all 2 trainers were lost"):
        run(config(faults), wiki)


def kill_when(progress: int, actor_of):
    """A `during` for `run`: SIGKILL the process of `actor_of(group)` once trainers report
    `progress` steps of a pass."""

    def during(learner) -> None:
        group = learner.group
        pid = ray.get(actor_of(group).pid.remote())
        for _ in range(6000):  # bounded: until training has made some progress
            if ray.get(group.coordinator.progress.remote()) >= progress:
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    return during


def kill_after(learner, actor_of, recovered: int) -> bool:
    """SIGKILL the process of `actor_of(group)` once the group has `recovered` recoveries
    behind it and its trainers report 4 steps of a later stretch of training; False when
    the run ended first."""
    group = learner.group
    for _ in range(24000):  # bounded: until the earlier failures are recovered
        if len(group.recoveries) >= recovered or learner.done:
            break
        time.sleep(0.005)
    base = ray.get(group.coordinator.progress.remote())
    pid = ray.get(actor_of(group).pid.remote())
    for _ in range(6000):  # bounded: a few steps into the stretch under way
        if learner.done:
            return False
        progress = ray.get(group.coordinator.progress.remote())
        if progress >= 4 and progress != base:
            os.kill(pid, signal.SIGKILL)
            return True
        time.sleep(0.005)
    return False


@pytest.mark.slow  # the default suite has it in test_failures_one_after_another_...
def test_a_shard_sigkilled_mid_pass_is_rebuilt_from_the_log_exactly(
    ray_session, wiki, fault_free, quick_polls
):
    got = run(config(), wiki, during=kill_when(4, lambda g: g.shards[1]))
    rebuilt = [e for e in got["recoveries"] if "events" in e]
    assert [e["lost_shards"] for e in rebuilt] == [[1]]
    assert_same_run(got, fault_free)  # including every shard's event count


def test_a_live_run_holding_only_its_window_rebuilds_a_lost_shard_from_the_log(
    ray_session, wiki, quick_polls
):
    """A followed run's driver holds no event it has learned (checked after each increment:
    `live`); a shard SIGKILLed in the last increment is rebuilt by routing phase 1 and the
    first increment again, read back from the durable log, and the increment under way from
    memory: every partition holds the log's events, and the run ends bitwise as the
    fault-free one."""

    def during(learner) -> None:
        for _ in range(24000):  # bounded: until the last increment is under way
            if learner.cursor.increment >= 1 or learner.done:
                break
            time.sleep(0.005)
        assert kill_after(learner, lambda g: g.shards[1], 0), "the run ended before the kill"

    want = reference(config(), wiki, live=True)
    got = run(config(), wiki, during=during, live=True)
    (rebuilt,) = [e for e in got["recoveries"] if "events" in e]
    assert rebuilt["lost_shards"] == [1] and rebuilt["replayed_batches"] == 3
    assert_same_run(got, want)


def test_failures_one_after_another_end_as_the_fault_free_run(
    ray_session, wiki, fault_free, quick_polls
):
    """Four failures in one run, each after the last was recovered: trainer 1 dies in its
    forward at step 2 (replaced from trainer 0), trainer 0 at its all-reduce at step 9 (the
    replacement's source: replaced from the replacement), trainer 1's process is SIGKILLed
    from outside mid-pass, then shard 1's (rebuilt from the log). The run ends bitwise as
    the fault-free one, every shard holding the log's events. (Each failure alone: the slow
    tests above.)"""
    faults = [
        {"trainer": 1, "step": 2, "at": "forward"},
        {"trainer": 0, "step": 9, "at": "allreduce"},
    ]
    killed = []

    def during(learner) -> None:
        for victim, after in ((lambda g: g.trainers[1], 2), (lambda g: g.shards[1], 3)):
            if not kill_after(learner, victim, after):
                return
            killed.append(victim)

    got = run(config(faults), wiki, during=during)
    assert len(killed) == 2, killed  # both kills from outside happened
    trainers = [e for e in got["recoveries"] if e.get("lost")]
    assert [(e["lost"], e["source"]) for e in trainers[:2]] == [([1], 0), ([0], 1)]
    # the survivors' whole steps of the pass under way: none is repeated (a forward fault
    # at step 2 leaves 2 done; the pass goes on from there, and an all-reduce fault at step
    # 9 leaves 7 of it done)
    assert [e["steps_done"] for e in trainers[:2]] == [2, 9 - 2]
    assert got["trainer_steps"] == [fault_free["steps"]] * 2
    assert [e["generation"] for e in trainers[:2]] == [1, 2]
    assert [e["lost"] for e in trainers[2:]] == [[1]]
    rebuilt = [e for e in got["recoveries"] if "events" in e]
    assert [e["lost_shards"] for e in rebuilt] == [[1]]
    assert_same_run(got, fault_free)  # including every shard's event count


def orchestrated(cfg: RunConfig, wiki, tmp_path, name: str, due) -> tuple[dict, object, int]:
    """A whole run through the orchestrator, with a checkpoint after every increment, and
    shard 1's process SIGKILLed once `due(learner)`; (results, learner, restarts)."""
    cfg.checkpoint_every = 1
    set_determinism(7, threads=1)
    orchestrator = Orchestrator(cfg, wiki, run_dir=RunDir(str(tmp_path), name))
    killed = threading.Event()

    def kill_later() -> None:
        for _ in range(60000):  # bounded
            learner = orchestrator.learner
            if learner is not None and due(learner):
                os.kill(ray.get(learner.group.shards[1].pid.remote()), signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.001)

    default, RayGroup.progress_s = RayGroup.progress_s, 0.01
    thread = Watched(kill_later)
    thread.start()
    try:
        finish(orchestrator)
        learner = orchestrator.learner
        got = outcome(learner, orchestrator.run_dir.event_log())
    finally:
        RayGroup.progress_s = default
        try:
            thread.join(30)  # raises what the thread raised
        finally:
            orchestrator.close()
    assert killed.is_set()
    moves = [(a.value, b.value) for a, b, _, _ in orchestrator.transitions]
    assert ("running", "recovering") in moves, moves  # the group told the controller
    return got, learner, orchestrator.restarts


@pytest.mark.slow  # the default suite: the journal test below (snapshot, then the batches since)
def test_a_lost_shard_restarts_from_its_checkpoint_snapshot(
    ray_session, wiki, fault_free, tmp_path
):
    """With a run directory, a shard lost after some increments starts from its state in the
    newest checkpoint and only the batches ingested since are routed to it again; the run
    ends bitwise as the fault-free one, every shard holding the log's events."""
    got, learner, _ = orchestrated(config(), wiki, tmp_path, "snapshot",
                                   lambda learner: learner.cursor.increment >= 2)  # fmt: skip
    rebuilt = [e for e in learner.group.recoveries if "snapshot" in e]
    (event,) = rebuilt
    assert event["lost_shards"] == [1] and event["snapshot"]
    assert event["replayed_batches"] < len(learner.group.ingests)
    assert_same_run(got, fault_free)


@pytest.mark.slow  # the default suite: test_a_lost_replica_then_a_lost_primary_...
def test_a_lost_shard_with_a_replica_is_replaced_by_it_exactly(
    ray_session, wiki, fault_free, quick_polls
):
    """`cluster.shard_replicas: 2`: shard 1 SIGKILLed mid-pass; its replica (which took
    every ingest) takes its place without replaying the log, and the run is bitwise the
    fault-free one with every shard holding the log's events."""
    got = run(config(shard_replicas=2), wiki, during=kill_when(4, lambda g: g.shards[1]))
    promoted = [e for e in got["recoveries"] if e.get("promoted")]
    assert [e["promoted"] for e in promoted] == [[1]]
    assert not [e for e in got["recoveries"] if "events" in e and not e.get("promoted")]
    assert_same_run(got, fault_free)


@pytest.mark.slow  # the default suite: test_a_lost_replica_then_a_lost_primary_...
def test_a_lost_replica_is_dropped_and_the_run_goes_on(ray_session, wiki, fault_free, quick_polls):
    """A replica SIGKILLed: the next write finds it gone, the group drops it (a new one
    starts in the background) and nothing else changes."""
    got = run(config(shard_replicas=2), wiki,
              during=kill_when(4, lambda g: g.replicas[0][0]))  # fmt: skip
    assert [e.get("lost_replicas") for e in got["recoveries"]] == [[[0, 0]]]
    assert not got["recoveries"][0]["lost_shards"] and not got["recoveries"][0]["lost"]
    assert_same_run(got, fault_free)


def test_a_lost_replica_then_a_lost_primary_change_nothing(
    ray_session, wiki, fault_free, quick_polls
):
    """`cluster.shard_replicas: 2`: shard 0's replica is SIGKILLed (the next write finds it
    gone, the group drops it and starts a new one in the background), then shard 1's
    primary, whose replica (which took every ingest) takes its place without replaying the
    log. The run is bitwise the fault-free one with every shard holding the log's events."""
    killed = []

    def during(learner) -> None:
        kill_when(4, lambda g: g.replicas[0][0])(learner)
        killed.append("replica")
        if kill_after(learner, lambda g: g.shards[1], 1):
            killed.append("primary")

    got = run(config(shard_replicas=2), wiki, during=during)
    assert killed == ["replica", "primary"]
    first = got["recoveries"][0]
    assert first.get("lost_replicas") == [[0, 0]]
    assert not first["lost_shards"] and not first["lost"]
    promoted = [e for e in got["recoveries"] if e.get("promoted")]
    assert [e["promoted"] for e in promoted] == [[1]]
    assert not [e for e in got["recoveries"] if "events" in e and not e.get("promoted")]
    assert_same_run(got, fault_free)


CHAOS_COMM = {
    "fp32": {},
    # 8-bit gradients in two cost-model buckets, sent during backward
    "q8-overlap": {"compression": "q8", "overlap": True, "bucketing": "cost_model"},
}


@pytest.mark.slow
@pytest.mark.parametrize("comm", list(CHAOS_COMM))
def test_chaos_a_seeded_schedule_of_kills_ends_as_the_fault_free_run(ray_session, tmp_path, comm):
    """Trainers and shards SIGKILLed at seeded random times over a run of a few minutes (the
    default job's stream and model); the run must end bitwise as the fault-free one, every
    shard holding its events. Kills can take both replicas before a replacement has a copy:
    the orchestrator then restarts from the newest checkpoint."""
    stream = load_stream("wikipedia", None)
    cfg = RunConfig.from_dict({
        "model": {"name": "tgn"}, "data": {"dataset": "wikipedia"},
        "train": {"batch_size": 200}, "continual": {"num_increments": 10},
        "cluster": {"backend": "ray", "trainers": 2, "shards": 2},
        "progress": False, "out_dir": None, "seed": 7, "run_name": "tidegraph-chaos-test",
        "checkpoint_every": 1, "comm": CHAOS_COMM[comm],
    })  # fmt: skip
    want = run(cfg, stream)
    rng = random.Random(2026)
    # the schedule, drawn before the run: (seconds after the previous kill, kind, index)
    schedule = [(rng.uniform(2.0, 8.0), rng.choice(["trainer", "shard"]), rng.randrange(2))
                for _ in range(12)]  # fmt: skip
    kills, finished = [], threading.Event()

    def kill(orchestrator, kind: str, index: int) -> int:
        """SIGKILL the process of that trainer or shard; tried again (bounded) while it has
        none to kill: between groups (a restart from a checkpoint), or while that actor is
        being replaced. A kill that cannot be made fails the test."""
        deadline = time.monotonic() + 180
        while True:
            try:
                group = orchestrator.learner.group  # None between groups
                actors = group.trainers if kind == "trainer" else group.shards
                pid = ray.get(actors[index].pid.remote(), timeout=10)
                os.kill(pid, signal.SIGKILL)
                return pid
            except (AttributeError, ray.exceptions.RayError, ProcessLookupError) as exc:
                if finished.is_set() or time.monotonic() > deadline:
                    which = f"kill {len(kills) + 1} of {len(schedule)} ({kind} {index})"
                    raise AssertionError(f"{which} could not be made: {exc!r}") from exc
                time.sleep(0.5)

    def chaos(orchestrator) -> None:
        for pause, kind, index in schedule:
            if finished.wait(pause):
                raise AssertionError(f"the run ended after {len(kills)} of {len(schedule)} "
                                     "planned kills")  # fmt: skip
            kill(orchestrator, kind, index)
            kills.append((round(time.monotonic(), 1), kind, index))

    set_determinism(7, threads=1)
    orchestrator = Orchestrator(cfg, stream, run_dir=RunDir(str(tmp_path), "chaos"))
    thread = Watched(chaos, orchestrator)
    try:
        assert orchestrator.step() is RunState.RUNNING  # the group is up
        thread.start()
        try:
            finish(orchestrator, 10_000)
        finally:
            finished.set()
        thread.join(60)  # raises what the thread raised (a planned kill not made)
        got = outcome(orchestrator.learner, orchestrator.run_dir.event_log())
    finally:
        finished.set()
        orchestrator.close()
    print("chaos schedule (time, kind, index):", kills)
    print("restarts from a checkpoint:", orchestrator.restarts)
    print("recoveries of the last group:", got["recoveries"])
    assert [k[1:] for k in kills] == [s[1:] for s in schedule]  # every kill it planned
    assert_same_run(got, want)


@pytest.fixture(scope="module")
def sharded_fault_free(wiki):
    return reference(config(memory="sharded"), wiki)


def kill_at_step(step: int, actor_of):
    """A `during`: SIGKILL `actor_of(group)`'s process (the actor then in that place) once
    the driver counts `step` training steps (step-per-task runs report no pass progress);
    nothing if the run ends first."""

    def during(learner) -> None:
        for _ in range(60000):  # bounded
            if learner.done:
                return
            if learner.cursor.step >= step:
                os.kill(ray.get(actor_of(learner.group).pid.remote()), signal.SIGKILL)
                return
            time.sleep(0.001)

    return during


@pytest.mark.parametrize("who", ["shard+trainer", slow("shard"), slow("trainer")])
def test_sharded_node_state_recovers_in_step_per_task_runs(
    ray_session, wiki, sharded_fault_free, who
):
    """Node state owned by shards (`cluster.memory: sharded`, a task per step) with a
    replica of every shard: a SIGKILLed shard's replica, which took every node-state update
    too, takes its place; a SIGKILLed trainer is replaced from a survivor and the failed
    step runs again. Each alone, and one after the other in one run (the default suite),
    ends bitwise as the fault-free run."""
    both = who == "shard+trainer"  # of the run's 28 steps: shard at 10, trainer at 20
    kills = {"shard": kill_at_step(10 if both else 20, lambda g: g.shards[1]),
             "trainer": kill_at_step(20, lambda g: g.trainers[1])}  # fmt: skip

    def during(learner) -> None:
        for name in who.split("+"):
            kills[name](learner)

    got = run(config(memory="sharded", shard_replicas=2), wiki, during)
    promoted = [e["promoted"] for e in got["recoveries"] if e.get("promoted")]
    lost = [e["lost"] for e in got["recoveries"] if e.get("lost")]
    assert promoted == ([[1]] if "shard" in who else [])
    assert lost == ([[1]] if "trainer" in who else [])
    assert_same_run(got, sharded_fault_free)


def test_a_lost_shard_owning_node_state_without_a_replica_replays_its_journal(
    ray_session, wiki, sharded_fault_free, tmp_path
):
    """`cluster.memory: sharded` and no replica: a shard SIGKILLed in the second increment is
    rebuilt from its state in the newest checkpoint plus what changed the shards since, in
    order (only the batches ingested since the checkpoint, and every step's node-state
    updates, kept on the driver's node), by the surviving shard actor; the run ends bitwise
    as the fault-free one, every shard holding the log's events."""
    due = lambda learner: learner.cursor.increment >= 1 and learner.cursor.step >= 20  # noqa: E731
    got, learner, restarts = orchestrated(config(memory="sharded"), wiki, tmp_path, "journal",
                                          due)  # fmt: skip
    assert restarts == 0
    rebuilt = [e for e in learner.group.recoveries if "events" in e]
    assert [e["lost_shards"] for e in rebuilt] == [[1]] and rebuilt[0]["snapshot"]
    assert 0 < rebuilt[0]["replayed_batches"] < len(learner.group.ingests)
    assert_same_run(got, sharded_fault_free)
    # the feature-rounding states of ingests before the newest checkpoint are gone (a rebuild
    # starts from it): only the spans of the run's ingests stay on the driver
    store = CheckpointStore.at(str(tmp_path / "journal" / "checkpoints"))
    newest = store.load(store.latest(), resolve=False)
    covered = len(newest["learner"]["group"]["ingests"])
    held = [state is not None for *_, state in learner.group.ingests]
    assert 0 < covered and held == [False] * covered + [True] * (len(held) - covered)


# the default suite: a fault in the forward pass, then a SIGKILL from outside, in one run
@pytest.mark.parametrize(
    ("at", "kind"),
    [
        ("forward", "fault+outside"),
        slow("forward", "fault"),
        slow("after_step", "fault"),
        slow("sigkill", "outside"),
    ],
)
def test_a_task_per_step_run_recovers_its_pipelined_steps_bitwise(
    ray_session, wiki, fault_free, at, kind
):
    """`cluster.whole_passes: false` with replicated node state: the driver keeps up to
    `pipeline_depth` steps in flight, each carrying the node-state updates of the step
    before. A trainer lost mid-pass (a fault at a step, or SIGKILLed from outside) makes the
    group recover from the most advanced survivor and send again the steps it does not hold,
    each with the updates before it; a survivor that applied some already skips them
    (numbered). The run ends bitwise as the fault-free whole-pass run."""
    faults = [{"trainer": 1, "step": 5, "at": at}] if "fault" in kind else []
    cfg = config(faults, whole_passes=False)
    during = None
    if "outside" in kind:  # after the fault's recovery, if any: the replacement is killed
        during = kill_at_step(12 if faults else 6, lambda g: g.trainers[1])

    got = run(cfg, wiki, during=during)
    assert [e["lost"] for e in got["recoveries"]] == [[1]] * (1 + (kind == "fault+outside"))
    assert got["trainer_steps"] == [fault_free["steps"]] * 2
    assert_same_run(got, fault_free)


def test_a_task_per_step_run_applies_each_batch_of_updates_once(ray_session, wiki):
    """APAN's mailbox takes every delivery again (a ring of mails per node): a survivor that
    applied the updates before the failed step, when they come again with the step sent
    anew, must skip them, or the mailboxes shift. Trainer 1 dies at the forward pass of step
    5, after both trainers applied step 4's updates."""

    def apan(faults=()) -> RunConfig:
        cfg = config(faults, whole_passes=False)
        cfg.model.name = "apan"
        return RunConfig.from_dict(cfg.to_dict())

    want = reference(apan(), wiki)
    got = run(apan([{"trainer": 1, "step": 5, "at": "forward"}]), wiki)
    assert [e["lost"] for e in got["recoveries"]] == [[1]]
    assert_same_run(got, want)


def model_config(name: str, faults=(), **cluster) -> RunConfig:
    """`config` with model `name` at its own depth and fanouts (its registry row's)."""
    cfg = config(faults, **cluster)
    cfg.model.name = name
    cfg.model.num_layers, cfg.sampler.fanouts = None, None
    return RunConfig.from_dict(cfg.to_dict())


def test_a_graphmixer_run_recovers_a_lost_trainer_bitwise(ray_session, wiki):
    """GraphMixer (no node state: the replica's parameters and optimizer are all there is to
    bring back) loses trainer 1 at its all-reduce and ends as the fault-free run."""
    want = reference(model_config("graphmixer"), wiki)
    got = run(model_config("graphmixer", [{"trainer": 1, "step": 4, "at": "allreduce"}]), wiki)
    assert [e["lost"] for e in got["recoveries"]] == [[1]]
    assert_same_run(got, want)


@pytest.mark.parametrize("model", ["tpnet", "edgebank"])
def test_a_run_with_state_beyond_node_tables_recovers_a_lost_trainer_bitwise(ray_session, wiki,
                                                                            model):  # fmt: skip
    """TPNet (node state: its walk projections, changed by each step's events) and EdgeBank
    (its memory of pairs, no node rows) lose trainer 1 at the forward pass of step 5, after
    both trainers applied step 4's contributions: the step sent anew must not add them
    twice."""
    fault = [{"trainer": 1, "step": 5, "at": "forward"}]
    want = reference(model_config(model, whole_passes=False), wiki)
    got = run(model_config(model, fault, whole_passes=False), wiki)
    assert [e["lost"] for e in got["recoveries"]] == [[1]]
    assert_same_run(got, want)
