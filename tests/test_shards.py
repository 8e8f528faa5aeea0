"""Graph shards, partitioners, routing, node-state placement and per-owner state."""

import copy
import json
import logging

import pytest
import torch

from tidegraph.jobs.train import main
from tidegraph.runtime import set_determinism
from tidegraph.sampling.multihop import MultiHopSampler
from tidegraph.sampling.sampler import TemporalSampler
from tidegraph.storage.events import EventBatch
from tidegraph.storage.graph import DynamicGraph
from tidegraph.storage.partition import (
    HashPartitioner,
    LDGPartitioner,
    build_partitioner,
    partition_report,
)
from tidegraph.training import ContinualLearner, RunConfig, ShardCore, load_stream
from tidegraph.training.config import ClusterConfig
from tidegraph.training.group import LocalGroup, choose_memory_placement
from tidegraph.training.shard import route_events


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", 20000)


def with_features(events: EventBatch) -> EventBatch:
    feat = torch.stack([events.t.float(), events.src.float(), events.eid.float()], 1)
    return EventBatch(events.src, events.dst, events.t, events.eid, feat)


# ---- partitioners ---------------------------------------------------------------------------


def test_hash_spreads_runs_of_ids_evenly_and_needs_no_state():
    part = HashPartitioner(4)
    own = part.owner(torch.arange(100_000))
    counts = torch.bincount(own, minlength=4)
    assert counts.min() > 24_000 and counts.max() < 26_000
    assert torch.equal(own, HashPartitioner(4).owner(torch.arange(100_000)))
    assert torch.equal(HashPartitioner(1).owner(torch.arange(5)), torch.zeros(5, dtype=torch.long))


def test_ldg_cuts_fewer_edges_than_hash_and_stays_balanced(wiki):
    ev = wiki.events
    ldg, hashed = LDGPartitioner(3), HashPartitioner(3)
    for lo in range(0, len(ev), 1000):  # streamed: each batch places its new nodes
        ldg.assign(ev.src[lo : lo + 1000], ev.dst[lo : lo + 1000])
    nodes = torch.arange(int(torch.maximum(ev.src.max(), ev.dst.max())) + 1)
    seen = torch.zeros(nodes.shape[0], dtype=torch.bool)
    seen[ev.src] = True
    seen[ev.dst] = True
    ldg_owner = torch.where(seen, ldg.map[: nodes.shape[0]], 0)
    a = partition_report(ev.src, ev.dst, ldg_owner)
    b = partition_report(ev.src, ev.dst, hashed.owner(nodes))
    assert a["edge_cut"] < 0.8 * b["edge_cut"], (a, b)
    assert a["node_balance"] <= 1.1 + 1e-9, a  # LDG's capacity bound with slack 1.1
    assert b["edge_cut"] > 0.6  # 3 hash shards cut ~2/3 of the edges
    with pytest.raises(ValueError, match="never placed"):
        ldg.owner(torch.tensor([nodes.shape[0] + 5]))
    again = LDGPartitioner(3)
    again.load_state_dict(ldg.state_dict())
    assert torch.equal(again.owner(ev.src), ldg.owner(ev.src))
    with pytest.raises(ValueError, match="hash over 3"):
        LDGPartitioner(3).load_state_dict(HashPartitioner(3).state_dict())
    with pytest.raises(ValueError, match="must be one of"):
        build_partitioner("metis", 2)


# ---- routing and shard contents ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hash", "ldg"])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_every_event_lands_at_both_owners_and_each_feature_row_once(wiki, kind, parts):
    ev = with_features(wiki.events.select(slice(0, 5000)))
    part = build_partitioner(kind, parts)
    shards = [ShardCore(p, parts, edge_dim=3) for p in range(parts)]
    for lo in range(0, 5000, 700):
        batch = ev.select(slice(lo, lo + 700))
        part.assign(batch.src, batch.dst)
        pieces = route_events(batch, part.owner(batch.src), part.owner(batch.dst), parts)
        for shard, piece in zip(shards, pieces, strict=True):
            shard.ingest(piece)
    own_src, own_dst = part.owner(ev.src), part.owner(ev.dst)
    assert sum(s.graph.num_stored_edges for s in shards) == 2 * len(ev)
    for p, shard in enumerate(shards):  # every shard's event count equals the log's
        assert shard.num_events == int(((own_src == p) | (own_dst == p)).sum())
        assert shard.num_feature_rows == len(range(p, 5000, parts))
        mine = torch.arange(p, 5000, parts)
        assert torch.equal(shard.fetch(mine).data, ev.edge_feat[mine])


