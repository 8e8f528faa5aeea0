"""Checkpoints as manifests over chunks written once: bitwise round trips, what is shared
between checkpoints and replicas, retention, and a kill in the middle of a write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from tidegraph.storage.checkpoint import (
    CHUNK,
    INLINE,
    CheckpointStore,
    DeltaTables,
    RowDelta,
    compact,
)


def _same(a, b) -> None:
    """Bitwise equal trees (dtypes, shapes and bytes; NaN payloads included)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    else:
        assert a == b


def _files(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}


def test_a_checkpoint_comes_back_bitwise_whatever_its_tensors(tmp_path):
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(100_000, generator=g)
    weird = torch.tensor([float("nan"), -0.0, float("inf")]).repeat(20_000)
    state = {
        "model": OrderedDict(w=flat[:60_000].view(300, 200), b=flat[60_000:60_010]),
        "tables": [
            torch.randint(0, 2**62, (50_000,), generator=g),
            weird,
            torch.randn(40_000, generator=g).to(torch.bfloat16),
            torch.rand(70_000, generator=g) > 0.5,
            torch.empty(0, 16),
        ],
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "gen": g.get_state(),
        "plain": ("a", 1, None, [2.0]),
    }
    state["model"]._metadata = {"": {"version": 2}}
    store = CheckpointStore.at(str(tmp_path / "ckpt"))
    store.save(state, "one")
    back = store.load()
    _same(back, state)
    assert back["model"]._metadata == {"": {"version": 2}}
    assert store.latest() == "one" and store.tags() == ["one"]


def test_equal_tensors_and_grown_tables_are_written_once(tmp_path):
    """W replicas' equal parameters cost one copy; a table grown by appending rows shares its
    earlier full chunks with the previous checkpoint; a view costs its own bytes only."""
    rows = CHUNK // (16 * 4)  # rows of a chunk of a (n, 16) float32 table
    table = torch.randn(3 * rows + 5, 16)
    params = torch.randn(200_000)
    big = torch.randn(1_000_000)
    replicas = [{"model": params.clone(), "optimizer": params * 2} for _ in range(4)]
    store = CheckpointStore.at(str(tmp_path / "ckpt"))
    store.save({"trainers": replicas, "table": table, "view": big[:INLINE]}, "a")
    want = 2 * params.numel() * 4 + table.numel() * 4 + INLINE * 4
    assert want <= store.last_written < want + 50_000  # + the manifest

    grown = torch.cat([table, torch.randn(rows, 16)])
    store.save({"trainers": replicas, "table": grown, "view": big[:INLINE]}, "b")
    # the 3 full chunks are shared; the old partial chunk's 5 rows and the new rows are new
    new = (grown.shape[0] - 3 * rows) * 16 * 4
    assert new <= store.last_written < new + 50_000
    _same(store.load("a")["table"], table)
    _same(store.load("b")["table"], grown)


def test_retention_keeps_the_newest_and_deletes_what_only_older_ones_use(tmp_path):
    path = tmp_path / "ckpt"
    store = CheckpointStore.at(str(path))
    shared = torch.randn(50_000)
    states = {f"c{i}": {"shared": shared, "own": torch.full((50_000,), float(i))} for i in range(5)}
    for tag, state in states.items():
        store.save(state, tag, keep=2)
    assert store.tags() == ["c3", "c4"] and store.latest() == "c4"
    assert sorted(p.name for p in path.glob("*.pt")) == ["c3.pt", "c4.pt"]
    blobs = list((path / "blobs").iterdir())
    assert len(blobs) == 3  # shared, c3's own, c4's own
    for tag in ("c3", "c4"):
        _same(store.load(tag), states[tag])
    with pytest.raises(FileNotFoundError):
        store.load("c2")
    # the same tag again replaces it and stays the newest
    store.save(states["c3"], "c3", keep=2)
    assert store.tags() == ["c4", "c3"] and store.latest() == "c3"
    with pytest.raises(ValueError, match="keep must be >= 1"):
        store.save(states["c0"], "x", keep=0)


def test_checkpoints_written_as_whole_files_are_read_and_retired_in_order(tmp_path):
    """A run directory of checkpoints written before manifests: they load as they are, and
    retention counts them, oldest first."""
    path = tmp_path / "ckpt"
    path.mkdir()
    for i, tag in enumerate(["phase1", "increment-00001"]):
        torch.save({"x": torch.full((20_000,), float(i))}, path / f"{tag}.pt")
        os.utime(path / f"{tag}.pt", ns=(10**18 + i, 10**18 + i))
        (path / "latest").write_text(tag)
    store = CheckpointStore.at(str(path))
    assert store.tags() == ["phase1", "increment-00001"]
    assert float(store.load()["x"][0]) == 1.0
    store.save({"x": torch.full((20_000,), 2.0)}, "increment-00002", keep=2)
    assert store.tags() == ["increment-00001", "increment-00002"]
    assert not (path / "phase1.pt").exists()
    assert float(store.load("increment-00001")["x"][0]) == 1.0


