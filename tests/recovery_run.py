"""Whole Ray runs with something happening meanwhile (a kill, a node removed), and the exact
comparison with a fault-free run (shared by the recovery tests).

Every run keeps a durable event log (in a temporary directory when it has no run directory
of its own), and `outcome` checks each partition's events against it before anything else:
a run whose shards hold an event twice, or miss one, fails there, whatever the other run
holds. `assert_same_run` then compares parameters, metrics and the node state the shards
hold (`cluster.memory: sharded`) bitwise."""

from __future__ import annotations

import tempfile
import traceback

import torch
from logcheck import assert_held_as_logged, assert_same_node_rows, node_rows
from threads import Watched

from tidegraph.orchestrator import RunState, make_group
from tidegraph.runtime import set_determinism
from tidegraph.storage.eventlog import EventLog
from tidegraph.training import ContinualLearner, RunConfig
from tidegraph.training.group import LocalGroup

METRICS = ("ap", "auc", "mrr", "old_ap", "loss", "val_ap", "replayed")


def finish(orchestrator, max_steps: int = 200) -> None:
    """Step `orchestrator` until it ends (at most `max_steps` state steps) and assert that it
    finished, with the error's traceback when it did not."""
    for _ in range(max_steps):  # bounded
        if orchestrator.step() in (RunState.FINISHED, RunState.ERRORED):
            break
    error = orchestrator.error
    why = "".join(traceback.format_exception(error)) if error is not None else "still running"
    assert orchestrator.state is RunState.FINISHED, why


def run(cfg, stream, during=None, join_s: float = 60.0, during_in_main: bool = False,
        live: bool = False) -> dict:  # fmt: skip
    """The whole run; `during(learner)` is started in a thread once the group is up (or,
    `during_in_main`, runs in this thread while the run trains in another: Ray's
    `Cluster.add_node` works only in the main thread). What the thread raises fails the run,
    as does a `during` thread still running `join_s` seconds after the run. `live`: the
    stream's increments are appended one by one, as a followed source gives them, and the
    learner is checked to hold none it has learned (`live_stream`)."""
    set_determinism(7, threads=1)
    with tempfile.TemporaryDirectory(prefix="tidegraph-log-") as where:
        log = EventLog(where)
        increments = []
        if live:
            stream, increments = live_stream(cfg, stream)
        learner = ContinualLearner(cfg, stream, make_group, event_log=log, live=live)

        def train() -> None:
            learner.run_phase1()
            for events in increments:
                learner.append(events)
                learner.step()
                assert len(learner.events) == 0 and learner.base == learner.end  # in the log
            while not learner.done:
                learner.step()

        thread = None
        if during is not None:
            thread = Watched(train) if during_in_main else Watched(during, learner)
            thread.start()
        try:
            try:
                if during_in_main:
                    during(learner)
                    thread.join()  # the run, as long as it takes
                else:
                    train()
            finally:
                if thread is not None:
                    thread.join(join_s)  # raises what the thread raised
            return outcome(learner, log)
        finally:
            learner.group.shutdown()


def reference(cfg, stream, live: bool = False) -> dict:
    """The fault-free run of `cfg` on the in-process group (`cluster.backend: local`), which
    is bitwise the Ray group's (`test_ray`) and starts no process."""
    raw = cfg.to_dict()
    raw["cluster"] = {**raw["cluster"], "backend": "local"}
    return run(RunConfig.from_dict(raw), stream, live=live)


def live_stream(cfg, stream) -> tuple:
    """`stream`'s phase 1 as a stream of its own, and its increments' events, as a followed
    run gets them."""
    from tidegraph.training.data import stream_of
    from tidegraph.training.schedule import Schedule

    c = cfg.continual
    schedule = Schedule(stream.events.t, c, cfg.train.batch_size, cfg.train.epochs)
    phase1 = stream_of(stream.events.select(slice(0, schedule.phase1_end)), stream.name)
    return phase1, [stream.events.select(slice(lo, hi)) for lo, hi in schedule.increments]


def outcome(learner, log: EventLog) -> dict:
    """What a finished run is compared by, once every partition was found to hold exactly
    the events of `log` (its durable event log)."""
    group = learner.group
    shards = group.shard_states()
    counts = assert_held_as_logged(shards, group.partitioner, log, learner.stream.idmap,
                                   learner.cursor.ingested)  # fmt: skip
    report = group.partition(learner.tally)
    assert report["shard_events"] == counts  # what the group reports is what it holds
    local = isinstance(group, LocalGroup)  # a reference run, in this process
    return {
        "model": group.model_state(),
        "node_rows": [node_rows(s["node_state"]) for s in shards],  # sharded node state
        "history": learner.history,
        "steps": learner.cursor.step,
        "trainer_steps": (
            [t.steps for t in group.trainers] if local else group._all("__getattribute__", "steps")
        ),
        "recoveries": list(group.recoveries),
        "resizes": list(getattr(group, "resizes", [])),
        "shard_moves": list(getattr(group, "shard_moves", [])),
        "shard_resizes": list(getattr(group, "shard_resizes", [])),
        "placement": {} if local else group.placement(),
        "shard_events": report,
        "comm": group.comm_totals(),  # trainer 0's gradient totals (None: plain fp32)
    }


def assert_same_run(got: dict, want: dict) -> None:
    """Bitwise the same parameters, node state and metrics, as many steps, every shard the
    same events (each run's were checked against its own event log by `outcome`)."""
    for name, res in (("got", got), ("want", want)):
        assert "node_rows" in res, f"{name}: make it with outcome(learner, event_log)"
    assert got["steps"] == want["steps"]
    assert got["model"].keys() == want["model"].keys()
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    for a, b in zip(got["history"], want["history"], strict=True):
        assert {k: a[k] for k in METRICS if k in a} == {k: b[k] for k in METRICS if k in b}
    assert got["shard_events"]["shard_events"] == want["shard_events"]["shard_events"]
    assert_same_node_rows(got["node_rows"], want["node_rows"])  # held by shards, if any
