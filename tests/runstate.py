"""A finished run's state read back from its run directory, and the bitwise comparison of two
runs' states: parameters, optimizer, node state, shards and the schedule's position and
random streams, as the newest checkpoint (written at the end of a run) holds them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tidegraph.storage.checkpoint import CheckpointStore
from tidegraph.storage.graph import DynamicGraph

__all__ = ["RAY_ONLY", "assert_same_state", "final_state", "records", "with_segments"]

# what a Ray group's state holds and a local group's does not (its bookkeeping of ingests
# and membership, not the run's result)
RAY_ONLY = ("start_trainers", "ingests", "journal_pos")


def records(run: Path) -> list[dict]:
    """metrics.jsonl's rows without their throughputs (wall-clock rates)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in rows]


def final_state(run: Path, tag: str | None = None) -> dict:
    """The learner's state in the run's checkpoint `tag` (default: its newest), each shard's
    graph as its segments (`with_segments`)."""
    state = CheckpointStore.at(str(run / "checkpoints")).load(tag)["learner"]
    with_segments(state["group"]["shards"])
    return state


def with_segments(shards: list[dict]) -> None:
    """Shard states whose graph is pieces (a checkpoint's, which depend on when checkpoints
    were taken) given the segments those pieces load as: the graph itself, comparable
    between runs that checkpointed at other times."""
    for shard in shards:
        if "pieces" in shard["graph"]:
            graph = DynamicGraph(add_reverse=shard["graph"]["add_reverse"])
            graph.load_state_dict(shard["graph"])
            shard["graph"] = graph.state_dict()


def assert_same_state(got: dict, want: dict, ignore: tuple = ()) -> None:
    """Every trainer's parameters, optimizer and node state, every shard and the schedule's
    state bitwise the same; `ignore`: group keys left out (`RAY_ONLY` against a local run)."""
    assert got.keys() == want.keys() == {"orchestrator", "group"}
    group = [{k: v for k, v in s["group"].items() if k not in ignore} for s in (got, want)]
    assert group[0]["trainers"] and group[0]["shards"]  # something to compare
    _same(group[0], group[1], "group")
    _same(got["orchestrator"], want["orchestrator"], "orchestrator")


def _same(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            if not str(key).endswith("_per_s"):  # throughputs: wall clock
                _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: a tensor and a {type(b).__name__}"
        kinds = [(x.dtype, tuple(x.shape)) for x in (a, b)]
        assert kinds[0] == kinds[1], f"{where}: {kinds[0]} != {kinds[1]}"
        assert torch.equal(a, b), f"{where}: values differ"
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"  # NaN equals NaN
