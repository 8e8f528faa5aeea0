"""Several Ray nodes on this machine (`ray.cluster_utils.Cluster`, loopback): shards spread
over nodes, sampling and node state travel between them, results equal the local group; custom
resources (`cluster.trainer_resources`, `shard_resources`) decide which nodes hold which."""

import sys
from pathlib import Path

import pytest
import ray
import torch

from tidegraph.orchestrator import make_group
from tidegraph.orchestrator.cluster import loopback_cluster, until
from tidegraph.orchestrator.placement import slot_node
from tidegraph.runtime import set_determinism
from tidegraph.training import ContinualLearner, RunConfig, load_stream

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402


@pytest.fixture(scope="module")
def three_nodes():
    # custom resources that only test_custom_resources_* asks for: shards on the head,
    # trainers on the first worker
    resources = [{"tg_shard": 2}, {"tg_trainer": 3}, {}]
    cluster, _ = loopback_cluster([2, 2], "tidegraph-cluster-test", resources=resources)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def run(backend: str, memory: str, stream, shards: int = 3, **cluster):
    raw = reference_run.reference_config("tgn")
    raw["model"]["slot_precision"] = "fp32"
    raw["cluster"] = {"backend": backend, "shards": shards, "trainers": 2, "memory": memory,
                      **cluster}  # fmt: skip
    raw["run_name"] = "cluster-run"
    set_determinism(7, threads=1)
    learner = ContinualLearner(RunConfig.from_dict(raw), stream, make_group)
    try:
        placement = {}
        if backend == "ray":
            local = ray.get([t.local_shards.remote() for t in learner.group.trainers])
            spares = [until(lambda pg=pg: slot_node(pg), 60, "a spare trainer's slot")
                      for pg in learner.group.spares]  # fmt: skip
            placement = (learner.group.placement(), local, spares)
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
    placement, local_shards, _ = remote[2]
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


def nodes_offering(resource: str) -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]


def test_custom_resources_decide_which_nodes_hold_trainers_and_shards(three_nodes):
    """Trainers (and the spare's slot) only on the node offering "tg_trainer", shards only
    where "tg_shard" is, though the other nodes have room; the local backend ignores the
    resources, and the results are equal."""
    stream = load_stream("wikipedia", 1500)
    cluster = {"trainer_cpus": 0.5, "spare_trainers": 1, "trainer_resources": {"tg_trainer": 1},
               "shard_resources": {"tg_shard": 1}}  # fmt: skip
    local = run("local", "replicated", stream, shards=2, **cluster)
    remote = run("ray", "replicated", stream, shards=2, **cluster)
    (placement, _, spares), [trainer_node], [shard_node] = (
        remote[2], nodes_offering("tg_trainer"), nodes_offering("tg_shard"))  # fmt: skip
    assert [placement[f"tidegraph-trainer-{w}"] for w in range(2)] == [trainer_node] * 2
    assert spares == [trainer_node]
    assert [placement[f"tidegraph-shard-{p}"] for p in range(2)] == [shard_node] * 2
    for key, x in local[0].items():
        assert torch.equal(x, remote[0][key]), key
