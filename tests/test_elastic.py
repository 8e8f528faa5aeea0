"""Elastic trainer groups on Ray: members join and leave at step boundaries, and with the
default rule (keep the global batch) the run ends where a fixed-size run ends, up to float
summation order. The runs are in float64 (`numerics.float64_everywhere`), so that summation
order shows at 1e-15, far below what any semantic error gives, on every CPU."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from tidegraph.jobs import resize
from tidegraph.orchestrator import make_group
from tidegraph.training import RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402
from numerics import float64_everywhere  # noqa: E402
from recovery_run import assert_same_run, reference, run  # noqa: E402
from threads import Watched  # noqa: E402


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", EVENTS)


EVENTS = 6000


def config(trainers, **cluster) -> RunConfig:
    """About 160 training steps in 16 passes (members being started are waited for at a
    pass boundary: `members_first`)."""
    raw = reference_run.reference_config("tgn")
    raw["model"]["slot_precision"] = "fp32"
    raw["data"]["max_events"] = EVENTS
    raw["train"].update(batch_size=100, epochs=3)
    raw["continual"].update(num_increments=4, retrain_epochs=3)
    raw["cluster"] = {"backend": "ray", "trainers": trainers, "shards": 2,
                      "elastic_poll_s": 0.05, **cluster}  # fmt: skip
    raw["run_name"] = "tidegraph-elastic-test"
    return RunConfig.from_dict(raw)


@pytest.fixture(scope="module", autouse=True)
def _float64():
    with float64_everywhere():
        yield


@pytest.fixture(scope="module")
def fixed(wiki):
    return reference(config(2), wiki)


def assert_close_run(got: dict, want: dict) -> None:
    """The same steps, every shard the same events, float64 parameters and metrics equal up
    to summation order (the slices of a step's batch were summed in other groups): 1e-9 of
    each tensor's scale (measured 1e-15; a semantic error gives 1e-2 or more).

    Attention key biases get 1e-6: in exact arithmetic their gradient is zero (softmax
    ignores a shift shared by every key), so Adam turns summation-order noise into whole
    steps (measured 2e-11 in float64; in float32, 5% between any two group sizes)."""
    assert got["steps"] == want["steps"]
    assert got["shard_events"]["shard_events"] == want["shard_events"]["shard_events"]
    for key, value in want["model"].items():
        if not value.numel():
            continue
        assert value.dtype != torch.float32, (key, "models are built in float64 here")
        bound = 1e-6 if key.endswith("key.bias") else 1e-9
        scale = float(value.abs().max()) if value.is_floating_point() else 0.0
        torch.testing.assert_close(got["model"][key], value, rtol=0, atol=bound * scale + 1e-12,
                                   msg=key)  # fmt: skip
    for a, b in zip(got["history"], want["history"], strict=True):
        for k in ("ap", "auc", "loss"):
            if k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12), k


def wants(*counts, first: float = 0.1, every: float = 0.1):
    """A `during` that asks the run's coordinator for each trainer count in turn, at
    fractions `first`, `first + every`, ... of the run's training steps (the driver's count,
    which moves a pass at a time)."""

    def during(learner) -> None:
        steps = sum(u.kind == "train" for u in learner.schedule.units)
        for i, count in enumerate(counts):
            while learner.cursor.step < steps * (first + i * every):
                time.sleep(0.005)
            argv = ["--run-name", learner.config.run_name, "--trainers", str(count)]
            assert resize.main(argv) == 0  # the operator's command, in this process

    return during


def shrink_then_grow(learner) -> None:
    """A `during`: 2 -> 1 trainers at 10% of the run's training steps, then back to 2 as
    soon as the shrink is done, so that the joining process has most of the run to start
    in (the driver's step count moves a pass at a time: a grow asked at a later fraction
    can come seconds before the end)."""
    wants(1)(learner)
    for _ in range(60_000):  # bounded
        if learner.group.resizes or learner.done:
            break
        time.sleep(0.001)
    assert resize.main(["--run-name", learner.config.run_name, "--trainers", "2"]) == 0


def test_an_operator_shrinks_and_grows_the_group_mid_run(
    ray_session, wiki, fixed, quick_polls, members_first, capsys
):
    """The operator's command (`jobs.resize`) asks for 1 and then 2 trainers; before that it
    reports the run's count and refuses a count out of the run's bounds."""
    told: list = []
    codes: list = []

    def during(learner) -> None:  # the controller's hook sees each resize start and end
        learner.group.on_change = lambda kind, why: told.append((kind, why))
        name = ["--run-name", learner.config.run_name]
        codes.extend([resize.main([*name, "--trainers", "3"]), resize.main(name)])
        shrink_then_grow(learner)

    got = run(config({"min": 1, "max": 2}), wiki, during)
    out, err = capsys.readouterr()
    assert codes == [2, 0]
    assert "allows 1 to 2 trainers" in err and '"trainers": 2' in out
    sizes = [(r["from"], r["to"]) for r in got["resizes"]]
    assert sizes == [(2, 1), (1, 2)], got["resizes"]
    assert [kind for kind, _ in told] == ["resizing", "settled"] * 2, told
    assert told[0][1] == "trainers: target 1 < 2 trainers", told
    assert told[2][1].startswith("trainers: 1 slot placed"), told
    assert got["trainer_steps"] == [fixed["steps"]] * 2  # the joined member: every step
    assert_close_run(got, fixed)


@pytest.mark.slow  # two more runs; run before resolving
def test_a_group_sending_buckets_in_backward_shrinks_and_grows(
    ray_session, wiki, fixed, quick_polls, members_first
):
    """`comm.overlap` with fp32 buckets: the trainer that joins hooks its parameters and
    sends its buckets in backward like the others; the run matches the fixed group up to
    float summation order, and the group did send buckets during backward."""
    cfg = config({"min": 1, "max": 2})
    cfg.comm = RunConfig.from_dict({"comm": {"overlap": True, "bucket_bytes": 65536,
                                             "min_bucket_bytes": 0}}).comm  # fmt: skip
    got = run(cfg, wiki, shrink_then_grow)
    sizes = [(r["from"], r["to"]) for r in got["resizes"]]
    assert sizes == [(2, 1), (1, 2)], got["resizes"]
    assert got["trainer_steps"] == [fixed["steps"]] * 2
    assert_close_run(got, fixed)
    assert got["comm"]["buckets_sent_in_backward"] > 0
    assert fixed["comm"] is None  # the fixed run sends plain fp32 (no GradSync)


def test_a_moved_shard_and_a_spare_taking_a_lost_rank_change_nothing(
    ray_session, wiki, fixed, quick_polls, members_first
):
    """Two changes that keep the group's size, in one run, which ends bitwise as the fixed
    run with every shard holding the log's events:
    - an operator moves partition 1 to a new shard actor (`jobs.resize --move-shard`): the
      successor starts while the group trains, copies the shard at a step boundary and takes
      its requests;
    - `cluster.spare_trainers: 1`: a trainer started ahead replaces one SIGKILLed mid-pass,
      without a process start."""

    def during(learner) -> None:
        group = learner.group
        steps = sum(u.kind == "train" for u in learner.schedule.units)
        while learner.cursor.step < steps * 0.2:
            time.sleep(0.005)
        argv = ["--run-name", learner.config.run_name, "--move-shard", "1"]
        assert resize.main(argv) == 0
        for _ in range(24000):  # bounded: until the move is done
            if group.shard_moves or learner.done:
                break
            time.sleep(0.005)
        pid = ray.get(group.trainers[1].pid.remote())
        base = ray.get(group.coordinator.progress.remote())
        for _ in range(6000):  # bounded: until the spare is up and a later pass is under way
            spares = [j[2] for j in list(group.joiners.values())]
            up = spares and ray.wait(spares, num_returns=len(spares), timeout=0)[0]
            progress = ray.get(group.coordinator.progress.remote())
            if up and progress >= 3 and progress != base:
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    got = run(config(2, spare_trainers=1), wiki, during)
    assert [m["part"] for m in got["shard_moves"]] == [1]
    assert got["shard_moves"][0]["events"] > 0  # checked equal to the old shard's at the move
    (event,) = got["recoveries"]
    assert event["lost"] == [1] and event["spares_used"] == [1]
    assert got["resizes"] == []
    assert_same_run(got, fixed)


def test_the_resize_command_refuses_an_unknown_run(ray_session, capsys):
    """(A count out of bounds, and the report of a run's count: in the operator test.)"""
    assert resize.main(["--run-name", "no-such-run", "--trainers", "2"]) == 2
    assert "no run named 'no-such-run'" in capsys.readouterr().err


def test_rapid_resize_requests_leave_a_consistent_group(ray_session, wiki, fixed, quick_polls):
    """Operators change their mind faster than trainers start: 1, 2, 1, 2, 1, 2 trainers a
    few steps apart. Trainers starting for a count no longer wanted are dropped; every resize
    starts from the size the last one left, and the run ends as the fixed-size run."""
    got = run(config({"min": 1, "max": 2}), wiki, wants(1, 2, 1, 2, 1, 2, every=0.02),
              join_s=120)  # fmt: skip
    sizes = [(r["from"], r["to"]) for r in got["resizes"]]
    assert sizes and sizes[0] == (2, 1)
    assert all(a[1] == b[0] for a, b in zip(sizes, sizes[1:], strict=False))
    assert got["recoveries"] == []
    assert len(set(got["trainer_steps"])) == 1  # every member ends at the same step
    assert_close_run(got, fixed)


def test_the_linear_rule_scales_batch_and_learning_rate_with_the_group(
    ray_session, wiki, quick_polls
):
    """`cluster.scale_rule: linear`: the group shrinks from 2 trainers to 1, so each trainer
    keeps its share: the learning rate halves at once and the later increments train with
    half the global batch; a checkpoint of that run resumes with both."""
    from tidegraph.training import ContinualLearner

    cfg = config({"min": 1, "max": 2}, scale_rule="linear")
    base_batch, base_lr = cfg.train.batch_size, cfg.train.lr
    learner = ContinualLearner(cfg, wiki, make_group)
    try:
        during = Watched(wants(1, first=0.3), learner)
        during.start()
        learner.run_phase1()
        while not learner.done:
            learner.step()
        during.join(60)  # raises what the thread raised
        group = learner.group
        assert [(r["from"], r["to"]) for r in group.resizes] == [(2, 1)]
        assert group.train_batch_size == base_batch // 2
        lrs = ray.get(group.trainers[0].call.remote("__getattribute__", "optimizer"))
        assert lrs.param_groups[0]["lr"] == pytest.approx(base_lr / 2)
        ((unit, batch),) = learner.rebatches
        assert batch == base_batch // 2
        train = [u for u in learner.schedule.units if u.kind == "train"]
        assert all(u.hi - u.lo <= batch for u in learner.schedule.units[unit:] if u in train)
        assert any(u.hi - u.lo > batch for u in train)  # before the resize: the whole batch
        assert learner.cursor.step == len(train)  # every step of the schedule ran once
        state = learner.state_dict()
    finally:
        learner.group.shutdown()
    again = ContinualLearner(config({"min": 1, "max": 1}, scale_rule="linear"), wiki, make_group)
    try:
        again.load_state_dict(state)
        assert again.schedule.units == learner.schedule.units
        assert again.group.start_trainers == 2 and again.group.train_batch_size == batch
    finally:
        again.group.shutdown()


def test_batch_history_resized_mid_pass_keeps_every_slice_at_its_batch_start(
    ray_session, wiki, quick_polls, members_first
):
    """`sampler.history: batch`: the rest of a pass is cut anew for the new group, and every
    slice still carries its global batch's start (cut at a slice's own start instead, the
    later slices see earlier events of their batch: 7e-2 on a weight)."""

    def batch_history(trainers) -> RunConfig:
        cfg = config(trainers)
        cfg.sampler.history = "batch"
        return cfg

    fixed = reference(batch_history(2), wiki)
    got = run(batch_history({"min": 1, "max": 2}), wiki, wants(1, 2))
    assert [(r["from"], r["to"]) for r in got["resizes"]] == [(2, 1), (1, 2)]
    assert_close_run(got, fixed)
