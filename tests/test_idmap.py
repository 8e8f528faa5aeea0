"""External node ids -> dense ids: the IdMap itself, ids of any int64 value (huge, negative),
string ids, through the loaders, the learner (its checkpoint and live increments) and the job."""

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
import torch

from tidegraph.jobs.train import main
from tidegraph.storage.eventlog import EventLog
from tidegraph.storage.events import EventBatch
from tidegraph.storage.idmap import IdMap, check_ids
from tidegraph.storage.ingest import LoaderError, load_events
from tidegraph.storage.partition import HashPartitioner, LDGPartitioner
from tidegraph.training.config import RunConfig
from tidegraph.training.continual import ContinualLearner
from tidegraph.training.data import load_stream, stream_of

I64 = np.iinfo(np.int64)
SMALL = {
    "model": {"name": "tgn", "dim": 16, "time_dim": 8, "memory_dim": 16},
    "train": {"batch_size": 100, "epochs": 1},
    "continual": {"num_increments": 2, "replay_ratio": 0.5, "forget_sample": 50},
    "progress": False,
}


def config(**data) -> RunConfig:
    raw = json.loads(json.dumps(SMALL))
    raw["data"] = data
    return RunConfig.from_dict(raw)


def first_appearance(ids: np.ndarray, bound: int = 0) -> np.ndarray:
    """The reference: a dict in Python (what the map computes without a loop)."""
    seen: dict = {}
    out = []
    for v in ids.tolist():
        if 0 <= v < bound:
            out.append(v)
        else:
            out.append(seen.setdefault(v, bound + len(seen)))
    return np.array(out, dtype=np.int64)


def write_csv(path, src, dst, t, names=("src", "dst", "t")) -> None:
    table = pa.table({names[0]: src, names[1]: dst, names[2]: t})
    pacsv.write_csv(table, str(path), pacsv.WriteOptions(quoting_style="none"))


# ---- the map ------------------------------------------------------------------------------


def test_dense_ids_stay_and_others_get_the_next_ids_in_order_of_first_appearance():
    m = IdMap.for_ids(np.array([0, 1, 2, 5]))
    assert m.identity_bound == 6 and len(m) == 6
    ids = np.array([3, 10**9, -7, 10**9, I64.max, I64.min, 5, -7])
    out = m.map(ids)
    assert out.tolist() == [3, 6, 7, 6, 8, 9, 5, 7]
    assert out.tolist() == first_appearance(ids, 6).tolist()
    assert m.external(out).tolist() == ids.tolist()
    assert len(m) == 10 and m.mapped == 4
    assert IdMap.for_ids(np.array([0, 10**9])).identity_bound == 0  # sparse: all mapped


def test_events_are_mapped_src_before_dst_and_mapping_dense_ids_again_is_the_identity():
    m = IdMap()
    src, dst = m.map_events(torch.tensor([50, 7, 50]), torch.tensor([7, 9, -1]))
    assert src.tolist() == [0, 1, 0] and dst.tolist() == [1, 2, 3]
    again = IdMap.for_ids(torch.stack([src, dst]))
    assert again.map_events(src, dst)[0].tolist() == src.tolist() and again.mapped == 0


def test_random_int64_ids_match_a_dict_over_many_batches():
    rng = np.random.default_rng(0)
    pool = rng.integers(I64.min, I64.max, size=5000, endpoint=True)
    ids = rng.choice(pool, size=40_000)
    m, parts = IdMap(), []
    for lo in range(0, ids.size, 997):
        parts.append(m.map(ids[lo : lo + 997]).numpy())
    assert np.array_equal(np.concatenate(parts), first_appearance(ids))


def test_state_is_bitwise_and_splits_by_the_partitioners_owner():
    rng = np.random.default_rng(1)
    m = IdMap(100)
    ids = rng.integers(I64.min, I64.max, size=3000)
    dense = m.map(ids)
    state = m.state_dict()
    back = IdMap.from_state(state)
    assert torch.equal(back.state_dict()["keys"], state["keys"]) and len(back) == len(m)
    assert torch.equal(back.map(ids), dense)
    for partitioner in (HashPartitioner(3), LDGPartitioner(3)):
        if isinstance(partitioner, LDGPartitioner):
            partitioner.assign(torch.arange(len(m)), torch.arange(len(m)).flip(0))
        parts = m.split(partitioner.owner, 3)
        for p, part in enumerate(parts):  # each part holds exactly its shard's nodes
            assert bool((partitioner.owner(part["dense"]) == p).all())
            assert torch.equal(IdMap.from_state(state).map(part["keys"]), part["dense"])
        whole = IdMap.merge(parts[::-1])
        assert torch.equal(whole.state_dict()["keys"], state["keys"])


