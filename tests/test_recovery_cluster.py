"""Recovery when a whole node goes: a trainer and a shard on it are rebuilt on the node left
free, and the run ends as a fault-free one (several Ray nodes on this machine, loopback)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import ray

from tidegraph.orchestrator.cluster import loopback_cluster
from tidegraph.orchestrator.ray_group import RayGroup
from tidegraph.training import RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402
from recovery_run import assert_same_run, run  # noqa: E402


@pytest.fixture(scope="module")
def four_nodes():
    """A head with no CPU (the driver and the run's coordinator only) and three workers with
    two: the shards' SPREAD group puts one shard (0.25 CPUs) on each worker, and a trainer
    (1.5 CPUs) fits once per worker, so each trainer shares its node with a shard and the
    third worker is free for a replacement."""
    cluster, _ = loopback_cluster([2, 2, 2], "tidegraph-recovery-cluster", head_cpus=0)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def config() -> RunConfig:
    raw = reference_run.reference_config("tgn")
    raw["model"]["slot_precision"] = "fp32"
    raw["train"]["batch_size"] = 50
    raw["cluster"] = {"backend": "ray", "shards": 3, "trainers": 2, "trainer_cpus": 1.5,
                      "shard_cpus": 0.25}  # fmt: skip
    raw["run_name"] = "node-loss"
    return RunConfig.from_dict(raw)


def on_node(actors: list, node_id: str) -> list[int]:
    """The indices of the actors that live on `node_id`."""
    return [i for i, n in enumerate(ray.get([a.node_id.remote() for a in actors]))
            if n == node_id]  # fmt: skip


@pytest.mark.slow
def test_losing_the_node_of_a_trainer_and_a_shard_recovers_to_the_fault_free_run(four_nodes):
    stream = load_stream("wikipedia", 1500)
    want = run(config(), stream)
    removed: dict = {}

    def remove_trainer_1_node(learner) -> None:
        group = learner.group
        node_id = ray.get(group.trainers[1].node_id.remote())
        (node,) = [n for n in four_nodes.list_all_nodes() if n.node_id == node_id]
        for _ in range(6000):  # bounded: until training has made some progress
            if ray.get(group.coordinator.progress.remote()) >= 4:
                removed.update(node=node_id, trainers=on_node(group.trainers, node_id),
                               shards=on_node(group.shards, node_id))  # fmt: skip
                four_nodes.remove_node(node)
                return
            time.sleep(0.005)
        raise AssertionError("training made no progress: the node was never removed")

    default, RayGroup.progress_s = RayGroup.progress_s, 0.01
    try:
        got = run(config(), stream, during=remove_trainer_1_node, join_s=120)
    finally:
        RayGroup.progress_s = default
    # the removed node held trainer 1 and one shard (the cluster's shape places them so)
    assert removed["trainers"] == [1] and len(removed["shards"]) == 1, removed
    # both were lost with it, and both were rebuilt on the nodes left
    lost = sorted({w for e in got["recoveries"] for w in e.get("lost", [])})
    lost_shards = sorted({p for e in got["recoveries"] for p in e.get("lost_shards", [])})
    assert lost == removed["trainers"] and lost_shards == removed["shards"]
    rebuilt = [e for e in got["recoveries"] if "events" in e]
    assert [e["lost_shards"] for e in rebuilt] == [removed["shards"]]
    placement = got["placement"]
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert removed["node"] not in placement.values() and set(placement.values()) <= alive
    assert "tidegraph-trainer-1" in placement
    assert all(f"tidegraph-shard-{p}" in placement for p in removed["shards"])
    assert_same_run(got, want)
