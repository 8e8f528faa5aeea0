"""Serving replicas keep off the training group's nodes (README, "Replicas and resources"): on
a three-node loopback cluster whose only `tg_serve` node is one worker, a replica that asks for
`tg_serve` runs there and nowhere else, and answers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serving import free_port, http, make_run, run_config  # noqa: E402


@pytest.mark.slow
def test_a_replica_asking_for_a_serving_resource_runs_on_the_serving_node(tmp_path):
    import ray
    from ray import serve

    from tidegraph.orchestrator.cluster import loopback_cluster
    from tidegraph.serving.app import server_app

    make_run(tmp_path, "r", run_config("tgn"))
    cluster, (serving, training) = loopback_cluster(
        [1, 1], "tidegraph-serve-cluster", head_cpus=1,
        resources=[{}, {"tg_serve": 2}, {"tg_trainer": 1}],
    )  # fmt: skip
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = server_app("r", str(tmp_path), num_cpus=0.5, resources={"tg_serve": 1}, replicas=2)
        serve.run(app, name="tidegraph-r", route_prefix="/")
        nodes = set()
        for _ in range(40):  # bounded: requests spread over both replicas
            status, answer = http(f"http://127.0.0.1:{port}/status")
            assert status == 200 and answer["lag_events"] == 0
            nodes.add(answer["replica_node"])
        assert nodes == {serving.node_id} and training.node_id not in nodes
        # Ray Serve's autoscaling instead of a count (`--replicas 1:2`), on the same node
        scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2}
        app = server_app("r", str(tmp_path), num_cpus=0.5, resources={"tg_serve": 1},
                         replicas=scaling)  # fmt: skip
        serve.run(app, name="tidegraph-r", route_prefix="/")
        (deployment,) = serve.status().applications["tidegraph-r"].deployments.values()
        assert deployment.status == "HEALTHY"
        status, answer = http(f"http://127.0.0.1:{port}/status")
        assert status == 200 and answer["replica_node"] == serving.node_id
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