def test_string_ids_map_and_round_trip_through_their_state():
    m = IdMap(kind="str")
    src, dst = m.map_text_events(pa.array(["ann", "bob", "ann"]), pa.array(["bob", "cé", "dan"]))
    assert src.tolist() == [0, 1, 0] and dst.tolist() == [1, 2, 3]
    back = IdMap.from_state(m.state_dict())
    assert back.external(torch.arange(4)) == ["ann", "bob", "cé", "dan"]
    assert back.map_text(pa.array(["dan", "eve"])).tolist() == [3, 4]
    parts = m.split(HashPartitioner(2).owner, 2)
    assert IdMap.merge(parts).external(torch.arange(4)) == ["ann", "bob", "cé", "dan"]


def test_check_ids_is_one_helper_with_each_callers_rules():
    assert check_ids([1, 2], "store").dtype == torch.int64
    with pytest.raises(ValueError, match="store: id at position 1 is negative"):
        check_ids([1, -2], "store")
    assert check_ids(torch.tensor([[1, -2]]), "graph", negative=False, one_dim=False).shape == (
        1,
        2,
    )
    with pytest.raises(ValueError, match="graph: src must hold integer ids"):
        check_ids(torch.tensor([0.5]), "graph", name="src", negative=False, one_dim=False)
    with pytest.raises(ValueError, match="1-D integer"):
        check_ids(torch.tensor([True]), "store")


# ---- through the loaders and the learner --------------------------------------------------


def test_a_million_events_with_ids_from_the_whole_int64_range_load_dense(tmp_path):
    n = 1_000_000
    rng = np.random.default_rng(2)
    pool = rng.integers(I64.min, I64.max, size=300_000, endpoint=True)
    pool[:2] = I64.min, I64.max
    src, dst = rng.choice(pool, size=n), rng.choice(pool, size=n)
    src[:2] = pool[:2]
    path = tmp_path / "wide.csv"
    write_csv(path, src, dst, np.arange(n, dtype=np.float64))
    start = time.perf_counter()
    stream = load_stream(str(path))
    elapsed = time.perf_counter() - start
    ev = stream.events
    nodes = np.unique(np.concatenate([src, dst])).size
    assert len(ev) == n and stream.num_nodes == nodes == len(stream.idmap)
    assert int(ev.src.min()) >= 0 and int(torch.maximum(ev.src, ev.dst).max()) == nodes - 1
    assert np.array_equal(stream.idmap.external(ev.src).numpy(), src)
    assert np.array_equal(stream.idmap.external(ev.dst).numpy(), dst)
    assert ev.src[:2].tolist() == [0, 2]  # first appearance: src 0, dst 0, then src 1
    print(f"1M events, full int64 ids: loaded and mapped in {elapsed:.1f} s")


def test_negative_ids_are_valid_external_ids_when_mapped(tmp_path):
    path = tmp_path / "neg.csv"
    path.write_text("src,dst,t\n" + "".join(f"{-i},{i % 5},{i}\n" for i in range(1, 40)))
    stream = load_stream(str(path))
    assert len(stream.events) == 39 and int(stream.events.src.min()) >= 0
    assert stream.idmap.external(stream.events.src).tolist() == [-i for i in range(1, 40)]


def test_the_learner_checkpoints_its_id_map_and_live_increments_map_through_it(tmp_path):
    """As a resumed followed run does (a whole one is in test_live.py): the stream rebuilt
    from the log, the checkpoint loaded, then new increments map as in the original."""
    rng = np.random.default_rng(3)
    pool = rng.integers(I64.min, I64.max, size=80, endpoint=True)

    def events(lo, hi):
        n = hi - lo
        return EventBatch(
            src=torch.from_numpy(rng.choice(pool, n)),
            dst=torch.from_numpy(rng.choice(pool, n)),
            t=torch.arange(lo, hi, dtype=torch.float64),
            eid=torch.arange(n),
        )

    phase1, inc1, inc2 = events(0, 600), events(600, 800), events(800, 1000)
    inc2_copy, inc2_dst = inc2.select(slice(None)), inc2.dst.clone()
    cfg = config()
    log = EventLog(str(tmp_path / "a"))
    a = ContinualLearner(cfg, stream_of(phase1.select(slice(None)), "p"), event_log=log, live=True)
    a.run_phase1()
    a.append(inc1.select(slice(None)))
    a.step()
    state = a.state_dict()
    logged = log.read(0, a.ingested)
    assert torch.equal(logged.src, torch.cat([phase1.src, inc1.src]))  # the log: external ids
    # a resumed run rebuilds the stream from the log, then loads the checkpoint
    b_stream = stream_of(_owned(log.read(0, a.phase1_end)), "p")
    b = ContinualLearner(cfg, b_stream, event_log=EventLog(str(tmp_path / "b")), live=True)
    b.append(_owned(log.read(a.phase1_end, a.ingested)))
    b.load_state_dict(state)
    # both hold no event learned (the log has them): the window starts after increment 1
    assert (a.base, len(a.events)) == (b.base, len(b.events)) == (800, 0)
    sa, sb = a.stream.idmap.state_dict(), b.stream.idmap.state_dict()
    assert torch.equal(sa["keys"], sb["keys"]) and sa["identity_bound"] == sb["identity_bound"]
    a.append(inc2)
    b.append(inc2_copy)
    assert torch.equal(a.events.src, b.events.src) and torch.equal(a.events.dst, b.events.dst)
    assert a.base == 800 and a.stream.idmap.external(a.events.dst).tolist() == inc2_dst.tolist()


