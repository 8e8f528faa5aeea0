"""A run from a file holds none of its events on the driver: the stream is spooled to the run
directory a chunk at a time, read back a block at a time, and the run learns bitwise as one
that loaded the file whole."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import tidegraph.storage.spool as spool_module
from tidegraph.jobs.train import main
from tidegraph.storage.eventlog import EventLog
from tidegraph.storage.events import EventBatch
from tidegraph.storage.idmap import IdMap
from tidegraph.storage.spool import EventSpool, window_ends
from tidegraph.training import ContinualLearner, RunConfig, load_stream
from tidegraph.training.data import spooled_stream
from tidegraph.training.schedule import increment_bounds

sys.path.insert(0, str(Path(__file__).parent))
from runstate import assert_same_state  # noqa: E402


def _stream(n: int, feat: bool = True, int_t: bool = False) -> EventBatch:
    g = torch.Generator().manual_seed(n)
    t = torch.cumsum(torch.randint(0, 5, (n,), generator=g), 0)
    return EventBatch(
        torch.randint(0, 300, (n,), generator=g), torch.randint(0, 300, (n,), generator=g),
        t if int_t else t.double() + 0.25, torch.arange(n),
        torch.randn(n, 3, generator=g) if feat else None,
        torch.randint(0, 2, (n,), generator=g).float(),
    )  # fmt: skip


def _same(a: EventBatch, b: EventBatch) -> None:
    for name in ("src", "dst", "t", "eid", "edge_feat", "label"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize(
    ("feat", "int_t", "uneven"), [(True, False, False), (False, True, False), (True, False, True)]
)
def test_a_spool_reads_back_any_range_bitwise(tmp_path, monkeypatch, feat, int_t, uneven):
    """Parts of 700 events in row groups of 64: every range, across part and group edges,
    reads back as the stream's own slice, dtypes and all; `uneven`: a part whose row groups
    differ in size (as another writer may cut them) reads by the groups its file lists."""
    monkeypatch.setattr(spool_module, "ROW_GROUP", 64)
    ev = _stream(2500, feat, int_t)
    batches = [ev.select(slice(lo, lo + 333)) for lo in range(0, 2500, 333)]
    spool = EventSpool.write(str(tmp_path / "s"), batches, {"k": 1}, part_events=700)
    spool.finish("x", 300, IdMap(300), None)
    assert spool.manifest["parts"] == [[0, 700], [700, 1400], [1400, 2100], [2100, 2500]]
    if uneven:
        import pyarrow.parquet as pq

        path = tmp_path / "s" / "part-000000000700-000000001400.parquet"
        table, sizes = pq.read_table(path), [10, 300, 1, 64, 325]
        with pq.ParquetWriter(path, table.schema) as out:
            at = 0
            for n in sizes:
                out.write_table(table.slice(at, n), row_group_size=n)
                at += n
        assert [pq.ParquetFile(path).metadata.row_group(i).num_rows for i in range(5)] == sizes
    g = torch.Generator().manual_seed(0)
    ranges = [(0, 2500), (0, 0), (699, 701), (64, 128), (1399, 2101), (2499, 2500), (764, 764),
              (700, 700), (2500, 2500)]  # fmt: skip
    ranges += [tuple(sorted(torch.randint(0, 2501, (2,), generator=g).tolist())) for _ in range(40)]
    reopened = EventSpool.open(str(tmp_path / "s"), {"k": 1})
    for lo, hi in ranges:
        _same(reopened.read(lo, hi), ev.select(slice(lo, hi)))
    for start in (0, 63, 64, 700, 2000):
        assert torch.equal(torch.cat(list(reopened.times(start))), ev.t[start:])
    _same(reopened.template(), ev.select(slice(0, 0)))


def test_an_unfinished_or_other_spool_is_not_opened(tmp_path):
    uri = str(tmp_path / "s")
    spool = EventSpool.write(uri, [_stream(100)], {"k": 1})
    assert EventSpool.open(uri, {"k": 1}) is None  # no manifest yet: a killed load
    spool.finish("x", 300, IdMap(300), None)
    assert EventSpool.open(uri, {"k": 1}) is not None
    assert EventSpool.open(uri, {"k": 2}) is None  # other data settings: read again
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    assert EventSpool.open(uri, {"k": 1}) is None  # a layout this code does not know


def test_dropped_parts_are_gone_and_refused_by_name(tmp_path):
    uri = str(tmp_path / "s")
    ev = _stream(2000)
    spool = EventSpool.write(uri, [ev], {}, part_events=500)
    spool.finish("x", 300, IdMap(300), None)
    spool.drop_before(1200)  # parts [0, 500) and [500, 1000)
    files = sorted(p.name for p in (tmp_path / "s").glob("part-*"))
    assert files == ["part-000000001000-000000001500.parquet",
                     "part-000000001500-000000002000.parquet"]  # fmt: skip
    again = EventSpool.open(uri, {})
    _same(again.read(1000, 2000), ev.select(slice(1000, 2000)))
    with pytest.raises(ValueError, match=r"events \[999, 1001\) were dropped .* event log"):
        again.read(999, 1001)


@pytest.mark.parametrize("window", [1.0, 7.0, 40.0, 1e9])
def test_time_window_increments_from_a_spool_equal_those_of_the_whole_stream(tmp_path, window):
    """Increment ends from the spool's row groups, computed once and kept in its manifest
    (a resumed run whose first parts were dropped cuts the same increments)."""
    ev = _stream(3000, feat=False)
    spool = EventSpool.write(str(tmp_path / "s"), [ev], {}, part_events=256)
    spool.finish("x", 300, IdMap(300), None)
    c = RunConfig.from_dict({"continual": {"increment_window": window}}).continual
    for start in (0, 900, 2999):
        want = increment_bounds(ev.t, start, c)
        assert increment_bounds(spool, start, c) == want
        assert want[-1][1] == 3000 and all(lo < hi for lo, hi in want)
    spool.drop_before(2000)
    assert increment_bounds(EventSpool.open(str(tmp_path / "s"), {}), 900, c) == (
        increment_bounds(ev.t, 900, c))  # fmt: skip
    # chunks cut anywhere, a window's edge among them, give the same ends
    t = ev.t[900:]
    chunks = [t[:1], t[1:500], t[500:501], t[501:]]
    assert window_ends(chunks, 900, window) == window_ends([t], 900, window)


def _csv(path: Path, ev: EventBatch, src=None, dst=None) -> Path:
    src = ev.src if src is None else src
    dst = ev.dst if dst is None else dst
    rows = ["src,dst,t,label,f0,f1,f2"]
    for i in range(len(ev)):
        f = ev.edge_feat[i]
        rows.append(f"{src[i]},{dst[i]},{float(ev.t[i])},{int(ev.label[i])},"
                    f"{float(f[0])!r},{float(f[1])!r},{float(f[2])!r}")  # fmt: skip
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("ids", ["dense", "sparse", "huge", "string"])
def test_a_spooled_file_is_the_stream_a_whole_load_gives(tmp_path, monkeypatch, ids):
    """Read a chunk at a time (small chunks and parts here): the same events, node count,
    feature width, rows read and id map as `load_stream` of the whole file; sparse and
    huge int ids are mapped as the whole stream maps them."""
    monkeypatch.setattr(spool_module, "PART_EVENTS", 256)
    ev = _stream(1500)
    src, dst = ev.src, ev.dst
    if ids == "sparse":
        src, dst = src * 1_000_003 + 7, dst * 1_000_003 + 7
    elif ids == "huge":  # most ids dense, a few far beyond: mapped above the identity bound
        src = torch.where(src % 5 == 0, src + (1 << 40), src)
    elif ids == "string":
        src = [f"u{int(x)}" for x in src]
    path = _csv(tmp_path / "ev.csv", ev, src, dst)
    data = {"format": "csv", "columns": "src=0,dst=1,time=2,label=3,features=4-6",
            "header": True, "string_ids": ids == "string"}  # fmt: skip
    cfg = RunConfig.from_dict({"data": {"dataset": str(path), "max_events": 1400, **data}})
    whole = load_stream(str(path), 1400, **data)
    got = spooled_stream(cfg.data, str(tmp_path / "spool"))
    assert len(got.events) == 0 and got.num_events == 1400 == whole.num_events
    _same(got.spool.read(0, 1400), whole.events)
    assert (got.num_nodes, got.edge_dim, got.name) == (whole.num_nodes, 3, whole.name)
    assert got.rows_read == whole.rows_read
    a, b = got.idmap.state_dict(), whole.idmap.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k
    assert (whole.idmap.mapped > 0) == (ids != "dense")


def _config(out: Path | None = None, **continual) -> RunConfig:
    raw = {"model": {"dim": 16, "time_dim": 8, "memory_dim": 16},
           "train": {"batch_size": 100, "epochs": 1},
           "continual": {"replay_capacity": 500, "forget_sample": 100, **continual},
           "progress": False}  # fmt: skip
    if out is not None:
        raw["out_dir"] = str(out)
    return RunConfig.from_dict(raw)


@pytest.mark.parametrize("continual", [{"num_increments": 4}, {"increment_window": 9000.0}])
def test_a_spooled_run_holds_only_its_block_and_learns_as_a_whole_load(
    tmp_path, monkeypatch, continual
):
    """A learner over a spooled Wikipedia prefix (parts of 400 events) with a durable log:
    after every unit of work it holds at most the block under way, nothing after a block is
    learned, and it ends bitwise as the learner that loaded the stream whole: records,
    summary and every piece of state."""
    cfg = _config(**continual)
    cfg.data.max_events = 2400
    cfg.data.dataset = "wikipedia"
    monkeypatch.setattr(spool_module, "PART_EVENTS", 400)
    spooled = spooled_stream(cfg.data, str(tmp_path / "spool"))
    a = ContinualLearner(cfg, spooled, event_log=EventLog(str(tmp_path / "run")))
    b = ContinualLearner(cfg, load_stream("wikipedia", 2400))
    assert a.bounds == b.bounds and len(a.bounds) >= 3
    held, run_unit = [], a.run_unit

    def watched(u):
        out = run_unit(u)
        lo, hi = a._block()
        assert a.base >= lo and a.base + len(a.events) <= max(hi, a.base), (u, a.base)
        held.append(len(a.events))
        return out

    a.run_unit = watched
    sa, sb = a.run(), b.run()
    assert max(held) == a.phase1_end and len(a.events) == 0
    untimed = [[{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in x.history]
               for x in (a, b)]  # fmt: skip
    assert sa == sb and untimed[0] == untimed[1]
    assert_same_state(a.state_dict(), b.state_dict())


@pytest.mark.parametrize(
    "continual",
    [{"num_increments": 4, "replay": "importance"}, {"increment_window": 9000.0}],
)
def test_a_window_bounds_what_a_spooled_run_holds_and_changes_no_result(
    tmp_path, monkeypatch, continual
):
    """With `continual.window_events` of 250 (phase 1 is 720 events, an increment 420,
    batches 100), a learner over the spooled stream holds at most 250 events after every
    unit, reads at most 250 at a time from the spool and, in all, at most 1.5 times the
    events it asks for (a read serves the units that follow). It ends bitwise as a learner
    that loaded the stream whole with the same window (records, summary, every piece of
    state), and with the records and summary of one that handles each block at once (its
    graph then lists one ingest per block, not per window)."""
    cfg = _config(window_events=250, **continual)
    cfg.data.max_events = 2400
    cfg.data.dataset = "wikipedia"
    monkeypatch.setattr(spool_module, "PART_EVENTS", 400)
    spooled = spooled_stream(cfg.data, str(tmp_path / "spool"))
    reads, read = [], spooled.spool.read

    def counted(lo, hi):
        reads.append(hi - lo)
        return read(lo, hi)

    spooled.spool.read = counted
    a = ContinualLearner(cfg, spooled, event_log=EventLog(str(tmp_path / "run")))
    asked, ask = [], a.history_events.read

    def asking(lo, hi):
        if lo >= a.history_events.old_end():  # the block under way (old ones: the log)
            asked.append(hi - lo)
        return ask(lo, hi)

    a.history_events.read = asking
    b = ContinualLearner(cfg, load_stream("wikipedia", 2400))
    at_once = _config(**continual)
    at_once.data.max_events, at_once.data.dataset = 2400, "wikipedia"
    c = ContinualLearner(at_once, load_stream("wikipedia", 2400))
    assert a.bounds == b.bounds == c.bounds and a.phase1_end > 2 * 250
    held, run_unit = [], a.run_unit

    def watched(u):
        out = run_unit(u)
        held.append(len(a.events))
        return out

    a.run_unit = watched
    sa, sb, sc = a.run(), b.run(), c.run()
    assert 0 < max(held) <= 250 and max(reads) <= 250
    assert sum(reads) <= 1.5 * sum(asked), (sum(reads), sum(asked))
    untimed = [[{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in x.history]
               for x in (a, b, c)]  # fmt: skip
    assert sa == sb == sc and untimed[0] == untimed[1] == untimed[2]
    assert_same_state(a.state_dict(), b.state_dict())


def test_a_checkpoint_without_old_event_state_is_counted_again_a_window_at_a_time():
    """A checkpoint from before the replay reservoir was kept: loading it counts the
    reservoir, the degrees and the partition counts again from the learned blocks, read a
    window at a time, and they equal those of the learner that wrote it."""
    cfg = _config(window_events=250, num_increments=4, replay="importance")
    cfg.data.max_events, cfg.data.dataset = 2400, "wikipedia"
    a = ContinualLearner(cfg, load_stream("wikipedia", 2400))
    a.run_phase1()
    a.step()
    a.step()
    state = a.state_dict()
    del state["orchestrator"]["old_events"]
    b = ContinualLearner(cfg, load_stream("wikipedia", 2400))
    reads, read = [], b.history_events.read

    def counted(lo, hi):
        reads.append(hi - lo)
        return read(lo, hi)

    b.history_events.read = counted
    b.load_state_dict(state)
    assert reads and max(reads) <= 250
    assert a.reservoir.seen == b.reservoir.seen > cfg.continual.replay_capacity
    assert_same_state(b.state_dict(), a.state_dict())


def test_a_ray_groups_passes_go_a_window_at_a_time_and_learn_as_at_once(
    ray_session, tmp_path, monkeypatch
):
    """On Ray (2 shards, 2 trainers, whole passes: a call to the group per pass), with
    `continual.window_events` of 250: every call of a pass carries at most 250 of the block's
    events (and their replay), and the learner ends with the records and summary of one that
    sends each pass at once."""
    from tidegraph.orchestrator import make_group

    monkeypatch.setattr(spool_module, "PART_EVENTS", 400)
    runs = []
    for window in (250, 1 << 20):
        cfg = _config(window_events=window, num_increments=3)
        cfg.data.max_events, cfg.data.dataset = 2400, "wikipedia"
        cfg.cluster.backend, cfg.cluster.shards, cfg.cluster.trainers = "ray", 2, 2
        cfg.run_name = f"tidegraph-window-{window}"
        stream = spooled_stream(cfg.data, str(tmp_path / f"spool-{window}"))
        learner = ContinualLearner(cfg, stream, make_group,
                                   event_log=EventLog(str(tmp_path / f"run-{window}")))  # fmt: skip
        sent = []
        for name in ("train_pass", "eval_pass"):
            real = getattr(learner.group, name)

            def counted(batches, *args, _real=real, _sent=sent):
                _sent.append(sum(b[3] if len(b) == 4 else len(b[0]) for b in batches))
                return _real(batches, *args)

            setattr(learner.group, name, counted)
        try:
            summary = learner.run()
        finally:
            learner.group.shutdown()
        records = [{k: v for k, v in r.items() if not k.endswith("_per_s")}
                   for r in learner.history]  # fmt: skip
        runs.append((summary, records, sent))
    (small, small_records, small_sent), (large, large_records, large_sent) = runs
    assert max(small_sent) <= 250 < max(large_sent) and len(small_sent) > len(large_sent)
    assert small == large and small_records == large_records


def _job(out: Path, backend: str, *extra: str) -> list[str]:
    return ["--max-events", "2400", "--epochs", "1", "--no-progress", "--metrics-port", "-1",
            "--backend", backend, "--shards", "2", "--trainers", "2", "--out", str(out),
            *extra]  # fmt: skip


def _records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.endswith("_per_s")} for x in lines]


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_resumed_job_reads_a_spool_whose_first_parts_were_dropped(
    tmp_path, monkeypatch, backend, request
):
    """The job with parts of 300 events, one checkpoint kept and increments by time window:
    the spool drops what every kept checkpoint has ingested; a job stopped after its second
    increment's checkpoint and resumed reads what is left of the spool (its increments from
    the manifest), and ends with the records of a job never stopped."""
    if backend == "ray":
        request.getfixturevalue("ray_session")
    monkeypatch.setattr(spool_module, "PART_EVENTS", 300)
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("continual:\n  increment_window: 9000\n  num_increments: null\n"
                         "train:\n  batch_size: 100\n")  # fmt: skip
    args = ["--config", str(yaml_path), "--keep-checkpoints", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(_job(tmp_path / "whole", backend, *args)) == 0
        from tidegraph.orchestrator import controller

        real = controller.Orchestrator._checkpoint

        def stop_after_second(self, tag):
            real(self, tag)
            if tag == "increment-00002":
                raise KeyboardInterrupt("stopped for the test")

        monkeypatch.setattr(controller.Orchestrator, "_checkpoint", stop_after_second)
        with pytest.raises(KeyboardInterrupt):
            main(_job(tmp_path / "cut", backend, *args))
        monkeypatch.setattr(controller.Orchestrator, "_checkpoint", real)
        manifest = json.loads((tmp_path / "cut" / "stream" / "manifest.json").read_text())
        assert manifest["dropped_before"] >= 900 and manifest["window_ends"]
        assert not (tmp_path / "cut" / "stream" / "part-000000000000-000000000300.parquet").exists()
        assert main([*_job(tmp_path / "cut", backend, *args), "--resume"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert _records(tmp_path / "cut") == _records(tmp_path / "whole")
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert {k: whole[k] for k in ("ap", "auc", "mrr", "forgetting")} == {
        k: cut[k] for k in ("ap", "auc", "mrr", "forgetting")}  # fmt: skip


def test_only_a_resumed_run_reuses_the_spool_and_a_drop_a_kill_cut_short_is_finished(tmp_path):
    """A fresh run reads its file again, however it changed since a run that did not start;
    a resumed one reads the spool. Parts a kill left behind after their drop was recorded
    are deleted by the next drop."""
    path, uri = tmp_path / "ev.csv", str(tmp_path / "spool")
    _csv(path, _stream(600))
    data = {"dataset": str(path), "format": "csv", "header": True,
            "columns": "src=0,dst=1,time=2,label=3,features=4-6"}  # fmt: skip
    cfg = RunConfig.from_dict({"data": data})
    assert spooled_stream(cfg.data, uri).num_events == 600
    _csv(path, _stream(400))
    assert spooled_stream(cfg.data, uri, reuse=True).num_events == 600  # resumed: the spool
    spool = spooled_stream(cfg.data, uri).spool  # fresh: the file as it is now
    assert spool.num_events == 400
    part = tmp_path / "spool" / "part-000000000000-000000000400.parquet"
    kept = part.read_bytes()
    spool.drop_before(400)
    assert not part.exists()
    part.write_bytes(kept)  # as if killed between the manifest and the delete
    spool.drop_before(400)
    assert not part.exists()
