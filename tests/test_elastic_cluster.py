"""Elastic groups on several Ray nodes (loopback): a node joins mid-run and a trainer (or a
shard actor) starts there and joins the group; the node is drained and its trainer leaves
(its partitions go to another actor) before the deadline; a run whose minimum cannot be
placed waits, naming what is missing, until a node joins.
Each run ends where a fixed-size run ends, up to float summation order (slow)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.core.generated import autoscaler_pb2

from tidegraph.orchestrator.cluster import loopback_cluster, until
from tidegraph.orchestrator.ray_group import RayGroup
from tidegraph.training import RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402
from numerics import float64_everywhere  # noqa: E402
from recovery_run import assert_same_run, run  # noqa: E402
from test_elastic import EVENTS, assert_close_run  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def head_only():
    """A head with room for two shards and one trainer, nothing more (workers join later)."""
    cluster, _ = loopback_cluster([], "tidegraph-elastic-cluster", head_cpus=2)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", EVENTS)


@pytest.fixture(scope="module", autouse=True)
def _float64():
    """Runs compared with `assert_close_run` are in float64 (see tests/numerics.py)."""
    with float64_everywhere():
        yield


def drain(cluster, node) -> float:
    """Ray's DrainNode on `node` (a spot preemption notice, 30 s deadline); when it was sent
    (monotonic)."""
    gcs = ray._raylet.GcsClient(address=cluster.address)
    sent = time.monotonic()
    accepted, why = gcs.drain_node(
        node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "test: spot preemption", int(time.time() * 1000) + 30_000,
    )  # fmt: skip
    assert accepted, why
    return sent


def config(trainers) -> RunConfig:
    raw = reference_run.reference_config("tgn")
    raw["model"]["slot_precision"] = "fp32"
    raw["data"]["max_events"] = EVENTS
    # long enough (~15 s) for a node to join and a trainer process to start there meanwhile
    raw["train"].update(batch_size=100, epochs=8)
    raw["continual"].update(num_increments=4, retrain_epochs=8)
    raw["cluster"] = {"backend": "ray", "trainers": trainers, "shards": 2, "trainer_cpus": 1,
                      "shard_cpus": 0.5, "elastic_poll_s": 0.1}  # fmt: skip
    raw["run_name"] = "elastic-cluster"
    return RunConfig.from_dict(raw)


def test_a_joining_node_grows_the_group_and_a_drained_one_shrinks_it(head_only, wiki, monkeypatch):
    monkeypatch.setattr(RayGroup, "progress_s", 0.02)
    fixed = run(config(1), wiki)
    seen: dict = {}

    def during(learner) -> None:
        group = learner.group
        node = head_only.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        seen["joined"] = time.monotonic()
        grow = until(lambda: group.resizes[:1], 120, "a trainer to join on the new node")
        seen["grow"] = grow[0]
        seen["drain"] = drain(head_only, node)
        shrink = until(lambda: group.resizes[1:2], 30, "the drained node's trainer to leave")
        seen["shrink"], seen["left_s"] = shrink[0], time.monotonic() - seen["drain"]
        head_only.remove_node(node)  # the node goes away: nothing of the run was on it

    got = run(config({"min": 1, "max": 2}), wiki, during, join_s=180, during_in_main=True)
    assert "shrink" in seen, seen
    grow, shrink = seen["grow"], seen["shrink"]
    assert (grow["from"], grow["to"]) == (1, 2) and "slot" in grow["reason"]
    assert (shrink["from"], shrink["to"]) == (2, 1) and "draining" in shrink["reason"]
    assert shrink["left"][0]["member"] == grow["joined"][0]
    assert seen["left_s"] < 30  # before the drain deadline
    assert got["recoveries"] == []  # it left: nothing was lost with the node
    assert got["trainer_steps"] == [fixed["steps"]]
    assert_close_run(got, fixed)


def test_a_run_waits_for_its_minimum_naming_what_is_missing(head_only, wiki, caplog):
    """min 2 trainers do not fit the head: the group waits (logging the missing resources)
    and starts once a node joins (added here, in the main thread, as Ray requires)."""
    caplog.set_level("INFO", logger="tidegraph.orchestrator")
    out: dict = {}

    def whole_run() -> None:
        try:
            out["got"] = run(config({"min": 2, "max": 2}), wiki)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=whole_run, daemon=True)
    thread.start()
    until(lambda: any("waiting for resources" in r.getMessage() for r in caplog.records),
           60, "the group to say what it waits for")  # fmt: skip
    node = head_only.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    try:
        thread.join(timeout=300)
    finally:
        head_only.remove_node(node)
    assert "error" not in out, out.get("error")
    waits = [r.getMessage() for r in caplog.records if "waiting for resources" in r.getMessage()]
    assert "of 2..2 trainers" in waits[0] and "available" in waits[0]
    got = out["got"]
    assert got["trainer_steps"] == [got["steps"]] * 2


def test_a_lost_node_with_no_room_elsewhere_shrinks_the_group(head_only, wiki, monkeypatch):
    """The node of the joined trainer goes away without notice: no slot is free for a
    replacement, so the group (above its minimum) goes on with one trainer, from the
    survivor's whole steps; a pending slot is kept to grow back."""
    monkeypatch.setattr(RayGroup, "progress_s", 0.02)
    monkeypatch.setattr(RayGroup, "replace_wait_s", 1.0)
    fixed = run(config(1), wiki)

    def during(learner) -> None:
        group = learner.group
        node = head_only.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        until(lambda: group.resizes[:1], 120, "a trainer to join on the new node")
        head_only.remove_node(node, allow_graceful=False)
        until(lambda: group.recoveries, 60, "the recovery")

    got = run(config({"min": 1, "max": 2}), wiki, during, join_s=180, during_in_main=True)
    (event,) = got["recoveries"]
    assert event["lost"] == [1] and event["dropped"] == [1]
    assert [(r["from"], r["to"]) for r in got["resizes"]] == [(1, 2), (2, 1)]
    assert got["resizes"][1]["at"] == "recovery"
    assert got["trainer_steps"] == [fixed["steps"]]
    assert_close_run(got, fixed)


