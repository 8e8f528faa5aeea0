"""Whole Ray runs with something happening meanwhile (a kill, a node removed), and the exact
comparison with a fault-free run (shared by the recovery tests)."""

from __future__ import annotations

import threading

import torch

from tidegraph.runtime import set_determinism
from tidegraph.training import ContinualLearner

METRICS = ("ap", "auc", "mrr", "old_ap", "loss", "val_ap", "replayed")


def run(cfg, stream, during=None, join_s: float = 60.0, during_in_main: bool = False) -> dict:
    """The whole run; `during(learner)` is started in a thread once the group is up (or,
    `during_in_main`, runs in this thread while the run trains in another: Ray's
    `Cluster.add_node` works only in the main thread)."""
    set_determinism(7, threads=1)
    learner = ContinualLearner(cfg, stream)
    failed: list = []

    def train() -> None:
        try:
            learner.run_phase1()
            while not learner.done:
                learner.step()
        except BaseException as exc:
            failed.append(exc)

    target, args = (train, ()) if during_in_main else (during, (learner,))
    thread = None
    if during is not None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
    try:
        if during_in_main:
            during(learner)
            thread.join()
            if failed:
                raise failed[0]
        else:
            train()
            if failed:
                raise failed[0]
        group = learner.group
        return {
            "model": group.model_state(),
            "history": learner.history,
            "steps": learner.cursor.step,
            "trainer_steps": group._all("__getattribute__", "steps"),
            "recoveries": list(group.recoveries),
            "resizes": list(getattr(group, "resizes", [])),
            "shard_moves": list(getattr(group, "shard_moves", [])),
            "shard_resizes": list(getattr(group, "shard_resizes", [])),
            "placement": group.placement(),
            "shard_events": group.report(stream.events.src, stream.events.dst),
            "comm": group.comm_totals(),  # trainer 0's gradient totals (None: plain fp32)
        }
    finally:
        if thread is not None:
            thread.join(timeout=join_s)
        learner.group.shutdown()


def assert_same_run(got: dict, want: dict) -> None:
    """Bitwise the same parameters and metrics, as many steps, every shard the same events."""
    assert got["steps"] == want["steps"]
    assert got["model"].keys() == want["model"].keys()
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    for a, b in zip(got["history"], want["history"], strict=True):
        assert {k: a[k] for k in METRICS if k in a} == {k: b[k] for k in METRICS if k in b}
    assert got["shard_events"]["shard_events"] == want["shard_events"]["shard_events"]
