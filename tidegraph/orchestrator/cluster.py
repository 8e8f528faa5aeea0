"""Joining a Ray cluster, or starting a local one sized for the run.

`connect(config)`: with `RAY_ADDRESS` set (a cluster, or inside `ray job submit`) join it;
otherwise start a local Ray bound to 127.0.0.1 with enough logical CPUs for the run's actors
(trainers x `trainer_cpus` + shards x `shard_cpus`, at least the machine's cores) and plenty of
each custom resource of `cluster.trainer_resources` and `shard_resources` (`_LOCAL_PLENTY`
times what the run's actors ask at most, at least `_LOCAL_FLOOR`). On one node such resources
choose no node, so there is no point in counting them exactly; an exact count would leave no
room for a bundle asked while an old one is still held: a moved partition's or a replica's
successor (`shard_table`), a replacement or joining trainer, more shard actors. Works with
Ray's token authentication on or off (a local start makes its own token; a cluster's is read
from the environment or ~/.ray as Ray does).
"""

from __future__ import annotations

import logging
import math
import os

if not os.environ.get("RAY_ADDRESS"):
    # a local Ray on this machine only: keep 127.0.0.1 (on Linux Ray otherwise swaps it for
    # the address other hosts would reach it at); read when ray is first imported
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # trainers' collectives on loopback

import ray  # noqa: E402

__all__ = ["connect", "local_resources", "loopback_cluster", "until"]

log = logging.getLogger(__name__)

# a local Ray's custom resources: this many times what the run's actors ask at most (max
# trainers and spares, max shard actors and their replicas), and at least this many units
_LOCAL_PLENTY = 4
_LOCAL_FLOOR = 1000


def connect(config) -> bool:
    """Make Ray available to this process; returns True when it started a local instance."""
    if ray.is_initialized():
        return False
    namespace = config.run_name or "tidegraph"
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=namespace)
        log.info("joined the Ray cluster at %s (namespace %r)", address, namespace)
        return False
    c = config.cluster
    trainers = c.trainers + getattr(c, "spare_trainers", 0)
    shards = c.shards * getattr(c, "shard_replicas", 1)
    need = math.ceil(trainers * c.trainer_cpus + shards * c.shard_cpus)
    cpus = max(os.cpu_count() or 1, need)
    resources = _local_resources(c)
    ray.init(
        _node_ip_address="127.0.0.1", num_cpus=cpus, resources=resources or None,
        namespace=namespace, include_dashboard=False, configure_logging=False,
    )  # fmt: skip
    log.info("started a local Ray with %d logical CPUs%s (namespace %r)", cpus,
             f" and {resources}" if resources else "", namespace)  # fmt: skip
    return True


def _local_resources(c) -> dict[str, int]:
    """A local Ray's custom resources (see the module's docstring) for the run's trainers and
    shard actors."""
    trainers = (getattr(c, "max_trainers", None) or c.trainers) + getattr(c, "spare_trainers", 0)
    shards = (getattr(c, "max_shards", None) or c.shards) * getattr(c, "shard_replicas", 1)
    return local_resources([(trainers, c.trainer_resources), (shards, c.shard_resources)])


def local_resources(asks) -> dict[str, int]:
    """Plenty of each custom resource that `asks` ([(actors, resources each asks for)], at
    most) name, in whole units as a node's are: a local Ray's (see the module's docstring)."""
    most: dict[str, float] = {}
    for count, asked in asks:
        for name, amount in asked.items():
            most[name] = most.get(name, 0) + count * amount
    return {k: max(_LOCAL_FLOOR, math.ceil(_LOCAL_PLENTY * v)) for k, v in most.items()}


def loopback_cluster(
    worker_cpus: list[float],
    namespace: str,
    head_cpus: float = 1.0,
    resources: list[dict] | None = None,
):
    """Several Ray nodes on this machine, all on 127.0.0.1 (tests, benchmarks): a head with
    `head_cpus` and one worker per entry of `worker_cpus`, this process connected in
    `namespace`; `resources`: custom resources of the head, then of each worker (default
    none). Returns (cluster, workers); stop with `ray.shutdown()`, `cluster.shutdown()`."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    head, *each = resources or [{}] * (1 + len(worker_cpus))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "node_ip_address": "127.0.0.1",
                        "include_dashboard": False, "resources": head},
    )  # fmt: skip
    try:
        workers = [cluster.add_node(num_cpus=c, node_ip_address="127.0.0.1", resources=r)
                   for c, r in zip(worker_cpus, each, strict=True)]  # fmt: skip
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=namespace, configure_logging=False)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster, workers


def until(check, timeout_s: float, what: str, every_s: float = 0.02):
    """`check()`'s first truthy value, polled every `every_s` (tests, benchmarks driving a
    cluster); TimeoutError naming `what` after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