def _owned(ev: EventBatch) -> EventBatch:
    return EventBatch(src=ev.src.clone(), dst=ev.dst.clone(), t=ev.t.clone(), eid=ev.eid.clone())


def test_a_learner_built_from_a_file_restores_the_map_bitwise(tmp_path):
    path = tmp_path / "sparse.csv"
    n = 900
    rng = np.random.default_rng(4)
    ids = rng.integers(0, I64.max, size=60)
    write_csv(path, rng.choice(ids, n), rng.choice(ids, n), np.arange(n, dtype=np.float64))
    cfg = config(dataset=str(path))
    a = ContinualLearner(cfg)
    a.run_phase1()
    state = a.state_dict()
    b = ContinualLearner(cfg)
    b.load_state_dict(state)
    keys = state["orchestrator"]["idmap"]["keys"]
    assert keys.numel() == a.stream.num_nodes and len(np.unique(ids)) >= keys.numel()
    assert torch.equal(b.stream.idmap.state_dict()["keys"], keys)


# ---- through the job ----------------------------------------------------------------------


def run(tmp_path, *argv) -> int:
    return main([*argv, "--backend", "local", "--trainers", "1", "--shards", "2",
                 "--no-progress", "--metrics-port", "-1", "--epochs", "1",
                 "--increments", "2", "--out", str(tmp_path / "run")])  # fmt: skip


def test_huge_and_negative_ids_in_a_csv_train_through_the_job(tmp_path, capsys):
    rng = np.random.default_rng(5)
    n = 800
    src, dst = rng.integers(0, 50, n), rng.integers(50, 100, n)
    src[10], dst[20], src[30], dst[40] = 10**9, I64.max, -5, I64.min
    path = tmp_path / "huge.csv"
    write_csv(path, src, dst, np.arange(n, dtype=np.float64))
    assert run(tmp_path, "--dataset", str(path)) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["dataset"] == "huge.csv" and np.isfinite(summary["ap"])
    logged = EventLog(str(tmp_path / "run")).read()  # what the job wrote names external ids
    assert logged.src.tolist() == src.tolist() and logged.dst.tolist() == dst.tolist()


def test_string_ids_train_through_the_job(tmp_path, capsys):
    rng = np.random.default_rng(6)
    n = 600
    users = [f"user-{c}" for c in "abcdefghijklmnopqrst"]
    items = [f"item/{i}é" for i in range(30)]
    src = [users[i] for i in rng.integers(0, 20, n)]
    dst = [items[i] for i in rng.integers(0, 30, n)]
    path = tmp_path / "names.csv"
    write_csv(path, pa.array(src), pa.array(dst), np.arange(n, dtype=np.float64))
    stream = load_stream(str(path), string_ids=True)
    assert stream.idmap.external(stream.events.src) == src
    assert stream.idmap.external(stream.events.dst) == dst
    assert stream.num_nodes == len(set(src)) + len(set(dst))
    assert run(tmp_path, "--dataset", str(path), "--string-ids") == 0
    # without the flag, text ids are a clear error naming the row
    code = run(tmp_path / "again", "--dataset", str(path))
    assert code == 2 and "non-numeric id" in capsys.readouterr().err


def test_the_loaders_accept_negative_ids_only_when_asked_and_never_in_jodie(tmp_path):
    path = tmp_path / "e.csv"
    path.write_text("src,dst,t\n-3,4,1.0\n5,-9223372036854775808,2.0\n")
    with pytest.raises(LoaderError, match="line 2: negative id: -3"):
        load_events(path)
    ev = load_events(path, negative_ids=True)
    assert ev.src.tolist() == [-3, 5] and ev.dst.tolist() == [4, I64.min]
    jodie = tmp_path / "j.csv"
    jodie.write_text("user_id,item_id,timestamp,state_label\n1,-2,1.0,0\n")
    with pytest.raises(LoaderError, match="negative id"):  # items shift by the user count
        load_events(jodie, negative_ids=True)
    with pytest.raises(LoaderError, match="string ids do not apply to format 'jodie'"):
        load_events(jodie, string_ids=True)


def test_string_ids_cannot_be_followed(tmp_path, capsys):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    assert run(tmp_path, "--follow", str(inbox), "--string-ids") == 2
    assert "string ids" in capsys.readouterr().err
