"""Several Ray nodes on this machine (`ray.cluster_utils.Cluster`, loopback): shards spread
over nodes, sampling and node state travel between them, results equal the local group."""

import sys
from pathlib import Path

import pytest
import ray
import torch

from tidegraph.orchestrator import make_group
from tidegraph.orchestrator.cluster import loopback_cluster
from tidegraph.runtime import set_determinism
from tidegraph.training import ContinualLearner, RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402


@pytest.fixture(scope="module")
def three_nodes():
    cluster, _ = loopback_cluster([2, 2], "tidegraph-cluster-test")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def run(backend: str, memory: str, stream):
    raw = reference_run.reference_config("tgn")
    raw["model"]["slot_precision"] = "fp32"
    raw["cluster"] = {"backend": backend, "shards": 3, "trainers": 2, "memory": memory}
    raw["run_name"] = "cluster-run"
    set_determinism(7, threads=1)
    learner = ContinualLearner(RunConfig.from_dict(raw), stream, make_group)
    try:
        placement = {}
        if backend == "ray":
            local = ray.get([t.local_shards.remote() for t in learner.group.trainers])
            placement = (learner.group.placement(), local)
        learner.run_phase1()
        while not learner.done:
            learner.step()
        return learner.group.model_state(), learner.history, placement
    finally:
        learner.group.shutdown()


# slow: replicated node state (the default suite: sharded, where both the sampled blocks and
# the node state cross nodes; the trainers' collective crosses them in both)
@pytest.mark.parametrize("memory", [pytest.param("replicated", marks=pytest.mark.slow), "sharded"])
def test_shards_spread_over_nodes_and_results_equal_the_local_group(three_nodes, memory):
    stream = load_stream("wikipedia", 1500)
    local = run("local", memory, stream)
    remote = run("ray", memory, stream)
    placement, local_shards = remote[2]
    shard_nodes = {placement[f"tidegraph-shard-{p}"] for p in range(3)}
    for w, mine in enumerate(local_shards):  # in place exactly the shards on its own node
        node = placement[f"tidegraph-trainer-{w}"]
        assert mine == [p for p in range(3) if placement[f"tidegraph-shard-{p}"] == node]
    assert any(len(m) < 3 for m in local_shards)  # and the others by request
    assert len(shard_nodes) == 3  # one shard per node: every hop crosses nodes
    assert len(set(placement.values())) >= 2
    for key, x in local[0].items():
        assert torch.equal(x, remote[0][key]), key
    for a, b in zip(local[1], remote[1], strict=True):
        assert a.get("ap") == b.get("ap") and a.get("loss") == b.get("loss")
