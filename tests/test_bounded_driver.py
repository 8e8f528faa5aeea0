"""The driver holds no event history: old events live in the durable log, the shards and a
bounded replay reservoir; a live run keeps only the block under way in memory and learns
exactly as a run that keeps everything."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tidegraph.storage.checkpoint import CheckpointStore
from tidegraph.storage.eventlog import EventLog
from tidegraph.storage.events import EventBatch
from tidegraph.storage.partition import PartitionTally, build_partitioner, partition_report
from tidegraph.training import ContinualLearner, RunConfig, load_stream
from tidegraph.training.data import stream_of
from tidegraph.training.sampling import ReplayReservoir

sys.path.insert(0, str(Path(__file__).parent))
from runstate import assert_same_state, with_segments  # noqa: E402


def _events(lo: int, hi: int) -> EventBatch:
    pos = torch.arange(lo, hi)
    feat = torch.sin(pos.float()).repeat(3, 1).T
    return EventBatch(pos % 97, (pos * 7) % 89, pos.double(), pos, feat)


def test_the_reservoir_holds_the_history_in_order_while_it_fits():
    res = ReplayReservoir(1000, seed=1)
    for lo in range(0, 1000, 300):
        res.add(_events(lo, min(lo + 300, 1000)))
    assert res.size == 1000 and torch.equal(res.events.eid, torch.arange(1000))
    res.add(_events(1000, 1500))  # full: now a sample
    assert res.size == 1000 and res.events.eid.unique().numel() == 1000
    assert torch.equal(res.events.src, res.events.eid % 97)  # rows stay whole


def test_the_reservoir_is_a_uniform_sample_and_resumes_bitwise():
    n, cap, trials = 20_000, 1000, 300
    kept = torch.zeros(10)
    for seed in range(trials):
        res = ReplayReservoir(cap, seed)
        for lo in range(0, n, 700):
            res.add(_events(lo, min(lo + 700, n)))
        kept += torch.bincount(res.events.eid * 10 // n, minlength=10)
    # every tenth of the stream is kept as often (binomial spread about 0.6 %)
    assert ((kept / (trials * cap / 10) - 1).abs() < 0.03).all(), kept

    a, b = ReplayReservoir(cap, 5), ReplayReservoir(cap, 0)
    for lo in range(0, 5000, 700):
        a.add(_events(lo, lo + 700))
    b.load_state_dict(a.state_dict())
    for r in (a, b):
        r.add(_events(4900, 9000))
    for x, y in zip(vars(a.events).values(), vars(b.events).values(), strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


def _blob_bytes(root) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / "blobs").glob("*")}


def test_a_full_reservoir_checkpoints_its_replacements_not_itself(tmp_path):
    """Once full, a checkpoint of the reservoir writes the replacements since the last one
    (the patch grows at its end), not the reservoir again, except when the patch is
    compacted into a new base, which is written to the store once and then leaves memory;
    every checkpoint loads back bitwise and goes on drawing as the reservoir that was never
    saved, and a state without the store reads the base back."""
    cap = 50_000
    uri = str(tmp_path)
    store = CheckpointStore.at(uri)
    res = ReplayReservoir(cap, seed=3)
    res.add(_events(0, cap))  # full: from here on replacements
    size = sum(x.numel() * x.element_size() for x in vars(res.events).values() if x is not None)
    lo = cap
    for i in range(40):
        before, compactions = _blob_bytes(tmp_path), res.compactions
        res.add(_events(lo, lo + 4000))
        lo += 4000
        store.save(store.put(res.state_dict(uri)), f"c{i}", keep=2)
        assert res.base is None  # written: only the events and the patch stay in memory
        after = _blob_bytes(tmp_path)
        written = sum(n for name, n in after.items() if name not in before)
        if i and res.compactions == compactions:  # the patch grew: its chunk, nothing else
            patch = res.state_dict(uri)["patch"]
            assert written <= patch.numel() < 0.35 * size, (i, written)
        elif i:  # a new base: the reservoir, once
            assert size <= written < 1.5 * size, (i, written)
        back = ReplayReservoir(cap, seed=99)
        back.load_state_dict(store.load(f"c{i}"))
        for r in (res, back):
            assert r.size == cap
        for x, y in zip(vars(res.events).values(), vars(back.events).values(), strict=True):
            assert (x is None and y is None) or torch.equal(x, y)
        if i % 10 == 9:  # and goes on as the one never saved (its state read without a store)
            twin = ReplayReservoir(cap, seed=3)
            twin.load_state_dict(res.state_dict())
            assert res.base is not None  # read back from the store to give it whole
            for r in (twin, back):
                r.add(_events(lo, lo + 3000))
            assert all(torch.equal(x, y) for x, y in zip(vars(twin.events).values(),
                       vars(back.events).values(), strict=True) if x is not None)  # fmt: skip
            res.add(_events(lo, lo + 3000))
            lo += 3000
    # 40 x 4,000 events replace about cap * ln(210 / 50) = 72k slots: a compaction every
    # capacity // 4 = 12,500 replacements, not one per checkpoint
    assert 2 <= res.compactions <= 9, res.compactions


def test_a_filling_reservoir_checkpoints_as_one_table_growing_at_its_end(tmp_path):
    """While filling, the reservoir's events are saved as packed rows: a checkpoint writes
    the new rows (in the table's last chunk), not every column again."""
    from tidegraph.storage.checkpoint import CHUNK

    cap, step = 2_000_000, 100_000
    uri = str(tmp_path)
    store = CheckpointStore.at(uri)
    res = ReplayReservoir(cap, seed=1)
    for i in range(6):
        before = _blob_bytes(tmp_path)
        res.add(_events(i * step, (i + 1) * step))
        store.save(store.put(res.state_dict(uri)), f"c{i}", keep=2)
        written = sum(n for name, n in _blob_bytes(tmp_path).items() if name not in before)
        assert written <= step * 32 + CHUNK, (i, written)  # new rows, one chunk's tail
        back = ReplayReservoir(cap, seed=0)
        back.load_state_dict(store.load(f"c{i}"))
        assert back.size == res.size == (i + 1) * step and not back.full
        for name in ("src", "dst", "t", "eid"):
            x, y = getattr(res.events, name), getattr(back.events, name)
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_the_partition_tally_equals_the_report_over_every_event():
    wiki = load_stream("wikipedia", 3000).events
    for kind in ("hash", "ldg"):
        part, tally = build_partitioner(kind, 3), PartitionTally()
        for lo in range(0, 3000, 700):
            ev = wiki.select(slice(lo, lo + 700))
            part.assign(ev.src, ev.dst)
            tally.add(ev.src, ev.dst, part)
        assert tally.report(part) == partition_report(wiki.src, wiki.dst, part)


SMALL = {
    "model": {"dim": 16, "time_dim": 8, "memory_dim": 16},
    "train": {"batch_size": 100, "epochs": 1},
    "continual": {"replay": "importance", "forget_sample": 200},
    "out_dir": None,
    "progress": False,
}


def _config(**continual) -> RunConfig:
    raw = {**SMALL, "continual": {**SMALL["continual"], **continual}}
    return RunConfig.from_dict(raw)


@pytest.mark.parametrize(
    "model,memory",
    [("tgn", "replicated"), ("jodie", "sharded"), ("apan", "replicated"), ("apan", "sharded")],
)
def test_the_node_state_rows_a_model_reports_unchanged_are_unchanged(model, memory):
    """What a checkpoint leaves out of node state (`take_changed`: the rows changed since
    the last one; `DeltaTables` writes only those) is exactly what did not change over an
    increment: every row left out is bitwise as it was, on trainers (replicated) and on
    shards (sharded), and rows are left out (on this small sample an increment touches
    most of its nodes)."""
    raw = {**SMALL, "model": {**SMALL["model"], "name": model},
           "continual": {**SMALL["continual"], "num_increments": 3},
           "cluster": {"memory": memory, "shards": 2}}  # fmt: skip
    learner = ContinualLearner(RunConfig.from_dict(raw), load_stream("wikipedia", 3000))
    learner.run_phase1()
    group = learner.group
    holders = ([s.node_state.model for s in group.shards] if memory == "sharded"
               else [t.model for t in group.trainers])  # fmt: skip
    for m in holders:
        m.take_changed()  # tracking from here
    before = [{k: v.clone() for k, v in m.state_tables().items()} for m in holders]

    def check() -> int:  # after every unit: the rows not marked are the rows as they were
        left_out = 0
        for m, old in zip(holders, before, strict=True):
            changed = (m.memory if model != "apan" else m).changed.mask  # a look, not a take
            assert changed is not None
            for name, table in m.state_tables().items():
                rows = (~changed[: old[name].shape[0]]).nonzero().squeeze(1)
                a, b = table[rows].view(torch.uint8), old[name][rows].view(torch.uint8)
                assert torch.equal(a, b), (name, learner.schedule.unit(learner.cursor.unit - 1))
            left_out += int((~changed).sum())
        return left_out

    increment = learner.cursor.increment
    for _ in range(1000):  # the increment's units, one by one (bounded)
        learner.run_unit(learner.schedule.unit(learner.cursor.unit))
        left_out = check()
        if learner.cursor.increment != increment:
            break
    assert left_out > 0.1 * sum(int(m.take_changed().numel()) for m in holders)


def test_rows_compare_bit_for_bit_whatever_their_width():
    """`row_bits`: the comparison of node-state rows behind the changed masks; rows of any
    width (none included) and dtype, empty tables, -0.0 against 0.0 and NaN against NaN."""
    from tidegraph.models.base import row_bits

    for t in (torch.zeros(0, 16), torch.zeros(5, 3), torch.zeros(4, 1, dtype=torch.bool),
              torch.zeros(3, 0), torch.zeros(0, 1, dtype=torch.float64)):  # fmt: skip
        assert row_bits(t).shape[0] == t.shape[0]
        assert not bool(row_bits(t).ne(row_bits(t.clone())).any())
    a = torch.tensor([[0.0, 1.0], [float("nan"), 2.0], [3.0, 4.0]])
    b = torch.tensor([[-0.0, 1.0], [float("nan"), 2.0], [3.0, 4.5]])
    assert row_bits(a).ne(row_bits(b)).any(1).tolist() == [True, False, True]


def test_a_node_state_write_that_fails_loses_no_changed_row(tmp_path, monkeypatch):
    """A checkpoint whose node-state writes fail midway (a storage error) gives its changed
    rows back: the next checkpoint holds the live tables bitwise; so does one after a
    checkpoint went through the driver and retention deleted what the trainer had written."""
    from tidegraph.storage.checkpoint import DeltaTables

    raw = {**SMALL, "continual": {**SMALL["continual"], "num_increments": 3}}
    learner = ContinualLearner(RunConfig.from_dict(raw), load_stream("wikipedia", 3000))
    learner.run_phase1()
    trainer, uri = learner.group.trainers[0], str(tmp_path)
    store = CheckpointStore.at(uri)
    store.save(trainer.state_chunks(uri), "a", keep=1)
    learner.step()
    put, calls = DeltaTables.put, []

    def failing(self, *args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("storage unreachable")
        return put(self, *args, **kwargs)

    monkeypatch.setattr(DeltaTables, "put", failing)
    with pytest.raises(OSError, match="unreachable"):
        trainer.state_chunks(uri)
    monkeypatch.setattr(DeltaTables, "put", put)
    store.save(trainer.state_chunks(uri), "b", keep=1)
    live = trainer.model.state_tables()
    saved = store.load("b")["model"]
    for key, table in saved.items():
        name = key.rsplit(".", 1)[-1]
        if key.startswith("memory.") and name in live:
            assert torch.equal(table.view(torch.uint8), live[name].view(torch.uint8)), key
    store.save(trainer.state_dict(), "c", keep=1)  # through the driver: "b" goes
    learner.step()
    store.save(trainer.state_chunks(uri), "d", keep=1)
    saved = store.load("d")["model"]
    assert all(torch.equal(saved[k], v) for k, v in trainer.state_dict()["model"].items())


def test_replay_draws_from_the_history_itself_while_it_fits():
    """What replay and forgetting probes draw from, while the history fits the reservoir, is
    the stream's events before the increment, bitwise: the draws of a learner that keeps
    the whole history; importance replay's counts of the increment's events per node are
    those of the increment."""
    wiki = load_stream("wikipedia", 3000)
    learner = ContinualLearner(_config(num_increments=3, replay="importance"), wiki)
    seen = []
    select = learner.replay.select

    def watched(pool, changed, degree, m):
        seen.append((pool, changed, degree))
        return select(pool, changed, degree, m)

    learner.replay.select = watched
    learner.run()
    assert len(seen) == 3
    ev = wiki.events
    for (lo, hi), (pool, changed, degree) in zip(learner.bounds, seen, strict=True):
        # which events only: features are read by eid from the shards, labels are unused
        assert pool.label is None and pool.edge_feat is None
        for name in ("src", "dst", "t", "eid"):
            want, got = getattr(ev, name), getattr(pool, name)
            assert (want is None) == (got is None)
            if want is not None:
                assert torch.equal(got, want[:lo])
        new = torch.bincount(torch.cat([ev.src[lo:hi], ev.dst[lo:hi]]), minlength=degree.numel())
        assert torch.equal(changed, new)
        counts = torch.bincount(torch.cat([ev.src[:hi], ev.dst[:hi]]))
        assert torch.equal(degree[: counts.numel()], counts) and not degree[counts.numel() :].any()


@pytest.mark.parametrize(("capacity", "sparse"), [(400, False), (1_000_000, True)])
def test_a_live_run_with_a_log_holds_only_its_window_and_learns_as_one_that_keeps_all(
    tmp_path, capacity, sparse
):
    """Increments appended to a live learner with a durable log: after each, the learner
    holds only what it has not learned (old events come back from the log, for the final
    forgetting of each increment), and it ends bitwise as a learner that kept every event in
    memory: state, records and summary. 400: the reservoir evicts; `sparse`: external ids
    far apart, so events read back from the log map through the id map."""
    wiki = load_stream("wikipedia", 3000)
    events = wiki.events.select(slice(None))
    if sparse:
        events.src, events.dst = events.src * 1_000_003 + 7, events.dst * 1_000_003 + 7
    cfg = _config(replay_capacity=capacity)
    runs = {}
    for name, log in (("log", EventLog(str(tmp_path / "run"))), ("memory", None)):
        phase1 = stream_of(events.select(slice(0, 1200)), "wiki")
        learner = ContinualLearner(cfg, phase1, event_log=log, live=True)
        assert learner.stream.idmap.mapped == (len(learner.stream.idmap) if sparse else 0)
        learner.run_phase1()
        for lo in range(1200, 3000, 450):
            learner.append(events.select(slice(lo, lo + 450)))
            learner.step()
            if log is not None:  # nothing held but the reservoir's sample of the history
                assert len(learner.events) == 0 and learner.base == learner.end == lo + 450
            else:
                assert len(learner.events) == lo + 450
        runs[name] = (learner, learner.summary())
    (a, sa), (b, sb) = runs["log"], runs["memory"]
    untimed = [[{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in x.history]
               for x in (a, b)]  # fmt: skip
    assert sa == sb and untimed[0] == untimed[1]
    assert_same_state(a.state_dict(), b.state_dict())
    assert a.reservoir.size == min(capacity, 3000) and a.reservoir.seen == 3000


def test_a_ray_groups_checkpoint_bulk_is_written_by_its_actors(ray_session, tmp_path):
    """Given a checkpoint store, every shard and trainer actor writes its large tensors there
    and answers with refs: the driver receives none of them, and the checkpoint it saves
    loads back bitwise as the group's state."""
    from tidegraph.orchestrator import make_group
    from tidegraph.storage.checkpoint import INLINE, CheckpointStore, TensorRef

    raw = {**SMALL, "cluster": {"backend": "ray", "shards": 2, "trainers": 2},
           "run_name": "tidegraph-chunks-test"}  # fmt: skip
    learner = ContinualLearner(RunConfig.from_dict(raw), load_stream("wikipedia", 20000),
                               make_group)  # fmt: skip
    try:
        learner.run_phase1()
        uri = str(tmp_path / "checkpoints")
        state = learner.state_dict(uri)
        found = {"refs": 0, "large": 0}

        def look(x) -> None:
            if isinstance(x, TensorRef):
                found["refs"] += 1
            elif isinstance(x, torch.Tensor):
                found["large"] += x.numel() * x.element_size() >= INLINE
            elif isinstance(x, dict | list | tuple):
                for v in x.values() if isinstance(x, dict) else x:
                    look(v)

        look([state["group"]["shards"], state["group"]["trainers"]])
        assert found["refs"] > 0 and found["large"] == 0, found
        store = CheckpointStore.at(uri)
        store.save(state, "phase1")
        saved = store.load()
        with_segments(saved["group"]["shards"])  # the graph as pieces: its segments, rebuilt
        assert_same_state(saved, learner.state_dict())
    finally:
        learner.group.shutdown()


def test_a_checkpoint_the_driver_writes_moves_each_shards_new_edges_once(ray_session, tmp_path):
    """A checkpoint the driver writes (a local run directory while another node is up: no
    actor reaches the store): each actor puts its state as it would to the store and sends
    only the chunks the store lacks, which the driver writes. So a shard's graph is the
    pieces written before, by reference, and one of the edges added since (its bytes are
    those of the new edges: 20 bytes a half-edge), the trainers' node-state tables are the
    rows changed over what earlier checkpoints wrote, and the checkpoint loads back bitwise
    as the group's state."""
    from tidegraph.orchestrator import make_group
    from tidegraph.storage.checkpoint import RowDelta, TensorRef, chunks_of

    raw = {**SMALL, "cluster": {"backend": "ray", "shards": 2, "trainers": 2},
           "run_name": "tidegraph-moved-test"}  # fmt: skip
    learner = ContinualLearner(RunConfig.from_dict(raw), load_stream("wikipedia", 6000),
                               make_group)  # fmt: skip
    uri = str(tmp_path / "checkpoints")
    store = CheckpointStore.at(uri)
    try:
        learner.run_phase1()
        kept: list[set] = []
        done = 0  # events in the checkpoint before
        for k in range(3):
            if k:
                learner.step()
            before = store.chunk_keys()
            state = learner.state_dict(None, uri)
            shards = state["group"]["shards"]
            graph_chunks = [chunks_of(s["graph"]["pieces"]) for s in shards]
            assert all(isinstance(p["rows"], TensorRef) for s in shards
                       for p in s["graph"]["pieces"])  # fmt: skip
            assert [len(s["graph"]["pieces"]) for s in shards] == [k + 1] * 2
            deltas = [v for t in state["group"]["trainers"] for v in t["model"].values()
                      if isinstance(v, RowDelta)]  # fmt: skip
            assert bool(deltas) == (k > 0)  # the first writes the tables whole
            store.save(state, f"c{k}", keep=3)
            new = set().union(*graph_chunks) - before
            new_bytes = sum((tmp_path / "checkpoints" / "blobs" / c).stat().st_size for c in new)
            added, done = learner.ingested - done, learner.ingested
            assert 0 < new_bytes <= 20 * 2 * added + 64 * len(new), (k, new_bytes, added)
            if kept:  # the pieces of the checkpoint before, referenced again
                assert all(old <= now for old, now in zip(kept[-1], graph_chunks, strict=True))
            kept.append(graph_chunks)
        saved = store.load("c2")
        with_segments(saved["group"]["shards"])
        assert_same_state(saved, learner.state_dict())
    finally:
        learner.group.shutdown()
