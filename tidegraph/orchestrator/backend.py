"""The group that `cluster.backend` names, built on the side of the code that may import Ray.

`ContinualLearner` (training/continual.py) takes a group factory and builds only `LocalGroup`
by itself, so `training/` never imports Ray or starts actors. Entry points (`Orchestrator`, the
job's offline mode), benchmarks and tests that run on either backend pass `make_group`, which
imports `RayGroup` (and so Ray) only when the backend is "ray": a local run never loads Ray.
"""

from __future__ import annotations

from tidegraph.training.group import LocalGroup

__all__ = ["make_group"]


def make_group(config, num_nodes: int, edge_dim: int, expected_nodes: int | None = None):
    """A group factory for `ContinualLearner`: `RayGroup` (shard and trainer actors; Ray must be
    initialized) when `config.cluster.backend` is "ray", else `LocalGroup`."""
    if config.cluster.backend == "ray":
        from tidegraph.orchestrator.ray_group import RayGroup

        return RayGroup(config, num_nodes, edge_dim, expected_nodes=expected_nodes)
    return LocalGroup(config, num_nodes, edge_dim, expected_nodes=expected_nodes)
