"""Where a run's node state lives: replicated on every trainer, or sharded with the graph.

`choose_memory_placement` resolves `cluster.memory: auto` by the node state's size against
`cluster.memory_budget_mb`; `state_row_bytes` measures a node's state for the configured model;
`check_placement` refuses a checkpoint whose node state was placed the other way.
"""

from __future__ import annotations

import logging

import torch

from tidegraph.models.config import build_model

__all__ = ["check_placement", "choose_memory_placement", "state_row_bytes"]

log = logging.getLogger(__name__)


def choose_memory_placement(cluster, num_nodes: int, row_bytes: int) -> str:
    """`cluster.memory`, with "auto" resolved by the size rule; logs the choice and why."""
    total = num_nodes * row_bytes
    budget = cluster.memory_budget_mb * 2**20
    if cluster.memory != "auto":
        log.info(
            "memory placement %s (configured); node state %d nodes x %d B = %.1f MB",
            cluster.memory, num_nodes, row_bytes, total / 2**20,
        )  # fmt: skip
        return cluster.memory
    choice = "replicated" if total <= budget else "sharded"
    log.info(
        "memory placement %s: node state %d nodes x %d B = %.1f MB %s the %.0f MB budget",
        choice, num_nodes, row_bytes, total / 2**20, "fits" if total <= budget else "exceeds",
        cluster.memory_budget_mb,
    )  # fmt: skip
    return choice


def check_placement(state: dict, placement: str) -> None:
    saved = state.get("memory_placement", placement)
    if saved != placement:
        raise ValueError(
            f"checkpoint keeps node state {saved}, this run places it {placement}: set "
            f"cluster.memory: {saved} to resume it"
        )


def state_row_bytes(config, edge_dim: int) -> int:
    """Bytes of node state per node of the configured model (0: no node state)."""
    with torch.random.fork_rng(devices=[]):  # a model for its shapes: draw nothing global
        probe = build_model(config.model, 1, edge_dim, num_snapshots=config.sampler.num_snapshots)
    tables = probe.state_tables().values()
    return sum(x[:1].numel() * x.element_size() for x in tables if x.dim() >= 1)
