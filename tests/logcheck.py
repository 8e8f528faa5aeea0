"""What every partition holds, checked against the durable event log of its run.

Events are ingested exactly once (README, DESIGN "Failure model"): after any recovery or
partition move, partition p holds, for each event (u, v, t, eid) in the log, the half-edge
u -> v when p owns u and v -> u when p owns v, once each, and nothing else. The log is read
back from its Parquet files and cut with the group's partitioner here, independently of the
shard code that routed the events, so a batch ingested twice, or one lost, fails the check.

The node state a partition holds (`cluster.memory: sharded`) is compared between runs node
by node (`node_rows`), since the row a node gets is a detail of how the partition was built.
"""

from __future__ import annotations

import torch

from tidegraph.storage.eventlog import EventLog
from tidegraph.storage.idmap import IdMap

__all__ = ["assert_held_as_logged", "assert_same_node_rows", "logged_counts", "node_rows"]


def dense_ids(idmap: IdMap, src: torch.Tensor, dst: torch.Tensor) -> tuple:
    """The log's (external) ids as the run's dense ids, read from a copy of its id map;
    every logged id must be in it already."""
    if idmap.kind != "int" or not idmap.mapped:
        return src, dst  # the log holds the dense ids themselves
    copy = IdMap.from_state(idmap.state_dict())
    src, dst = copy.map_events(src, dst)
    assert len(copy) == len(idmap), "the log holds node ids the run never mapped"
    return src, dst


def logged_counts(src: torch.Tensor, dst: torch.Tensor, partitioner) -> list[int]:
    """Events each partition must hold: those with an endpoint it owns (a self-loop or an
    event inside it counts once)."""
    own_src, own_dst = partitioner.owner(src), partitioner.owner(dst)
    return [int(((own_src == p) | (own_dst == p)).sum()) for p in range(partitioner.num_parts)]


def _sorted(node, nbr, t, eid) -> torch.Tensor:
    """Half-edges as rows (node, nbr, eid, t's bits), in (eid, node) order."""
    rows = torch.stack([node, nbr.long(), eid, t.double().view(torch.int64)], 1)
    rows = rows[torch.sort(rows[:, 0], stable=True).indices]
    return rows[torch.sort(rows[:, 2], stable=True).indices]


def _stored(graph: dict) -> torch.Tensor:
    """Every half-edge a partition's graph holds (its segments, whatever their merges)."""
    parts = [
        (s["nodes"].repeat_interleave(s["offsets"].diff()), s["nbr"], s["t"], s["eid"])
        for s in graph["segments"]
    ]
    if not parts:
        return torch.empty(0, 4, dtype=torch.int64)
    return _sorted(*(torch.cat([p[i].cpu() for p in parts]) for i in range(4)))


def assert_held_as_logged(states: list[dict], partitioner, log: EventLog, idmap: IdMap,
                          ingested: int) -> list[int]:  # fmt: skip
    """Every partition (`group.shard_states()`) holds exactly the half-edges the log routes
    to it, and counts its events as the log does; its node-state rows (if it keeps node
    state) are the nodes it owns. Returns the logged events per partition."""
    events = log.read()
    assert len(events) == ingested, (len(events), ingested)  # nothing beyond, no gap
    assert torch.equal(events.eid, torch.arange(ingested)), "the log is not events 0.. once"
    src, dst = dense_ids(idmap, events.src, events.dst)
    own_src, own_dst = partitioner.owner(src), partitioner.owner(dst)
    counts = logged_counts(src, dst, partitioner)
    assert len(states) == partitioner.num_parts
    for p, state in enumerate(states):
        a, b = own_src == p, own_dst == p
        want = _sorted(torch.cat([src[a], dst[b]]), torch.cat([dst[a], src[b]]),
                       torch.cat([events.t[a], events.t[b]]),
                       torch.cat([events.eid[a], events.eid[b]]))  # fmt: skip
        got = _stored(state["graph"])
        assert got.shape == want.shape, f"partition {p}: {len(got)} half-edges, log {len(want)}"
        bad = (got != want).any(1).nonzero()
        assert not len(bad), f"partition {p}: half-edge {got[bad[0, 0]].tolist()} is not logged"
        assert state["num_events"] == counts[p], (p, state["num_events"], counts[p])
        if state.get("node_state") is not None:
            rows = node_rows(state["node_state"])
            assert torch.equal(rows["nodes"], torch.unique(want[:, 0])), f"partition {p}"
    return counts


def node_rows(node_state: dict | None) -> dict | None:
    """A partition's node state (`ShardNodeState.state_dict()`) keyed by node: the nodes it
    has rows for, ascending, and each table's rows in that order."""
    if node_state is None:
        return None
    row_of = node_state["index"]["row_of"]
    nodes = (row_of >= 0).nonzero().squeeze(1)
    rows = row_of[nodes]
    tables = {k: v.index_select(0, rows) for k, v in node_state["tables"].items()}
    return {"nodes": nodes, "tables": tables}


def assert_same_node_rows(got: list, want: list) -> None:
    """Partition by partition, the same nodes with bitwise the same rows."""
    assert len(got) == len(want)
    for p, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None) == (b is None), p
        if a is None:
            continue
        assert torch.equal(a["nodes"], b["nodes"]), f"partition {p}: other nodes"
        assert a["tables"].keys() == b["tables"].keys(), p
        for name, table in b["tables"].items():
            mine = a["tables"][name]
            assert (mine.dtype, mine.shape) == (table.dtype, table.shape), (p, name)
            same = mine.view(torch.uint8) == table.view(torch.uint8)  # bits
            assert bool(same.all()), f"partition {p}: node state {name!r} differs"
