"""Recovery when a whole node goes: a trainer and a shard on it are rebuilt on the node left
free, and the run ends as a fault-free one (several Ray nodes on this machine, loopback)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from tidegraph.orchestrator.ray_group import RayGroup
from tidegraph.runtime import set_determinism
from tidegraph.training import ContinualLearner, RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402

METRICS = ("ap", "auc", "mrr", "old_ap", "loss", "val_ap", "replayed")


@pytest.fixture(scope="module")
def four_nodes():
    """A head with one CPU and three workers with two: a trainer (1.5 CPUs) fits once per
    worker, so the two trainers sit on two workers and the third is free for a replacement."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                        "include_dashboard": False},
    )  # fmt: skip
    for _ in range(3):
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="tidegraph-recovery-cluster")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def run(stream, during=None) -> dict:
    raw = reference_run.reference_config("tgn")
    raw["model"]["slot_precision"] = "fp32"
    raw["train"]["batch_size"] = 50
    raw["cluster"] = {"backend": "ray", "shards": 3, "trainers": 2, "trainer_cpus": 1.5,
                      "shard_cpus": 0.25}  # fmt: skip
    raw["run_name"] = "node-loss"
    set_determinism(7, threads=1)
    learner = ContinualLearner(RunConfig.from_dict(raw), stream)
    thread = None
    if during is not None:
        thread = threading.Thread(target=during, args=(learner,), daemon=True)
        thread.start()
    try:
        learner.run_phase1()
        while not learner.done:
            learner.step()
        return {"model": learner.group.model_state(), "history": learner.history,
                "recoveries": list(learner.group.recoveries),
                "placement": learner.group.placement(),
                "shards": learner.group.report(stream.events.src, stream.events.dst)}  # fmt: skip
    finally:
        if thread is not None:
            thread.join(timeout=120)
        learner.group.shutdown()


@pytest.mark.slow
def test_losing_the_node_of_a_trainer_and_a_shard_recovers_to_the_fault_free_run(four_nodes):
    stream = load_stream("wikipedia", 1500)
    want = run(stream)
    removed = {}

    def remove_trainer_1_node(learner) -> None:
        try:
            remove(learner)
        except Exception as exc:  # reported by the test, not lost in the thread
            removed["error"] = repr(exc)

    def remove(learner) -> None:
        group = learner.group
        node_id = ray.get(group.trainers[1].node_id.remote())
        (node,) = [n for n in four_nodes.list_all_nodes() if n.node_id == node_id]
        for _ in range(6000):  # bounded: until training has made some progress
            if ray.get(group.coordinator.progress.remote()) >= 4:
                removed["node"] = node_id
                removed["shards"] = [p for p, s in enumerate(group.shards)
                                     if ray.get(s.node_id.remote()) == node_id]  # fmt: skip
                four_nodes.remove_node(node)
                return
            time.sleep(0.005)

    default, RayGroup.progress_s = RayGroup.progress_s, 0.01
    try:
        got = run(stream, during=remove_trainer_1_node)
    finally:
        RayGroup.progress_s = default
    assert "node" in removed, f"the node was never removed: {removed}"
    lost = sorted({w for e in got["recoveries"] for w in e.get("lost", [])})
    lost_shards = sorted({p for e in got["recoveries"] for p in e.get("lost_shards", [])})
    assert lost == [1] and lost_shards == removed["shards"]
    assert removed["node"] not in got["placement"].values()
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    for a, b in zip(got["history"], want["history"], strict=True):
        assert {k: a[k] for k in METRICS if k in a} == {k: b[k] for k in METRICS if k in b}
    assert got["shards"]["shard_events"] == want["shards"]["shard_events"]