def test_sampling_over_shards_equals_one_graph_with_every_edge(wiki):
    ev = wiki.events.select(slice(0, 8000))
    graph = DynamicGraph()
    for lo in range(0, 8000, 1000):
        graph.add_edges(ev.src[lo : lo + 1000], ev.dst[lo : lo + 1000], ev.t[lo : lo + 1000],
                        ev.eid[lo : lo + 1000])  # fmt: skip
    roots = torch.cat([ev.src[7000:7400], ev.dst[7000:7400]])
    ts = torch.cat([ev.t[7000:7400], ev.t[7000:7400]])
    for snaps, window in ((1, 0.0), (3, 20000.0)):
        one = TemporalSampler(graph, [5, 3], num_snapshots=snaps, snapshot_window=window,
                              dedup=True).sample(roots, ts)  # fmt: skip
        for parts in (2, 3):
            part = HashPartitioner(parts)
            shards = [ShardCore(p, parts) for p in range(parts)]
            for lo in range(0, 8000, 1000):
                b = ev.select(slice(lo, lo + 1000))
                pieces = route_events(b, part.owner(b.src), part.owner(b.dst), parts)
                for shard, piece in zip(shards, pieces, strict=True):
                    shard.ingest(piece)
            sampler = MultiHopSampler(shards, part.owner, [5, 3], snaps, window, dedup=True)
            many = sampler.sample(roots, ts)
            assert sampler.requests == parts * 2 * snaps  # one per shard per hop (per window)
            flat_one = one if snaps == 1 else [b for w in one for b in w]
            flat_many = many if snaps == 1 else [b for w in many for b in w]
            for a, b in zip(flat_one, flat_many, strict=True):
                for name in ("dst_ids", "dst_ts", "nbr_ids", "nbr_ts", "nbr_eids", "dt", "mask"):
                    assert torch.equal(getattr(a, name), getattr(b, name)), (parts, name)
                assert (a.next_index is None) == (b.next_index is None)
                if a.next_index is not None:
                    assert torch.equal(a.next_index, b.next_index)


# ---- node-state placement ------------------------------------------------------------------------


def test_auto_placement_replicates_while_the_state_fits_the_budget(caplog):
    with caplog.at_level(logging.INFO, logger="tidegraph.training.state_placement"):
        small = ClusterConfig(memory_budget_mb=1.0)
        assert choose_memory_placement(small, 1000, 1000) == "replicated"
        assert choose_memory_placement(small, 2000, 1000) == "sharded"
        assert choose_memory_placement(ClusterConfig(memory="sharded"), 10, 10) == "sharded"
    assert "exceeds the 1 MB budget" in caplog.text and "fits the 1 MB budget" in caplog.text


# ---- state: one piece per owner ----------------------------------------------------------


def small(**cluster) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"name": "tgn", "dim": 16, "time_dim": 8, "memory_dim": 16},
        "data": {"max_events": 3000},
        "train": {"batch_size": 200, "epochs": 1, "eval_negatives": 3},
        "continual": {"num_increments": 2, "forget_sample": 100, "train_fraction": 0.6},
        "cluster": cluster, "progress": False, "out_dir": None,
    })  # fmt: skip


@pytest.mark.parametrize("memory", ["replicated", "sharded"])
def test_each_owner_state_loads_alone_into_a_fresh_piece(memory):
    set_determinism(0, threads=1)
    cfg = small(shards=2, trainers=2, memory=memory)
    stream = load_stream("wikipedia", 3000)
    a = ContinualLearner(cfg, stream)
    a.run_phase1()
    b = ContinualLearner(cfg, stream)
    own = lambda state: copy.deepcopy(state)  # noqa: E731 (state_dict() holds live tensors)
    for p, shard in enumerate(a.group.shards):  # a shard alone
        fresh = b.group.shards[p]
        fresh.load_state_dict(own(shard.state_dict()))
        roots = a.events.src[:500]
        ts = a.events.t[1000:1500]
        mine = a.group.partitioner.owner(roots) == p
        x = shard.sample_hop(roots[mine], ts[mine], 10)
        y = fresh.sample_hop(roots[mine], ts[mine], 10)
        assert torch.equal(x.nbr_eids, y.nbr_eids) and fresh.num_events == shard.num_events
    for w, trainer in enumerate(a.group.trainers):  # a trainer alone
        b.group.trainers[w].load_state_dict(own(trainer.state_dict()))
        for x, y in zip(trainer.model.parameters(), b.group.trainers[w].model.parameters(),
                        strict=True):  # fmt: skip
            assert torch.equal(x, y)
    b.load_orchestrator_state(own(a.orchestrator_state()))  # the orchestrator alone
    b.group.partitioner.load_state_dict(own(a.group.partitioner.state_dict()))
    b.group.balancer.load_state_dict(own(a.group.balancer.state_dict()))  # where slices cut
    ra, rb = a.step(), b.step()
    assert ra["ap"] == rb["ap"] and ra["loss"] == rb["loss"]