def test_a_listing_that_meets_a_directory_being_made_is_taken_again(tmp_path, monkeypatch):
    """Actors put chunks at once: one lists blobs/ while another creates it, and pyarrow then
    reports the directory missing although it exists (seen at a Ray run's first checkpoint);
    the store lists again."""
    store = CheckpointStore.at(str(tmp_path / "store"))
    store.put({"w": torch.arange(100_000, dtype=torch.float32)})  # a chunk in blobs/
    real, failures = store.fs.get_file_info, [2]

    def flaky(selector):
        if failures[0]:
            failures[0] -= 1
            raise FileNotFoundError("Cannot list directory '.../blobs'")
        return real(selector)

    monkeypatch.setattr(store, "fs", type("FS", (), {"get_file_info": staticmethod(flaky)}))
    assert len(store._list("blobs")) >= 1 and failures == [0]


def test_tables_written_as_changed_rows_load_back_bitwise(tmp_path):
    """A node-state table written through `DeltaTables`: each checkpoint writes the rows
    changed since the last (a patch) over its base and earlier patches, by reference; it
    grows, loads back bitwise under retention, is written whole again when its patches would
    exceed half of it or its changes are unknown, and a float64 column keeps NaN and -0.0."""
    uri = str(tmp_path)
    store, deltas = CheckpointStore.at(uri), DeltaTables()
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(40_000, 8, generator=gen)
    times = torch.zeros(40_000, dtype=torch.float64)
    times[:2] = torch.tensor([float("nan"), -0.0])
    changed, kinds = None, []
    for i in range(12):
        state = {"memory": deltas.put(uri, "memory", table, changed, store.chunk_keys()),
                 "t": deltas.put(uri, "t", times, changed, store.chunk_keys())}  # fmt: skip
        store.save(state, f"c{i}", keep=2)
        kinds.append(type(state["memory"]).__name__)
        if isinstance(state["memory"], RowDelta):  # the patch: 2,000 rows of 48 bytes
            assert store.last_written < 200_000, (i, store.last_written)
        back = store.load(f"c{i}")
        assert torch.equal(back["memory"], table) and back["memory"].shape == table.shape
        assert torch.equal(back["t"].view(torch.int64), times.view(torch.int64))  # bitwise
        changed = torch.zeros(table.shape[0], dtype=torch.bool)
        rows = torch.randint(0, table.shape[0], (2000,), generator=gen)
        table[rows] += 1.0
        times[rows] = float(i + 1)
        changed[rows] = True
        if i == 5:  # new nodes: the table grows, its new rows changed
            table = torch.cat([table, torch.randn(500, 8, generator=gen)])
            times = torch.cat([times, torch.full((500,), -1.0, dtype=torch.float64)])
            changed = torch.cat([changed, torch.ones(500, dtype=torch.bool)])
    # whole at first, patches after; whole again once the patches pass half the table
    assert kinds[0] == "TensorRef" and kinds[1:4] == ["RowDelta"] * 3
    assert "TensorRef" in kinds[5:], kinds
    # unknown changes (a load) and another store: written whole
    assert isinstance(
        deltas.put(uri, "memory", table, None, store.chunk_keys()), type(store.put(table))
    )
    other = str(tmp_path / "other")
    assert not isinstance(deltas.put(other, "memory", table, changed, set()), RowDelta)
    # rows of no bytes (edge features of a stream without any), whole and as a patch
    empty = torch.zeros(300, 0)
    state = {"feat": deltas.put(uri, "feat", empty, None, store.chunk_keys())}
    state["later"] = deltas.put(
        uri, "feat", empty, torch.ones(300, dtype=torch.bool), store.chunk_keys()
    )
    store.save(state, "empty")
    assert all(x.shape == (300, 0) for x in store.load("empty").values())


def test_a_chain_whose_chunks_retention_deleted_is_written_whole_again(tmp_path):
    """Checkpoints that went another way (through the driver, while a second node was up)
    let retention delete a chain's chunks: the next write through `DeltaTables` starts a new
    base instead of referencing them, and the checkpoint saves and loads."""
    uri = str(tmp_path)
    store, deltas = CheckpointStore.at(uri), DeltaTables()
    table = torch.arange(40_000.0).reshape(10_000, 4)
    store.save({"t": deltas.put(uri, "t", table, None, store.chunk_keys())}, "a", keep=1)
    for tag in ("b", "c"):  # whole tables, referencing nothing of "a"
        store.save({"t": table + 1}, tag, keep=1)
    changed = torch.zeros(10_000, dtype=torch.bool)
    changed[:3] = True
    table[:3] = -1.0
    ref = deltas.put(uri, "t", table, changed, store.chunk_keys())
    assert not isinstance(ref, RowDelta)
    store.save({"t": ref}, "d", keep=1)
    assert torch.equal(store.load("d")["t"], table)


def test_compact_gives_views_their_own_storage():
    flat = torch.randn(10_000)
    state = {"w": flat[:100].view(10, 10), "whole": flat, "opt": [flat[100:200]]}
    out = compact(state)
    assert out["w"].untyped_storage().nbytes() == 400
    assert out["opt"][0].untyped_storage().nbytes() == 400
    assert out["whole"] is flat  # already its own
    _same(out, state)


