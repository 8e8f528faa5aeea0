"""Elastic shard counts on Ray (`cluster.shards: {min, max}`): P = max partitions held by
between min and max shard actors. Partitions move whole between actors at step boundaries,
so the partition function never changes and a run ends bitwise where a run with P fixed
shards ends, every partition holding exactly the log's events."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray

from tidegraph.jobs import resize
from tidegraph.training import RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
from recovery_run import assert_same_run, reference, run  # noqa: E402
from test_elastic import EVENTS  # noqa: E402
from test_elastic import config as elastic_config  # noqa: E402

PARTS = 4


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", EVENTS)


def config(shards, **cluster) -> RunConfig:
    """test_elastic's run with 2 trainers and these shards (actors being started are waited
    for at a pass boundary: `members_first`)."""
    return elastic_config(2, shards=shards, shard_cpus=0.25, **cluster)


@pytest.fixture(scope="module")
def fixed(wiki):
    return reference(config(PARTS), wiki)


def _at(learner, fraction: float) -> None:
    """Wait (bounded by the run) until the driver has passed `fraction` of the steps."""
    steps = sum(u.kind == "train" for u in learner.schedule.units)
    while learner.cursor.step < steps * fraction and not learner.done:
        time.sleep(0.005)


def _until(check, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _ask(learner, count: int) -> None:
    argv = ["--run-name", learner.config.run_name, "--shards", str(count)]
    assert resize.main(argv) == 0  # the operator's command, in this process


def test_shard_bounds_in_the_config():
    c = config({"min": 2, "max": 4}).cluster
    assert (c.min_shards, c.max_shards, c.shards) == (2, 4, 4)
    assert RunConfig.from_dict(config({"min": 2, "max": 4}).to_dict()).cluster.min_shards == 2
    assert (config(3).cluster.min_shards, config(3).cluster.max_shards) == (3, 3)
    with pytest.raises(ValueError, match=r"cluster.shards: min 3 > max 2"):
        config({"min": 3, "max": 2})
    with pytest.raises(ValueError, match=r"cluster.shards must be an integer or \{min, max\}"):
        config({"min": 1})
    with pytest.raises(ValueError, match=r"cluster.shards: min must be an integer >= 1"):
        config({"min": 0, "max": 2})
    with pytest.raises(ValueError, match=r"shard_replicas > 1 is not supported yet"):
        config({"min": 1, "max": 2}, shard_replicas=2)


def test_shard_actors_shrink_are_lost_and_grow_mid_run(
    ray_session, wiki, fixed, quick_polls, members_first
):
    """4 partitions on 4 actors, one run, which ends bitwise as the run with 4 fixed shards,
    every partition holding the log's events (every move is checked event for event):
    - the operator asks for 5 actors (out of [min, max]: refused, nothing changes), then for
      3: one actor now holds two partitions;
    - that actor is SIGKILLed mid-pass: the two survivors each rebuild one of its partitions
      from the log at the same time (no process start), and the lost actor's slot gets a new
      actor that takes partitions back;
    - the operator asks for 1 actor (the others hand theirs to the one left), then for 4
      again (actors start while the group trains and take partitions over at a step
      boundary)."""
    seen = {}

    def during(learner) -> None:
        group = learner.group
        seen["start"] = len(group._shard_hosts())
        _at(learner, 0.1)
        argv = ["--run-name", learner.config.run_name, "--shards", str(PARTS + 1)]
        seen["too_many"] = resize.main(argv)
        _ask(learner, 3)
        _until(lambda: group.shard_resizes, "the shrink to 3 actors")
        double = [h for h in group._shard_hosts().values() if len(h[2]) == 2]
        seen["killed"] = sorted(double[0][2])
        pid = ray.get(double[0][0].pid.remote())
        base = ray.get(group.coordinator.progress.remote())
        _until(lambda: (p := ray.get(group.coordinator.progress.remote())) >= 3 and p != base,
               "a later pass under way")  # fmt: skip
        os.kill(pid, signal.SIGKILL)
        _until(lambda: len(group.shard_resizes) >= 2 or learner.done, "the actor's return")
        _ask(learner, 1)
        _until(lambda: len(group.shard_resizes) >= 3 or learner.done, "the shrink to 1")
        seen["after_shrink"] = sorted(map(sorted, (h[2] for h in group._shard_hosts().values())))
        _ask(learner, 4)
        _until(lambda: len(group.shard_resizes) >= 4 and group.shard_resizes[-1]["to"] == 4
               or learner.done, "the grow")  # fmt: skip

    got = run(config({"min": 1, "max": PARTS}), wiki, during, join_s=180)
    assert seen["start"] == PARTS
    assert seen["too_many"] == 2
    rebuilt = [e for e in got["recoveries"] if "events" in e]
    assert [sorted(e["lost_shards"]) for e in rebuilt] == [seen["killed"]]
    assert rebuilt[0]["rebuilt_on"] == 2  # split across the two survivors
    sizes = [(r["from"], r["to"]) for r in got["shard_resizes"]]
    assert sizes[:3] == [(4, 3), (2, 3), (3, 1)], sizes  # a new actor in the lost one's slot
    assert sizes[-1][1] == 4, sizes
    assert seen["after_shrink"] == [[0, 1, 2, 3]]
    assert len(got["shard_moves"]) >= 6  # to the one actor left and back (and rebalancing)
    assert got["resizes"] == []
    assert_same_run(got, fixed)  # every partition the log's events, bitwise the same run


@pytest.mark.slow  # two long runs; run before resolving
def test_node_state_rows_move_with_their_partitions(ray_session, wiki, quick_polls, members_first):
    """`cluster.memory: sharded`: shard actors own their partitions' node-state rows (TGN
    memory), so a partition that moves takes its rows along. 4 partitions, 4 actors -> 2 ->
    4 mid-run, bitwise the run with 4 fixed shards."""
    want = run(config(PARTS, memory="sharded"), wiki)

    def during(learner) -> None:
        group = learner.group
        _at(learner, 0.15)
        _ask(learner, 2)
        _until(lambda: group.shard_resizes, "the shrink")
        _ask(learner, 4)
        _until(lambda: len(group.shard_resizes) >= 2 or learner.done, "the grow")

    got = run(config({"min": 1, "max": PARTS}, memory="sharded"), wiki, during, join_s=180)
    sizes = [(r["from"], r["to"]) for r in got["shard_resizes"]]
    assert sizes[0] == (4, 2), sizes
    assert_same_run(got, want)


@pytest.mark.slow  # two long runs; run before resolving
def test_rapid_shard_count_requests_leave_a_consistent_run(ray_session, wiki, fixed, quick_polls):
    """Operators change their mind faster than actors start: 1, 4, 2, 4, 1 shard actors a
    few steps apart. Every change starts from the count the last one left, partitions are
    never lost or held twice, and the run is bitwise the one with 4 fixed shards."""

    def during(learner) -> None:
        group = learner.group
        _at(learner, 0.1)
        for count in (1, 4, 2, 4, 1):  # each taken by the driver before the next is asked
            _ask(learner, count)
            _until(lambda c=count: group.shard_target == c or learner.done, "the request taken")

    got = run(config({"min": 1, "max": PARTS}), wiki, during, join_s=180)
    sizes = [(r["from"], r["to"]) for r in got["shard_resizes"]]
    # which counts are carried out depends on when step boundaries fall (a request taken
    # may be replaced by the next before a boundary comes); the chain and its ends may not
    assert sizes and sizes[0][0] == 4 and sizes[-1][1] == 1, sizes
    assert all(a[1] == b[0] for a, b in zip(sizes, sizes[1:], strict=False)), sizes
    assert got["recoveries"] == []
    assert_same_run(got, fixed)