# ---- the job ------------------------------------------------------------------------------------


def test_job_flags_choose_shards_trainers_and_placement(tmp_path, capsys):
    args = ["--max-events", "2000", "--increments", "2", "--epochs", "1", "--no-progress"]
    args += ["--backend", "local"]
    threads = torch.get_num_threads()
    try:
        extra = ["--shards", "2", "--trainers", "2", "--memory", "sharded", "--backend", "local"]
        assert main(args + extra + ["--out", str(tmp_path)]) == 0
        assert main(args + ["--trainers", "0"]) == 2
        assert main(args + ["--memory", "everywhere"]) == 2
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "cluster.trainers must be an integer >= 1" in err and "cluster.memory" in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trainers"] == 2 and summary["shards"] == 2
    assert summary["memory_placement"] == "sharded"
    assert summary["partition"]["shards"] == 2 and 0 < summary["partition"]["edge_cut"] < 1
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["shards"] == 2 and "partition_edge_cut" in first


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_stochastically_rounded_features_do_not_depend_on_the_number_of_shards(precision):
    ev = with_features(load_stream("wikipedia", 3000).events)
    rows = []
    for parts in (1, 3):
        cfg = small(shards=parts)
        cfg.data.feature_precision = precision
        group = LocalGroup(cfg, 0, 3)
        for lo in range(0, 3000, 1000):
            group.ingest(ev.select(slice(lo, lo + 1000)), 10000)
        rows.append(group.trainers[0].edge_cache.get(torch.arange(3000)))
    assert torch.equal(rows[0], rows[1])
    assert not torch.equal(rows[0], ev.edge_feat)  # rounded, and stochastically so


def test_a_run_with_ldg_reports_its_partition_and_summary_leaves_sampling_alone():
    set_determinism(0, threads=1)
    cfg = small(shards=3, trainers=2, partitioner="ldg")
    cfg.sampler.strategy = "uniform"
    cfg.continual.num_increments = 3
    stream = load_stream("wikipedia", 3000)
    a, b = ContinualLearner(cfg, stream), ContinualLearner(cfg, stream)
    for learner in (a, b):
        learner.run_phase1()
        learner.step()
    summary = a.summary()  # probes sample with the shards' generators: they must be restored
    assert summary["partition"]["shards"] == 3 and sum(summary["partition"]["shard_events"]) > 0
    ra, rb = a.step(), b.step()
    assert {k: v for k, v in ra.items() if "_per_s" not in k} == {
        k: v for k, v in rb.items() if "_per_s" not in k
    }


def test_unknown_node_has_no_state_row_and_placement_is_checked_on_load():
    from tidegraph.training.state import DenseRowIndex

    index = DenseRowIndex()
    index.add(torch.tensor([5, 7]))
    assert index(torch.tensor([7, 5])).tolist() == [1, 0]
    with pytest.raises(KeyError, match="node 6 has no state row"):
        index(torch.tensor([6]))
    with pytest.raises(KeyError, match="node 9"):
        index(torch.tensor([9]))
    stream = load_stream("wikipedia", 3000)
    state = ContinualLearner(small(memory="sharded"), stream).group.state_dict()
    with pytest.raises(ValueError, match="cluster.memory: sharded"):
        ContinualLearner(small(memory="replicated"), stream).group.load_state_dict(state)


def test_bad_config_files_and_ports_are_clear_errors(tmp_path, capsys):
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    cases = [
        (["--config", str(tmp_path / "missing.yaml")], "missing.yaml"),
        (["--config", str(listed)], "a mapping of sections expected"),
        (["--config", str(broken)], "broken.yaml"),
        (["--metrics-port", "70000"], "--metrics-port must be"),
    ]
    for args, message in cases:
        assert main(args + ["--backend", "local"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