KILLED_WRITER = """
import sys, time
import torch
from tidegraph.storage.checkpoint import CheckpointStore

store, where = CheckpointStore.at(sys.argv[1]), sys.argv[2]
store.save({"x": torch.full((300_000,), 1.0), "y": torch.arange(100_000)}, "first", keep=1)
write = CheckpointStore._write
FILES = {"chunk": "blobs/", "manifest": "second.pt", "index": "index.json", "latest": "latest"}

def stop():
    print("writing", flush=True)
    time.sleep(60)

def slow_write(self, name, data):
    if where in FILES and name.startswith(FILES[where]):  # half of it in a temporary file
        with self.fs.open_output_stream(f"{self.path}/{name}.half.tmp") as out:
            out.write(bytes(data)[: len(data) // 2])
        stop()
    write(self, name, data)

def slow_prune(self, *args):  # retention under way: one file deleted, then killed
    self.fs.delete_file(f"{self.path}/first.pt")
    stop()

CheckpointStore._write = slow_write
if where == "prune":
    CheckpointStore._prune = slow_prune
store.save({"x": torch.full((300_000,), 2.0), "y": torch.arange(100_000)}, "second", keep=1)
"""


def _state(value: float) -> dict:
    return {"x": torch.full((300_000,), value), "y": torch.arange(100_000)}


# where the writer is killed -> the checkpoint `latest` names after the kill
KILLED_AT = {"chunk": "first", "manifest": "first", "index": "first", "latest": "first",
             "prune": "second"}  # fmt: skip


@pytest.mark.parametrize("where", sorted(KILLED_AT))
def test_a_kill_anywhere_in_a_write_leaves_the_newest_whole_checkpoint_loadable(tmp_path, where):
    """SIGKILL while a chunk, the manifest, the index or `latest` is half written, or while
    retention deletes: `latest` names a checkpoint that loads whole, and the next save
    clears what the kill left."""
    path = tmp_path / "ckpt"
    cmd = [sys.executable, "-c", textwrap.dedent(KILLED_WRITER), str(path), where]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=Path(__file__).parents[1])  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    if where != "prune":
        assert any(name.endswith(".tmp") for name in _files(path))  # killed mid-write
    store = CheckpointStore.at(str(path))
    want = KILLED_AT[where]
    assert store.latest() == want
    _same(store.load(), _state({"first": 1.0, "second": 2.0}[want]))
    # the next save clears what the kill left: temporary files, chunks nobody references
    store.save(_state(3.0), "third", keep=1)
    files = _files(path)
    assert not any(name.endswith(".tmp") for name in files)
    assert sorted(n for n in files if not n.startswith("blobs/")) == [
        "index.json", "latest", "third.pt"]  # fmt: skip
    assert len([n for n in files if n.startswith("blobs/")]) == 2  # x's and y's chunks
    _same(store.load(), _state(3.0))


def test_packed_rows_unpack_at_any_row_count_and_offset():
    """Columns of mixed widths come back from packed rows whatever the number of rows (one,
    none) and wherever a slice of rows starts."""
    from tidegraph.storage.checkpoint import pack_rows, unpack_rows

    cols = [
        torch.arange(5),
        torch.arange(5) * 3,
        torch.arange(5, dtype=torch.float32) / 2,  # the columns after it are not aligned
        -torch.arange(5.0, dtype=torch.float64),
    ]
    dtypes = [c.dtype for c in cols]
    rows = pack_rows(cols)
    assert rows.shape == (5, 8 + 8 + 4 + 8)
    for lo, hi in ((0, 5), (1, 2), (3, 4), (2, 2), (1, 4)):
        got = unpack_rows(rows[lo:hi], dtypes)
        assert all(torch.equal(g, c[lo:hi]) for g, c in zip(got, cols, strict=True)), (lo, hi)
    assert pack_rows([c[:0] for c in cols]).shape == (0, 28)


def test_chunks_gathered_for_another_writer_are_what_a_put_there_would_write(tmp_path):
    """A put within `gathered` (a process that does not reach the store) writes nothing: it
    gives the refs a put there would give and the chunks the store lacks, by the listing
    the caller passed; once the caller writes them the state saves and loads bitwise, and
    what the store held already is not gathered again."""
    from tidegraph.storage.checkpoint import chunks_of, gathered, put_state

    uri = str(tmp_path / "c")
    store = CheckpointStore.at(uri)
    old = torch.arange(300_000, dtype=torch.float64)
    store.save({"old": old}, "a", keep=2)
    have = store.chunk_keys()
    new = torch.randn(200_000)
    refs, chunks = gathered(lambda: put_state(uri, {"old": old, "new": new}, inline=0), have)
    assert store.chunk_keys() == have  # nothing written
    assert chunks.keys() == chunks_of(refs["new"]) and not chunks.keys() & have
    assert chunks_of(refs) == have | chunks.keys()
    store.write_chunks(chunks, have)
    store.save(refs, "b", keep=2)
    back = store.load("b")
    assert torch.equal(back["old"], old) and torch.equal(back["new"], new)