def test_a_drained_node_hands_its_shard_over_before_the_deadline(head_only, wiki, monkeypatch):
    """A shard on a node that Ray drains moves to a successor elsewhere (started while the
    group trains, state copied at a step boundary); the node is then removed with nothing of
    the run on it, and the run is bitwise the one whose shards never moved."""
    monkeypatch.setattr(RayGroup, "progress_s", 0.02)
    fixed = run(config(1), wiki)
    node = head_only.add_node(num_cpus=1, node_ip_address="127.0.0.1")  # one shard goes here
    seen: dict = {}

    def during(learner) -> None:
        group = learner.group
        (part,) = [p for p, n in enumerate(group._shard_nodes()) if n == node.node_id]
        seen["drain"] = drain(head_only, node)
        until(lambda: group.shard_moves, 30, "the drained node's shard to move")
        seen["moved_s"], seen["part"] = time.monotonic() - seen["drain"], part
        head_only.remove_node(node)

    try:
        got = run(config(1), wiki, during, join_s=180, during_in_main=True)
    finally:
        if node in head_only.worker_nodes:
            head_only.remove_node(node)
    move = got["shard_moves"][0]  # to the shard actor on the head (no process to start)
    assert move["part"] == seen["part"] and move["from_node"] == node.node_id
    assert all(m["to_node"] != node.node_id for m in got["shard_moves"])
    assert seen["moved_s"] < 30  # before the drain deadline
    assert got["recoveries"] == []
    assert_same_run(got, fixed)


def test_a_joining_node_gets_a_shard_actor_and_a_drained_one_hands_it_back(
    head_only, wiki, monkeypatch
):
    """`shards: {min: 1, max: 2}` on a head with room for one shard actor: it holds both
    partitions. A node joins: an actor starts there and takes a partition over at a step
    boundary; the node is drained: the partition goes back to the head's actor before the
    deadline. The run is bitwise the one with 2 fixed shards."""
    monkeypatch.setattr(RayGroup, "progress_s", 0.02)
    fixed = run(config(1), wiki)
    cfg = config(1)
    cfg.cluster.shards, cfg.cluster.min_shards, cfg.cluster.max_shards = 2, 1, 2
    cfg.cluster.shard_cpus = 1.0  # the head (2 CPUs) has room for a trainer and one actor
    seen: dict = {}

    def during(learner) -> None:
        group = learner.group
        seen["start"] = len(group._shard_hosts())
        node = head_only.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        seen["node"] = node.node_id
        until(lambda: group.shard_resizes[:1], 120, "a shard actor to start on the new node")
        seen["grown"] = {n for n in group._shard_nodes()}
        seen["drain"] = drain(head_only, node)
        until(lambda: group.shard_resizes[1:2], 30, "the partition to come back")
        seen["back_s"] = time.monotonic() - seen["drain"]
        seen["after"] = {n for n in group._shard_nodes()}
        head_only.remove_node(node)

    got = run(cfg, wiki, during, join_s=180, during_in_main=True)
    assert seen["start"] == 1
    assert seen["node"] in seen["grown"] and len(seen["grown"]) == 2
    assert seen["node"] not in seen["after"] and len(seen["after"]) == 1
    sizes = [(r["from"], r["to"]) for r in got["shard_resizes"]]
    assert sizes[:2] == [(1, 2), (2, 1)], sizes
    assert "draining" in got["shard_resizes"][1]["reason"]
    assert seen["back_s"] < 30  # before the drain deadline
    assert got["recoveries"] == []
    assert_same_run(got, fixed)
