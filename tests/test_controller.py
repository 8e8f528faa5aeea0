"""The run controller's states, driven without Ray by a scripted group: a local group that
reports recovering and resizing through the controller's hook at chosen training steps, and
loses every trainer replica once (`NoReplicaLeft`). Each state is entered and left with a log
line, kept in `transitions` and shown in Prometheus (`tidegraph_controller_state`)."""

import logging
import sys
from pathlib import Path

import pytest

from tidegraph.orchestrator import Orchestrator, RunState
from tidegraph.orchestrator.metrics import STATES, RunMetrics
from tidegraph.orchestrator.rundir import RunDir
from tidegraph.recovery.policy import NoReplicaLeft
from tidegraph.training import RunConfig
from tidegraph.training.group import LocalGroup

sys.path.insert(0, str(Path(__file__).parent))
from recovery_run import finish  # noqa: E402

CONFIG = {
    "model": {"name": "tgn", "dim": 16, "time_dim": 8, "memory_dim": 16},
    "data": {"dataset": "wikipedia", "max_events": 600},
    "train": {"batch_size": 100, "epochs": 1, "eval_negatives": 3},
    "continual": {"num_increments": 2, "forget_sample": 50, "train_fraction": 0.6},
    "cluster": {"backend": "local", "shards": 2, "trainers": 2},
    "seed": 3,
    "progress": False,
}


def scripted(script: dict, seen: list, metrics=None):
    """A group factory: local groups that, at training step s of `script` (counted over
    every group it made), act on the controller's hook (`on_change`) as a Ray group does
    around a recovery or resize, or raise `NoReplicaLeft`; `seen` gets the controller state
    the metrics show while the group is changing."""
    steps = [0]

    class Scripted(LocalGroup):
        def train_step(self, *args):
            s, steps[0] = steps[0], steps[0] + 1
            act = script.get(s)
            if act == "lose every trainer":
                raise NoReplicaLeft("all 2 trainers were lost; no replica to recover from")
            if act is not None:
                self.on_change(act, f"scripted at step {s}")
                if metrics is not None:
                    seen.append(shown(metrics))
                self.on_change("settled", "done")
            return super().train_step(*args)

    return Scripted


def shown(metrics: RunMetrics) -> str:
    """The state the Prometheus state set shows (exactly one is 1)."""
    on = [s for s in STATES if metrics.registry.get_sample_value(
        "tidegraph_controller_state", {"tidegraph_controller_state": s}) == 1.0]  # fmt: skip
    assert len(on) == 1, on
    return on[0]


def run(tmp_path, script: dict, metrics=None) -> tuple[Orchestrator, list]:
    seen: list = []
    cfg = RunConfig.from_dict({**CONFIG, "out_dir": str(tmp_path / "out")})
    orchestrator = Orchestrator(cfg, group=scripted(script, seen, metrics), metrics=metrics,
                                run_dir=RunDir(str(tmp_path), "run"))  # fmt: skip
    try:
        finish(orchestrator, max_steps=50)
    finally:
        orchestrator.close()
    return orchestrator, seen


def moves(orchestrator: Orchestrator) -> list[tuple[str, str]]:
    return [(a.value, b.value) for a, b, _, _ in orchestrator.transitions]


def test_the_controller_goes_through_recovering_and_resizing_and_back(tmp_path, caplog):
    metrics = RunMetrics(0)
    try:
        with caplog.at_level(logging.INFO, logger="tidegraph.orchestrator.controller"):
            orchestrator, seen = run(tmp_path, {2: "recovering", 4: "resizing"}, metrics)
        assert shown(metrics) == "finished"
    finally:
        metrics.close()
    assert moves(orchestrator) == [
        ("scheduling", "running"),
        ("running", "recovering"), ("recovering", "running"),
        ("running", "resizing"), ("resizing", "running"),
        ("running", "finished"),
    ]  # fmt: skip
    assert seen == ["recovering", "resizing"]  # Prometheus showed each while it lasted
    whys = [why for _, _, why, _ in orchestrator.transitions]
    assert whys[1] == "scripted at step 2" and whys[3] == "scripted at step 4"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("controller:")]
    assert lines == [
        "controller: scheduling -> running (the group is placed)",
        "controller: running -> recovering (scripted at step 2)",
        "controller: recovering -> running (done)",
        "controller: running -> resizing (scripted at step 4)",
        "controller: resizing -> running (done)",
        "controller: running -> finished (the last increment is done)",
    ]


def test_no_replica_left_restarts_through_restarting_and_scheduling(tmp_path):
    orchestrator, _ = run(tmp_path, {3: "lose every trainer"})
    assert moves(orchestrator) == [
        ("scheduling", "running"), ("running", "restarting"), ("restarting", "scheduling"),
        ("scheduling", "running"), ("running", "finished"),
    ]  # fmt: skip
    assert orchestrator.restarts == 1
    assert "no replica" in orchestrator.transitions[1][2]


def test_the_restart_budget_spent_ends_in_errored(tmp_path):
    cfg = RunConfig.from_dict({**CONFIG, "cluster": {**CONFIG["cluster"], "max_recoveries": 0}})
    orchestrator = Orchestrator(cfg, group=scripted({1: "lose every trainer"}, []),
                                run_dir=RunDir(str(tmp_path), "run"))  # fmt: skip
    for _ in range(10):
        if orchestrator.step() in (RunState.FINISHED, RunState.ERRORED):
            break
    orchestrator.close()
    assert orchestrator.state is RunState.ERRORED
    assert isinstance(orchestrator.error, NoReplicaLeft)
    assert moves(orchestrator)[-1] == ("running", "errored")


def test_the_metric_knows_every_state():
    assert list(STATES) == [s.value for s in RunState]


@pytest.mark.parametrize("kind", ["recovering", "resizing"])
def test_a_settle_without_a_start_changes_nothing(tmp_path, kind):
    """`settled` is ignored unless the controller is recovering or resizing (a group that
    recovered inside its construction, say, before the controller set its hook)."""
    cfg = RunConfig.from_dict(CONFIG)
    orchestrator = Orchestrator(cfg, group=scripted({}, []))
    assert orchestrator.step() is RunState.RUNNING
    orchestrator._group_changed("settled", "nothing started")
    assert orchestrator.state is RunState.RUNNING
    orchestrator._group_changed(kind, "now")
    assert orchestrator.state.value == kind
    orchestrator.close()
