"""Live sources: event files arriving in a directory, or lines appended to a growing file,
while the run goes on; resuming a followed run."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tidegraph.jobs.train import main, parse_config
from tidegraph.orchestrator import Orchestrator, RunState
from tidegraph.orchestrator.rundir import RunDir
from tidegraph.runtime import set_determinism
from tidegraph.storage.eventlog import EventLog
from tidegraph.storage.ingest import LoaderError, load_events
from tidegraph.storage.live import DirectorySource, GrowingFileSource
from tidegraph.training import load_stream

sys.path.insert(0, str(Path(__file__).parent))
from threads import Watched  # noqa: E402


def write_events(path, events) -> None:
    """A JODIE CSV of `events` (written under a temporary name, then renamed: whole)."""
    rows = ["user_id,item_id,timestamp,state_label,f0"]
    cols = (events.src.tolist(), events.dst.tolist(), events.t.tolist())
    rows += [f"{s},{d},{t!r},0,{(s % 7) / 7:.3f}" for s, d, t in zip(*cols, strict=True)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    tmp.rename(path)


def test_files_arriving_in_a_followed_directory_become_increments(tmp_path, capsys, monkeypatch):
    events = load_stream("wikipedia", 3000).events
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    write_events(inbox / "part-000.csv", events.select(slice(0, 2000)))
    write_events(inbox / "part-001.csv", events.select(slice(2000, 2500)))
    (inbox / ".hidden.csv").write_text("not,events\n")  # never read (hidden)
    (inbox / "part-003.csv.part").write_text("garbage")  # never read (partial)

    def later():
        time.sleep(0.3)
        write_events(inbox / "part-002.csv", events.select(slice(2500, 3000)))

    writer = Watched(later)
    asked, asks = DirectorySource.next_events, []

    def next_events(self, timeout):  # the third file arrives while the run waits for it
        asks.append(timeout)
        if len(asks) == 3:
            writer.start()
        return asked(self, timeout)

    monkeypatch.setattr(DirectorySource, "next_events", next_events)
    monkeypatch.setattr(DirectorySource, "poll_interval", 0.1)
    threads = torch.get_num_threads()
    try:
        args = ["--follow", str(inbox), "--follow-timeout", "2", "--epochs", "1",
                "--backend", "local", "--shards", "2", "--trainers", "2", "--no-progress",
                "--out", str(tmp_path / "run")]  # fmt: skip
        assert main(args) == 0
    finally:
        if writer.ident is not None:  # started
            writer.join(60)
        torch.set_num_threads(threads)
    assert asks == [2.0] * 4  # phase 1, two increments, and the wait that found nothing
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["phase1", "increment", "increment"]
    assert [r["events"] for r in rows[1:]] == [500, 500]
    logged = EventLog(str(tmp_path / "run")).read()
    assert torch.equal(logged.src, events.src) and torch.equal(logged.t, events.t)
    assert logged.edge_feat.shape == (3000, 1)  # features come along


def test_following_a_directory_that_stays_empty_is_a_clear_error(tmp_path, capsys):
    DirectorySource.poll_interval = 0.05
    try:
        args = ["--follow", str(tmp_path), "--follow-timeout", "0.2", "--backend", "local",
                "--out", str(tmp_path / "run")]  # fmt: skip
        assert main(args) == 2
    finally:
        DirectorySource.poll_interval = 0.5
    assert "no event file arrived" in capsys.readouterr().err


# ---- growing files ---------------------------------------------------------------------------


def csv_lines(events) -> list[str]:
    """`src,dst,t` rows of `events`, one string (with its newline) per event."""
    cols = (events.src.tolist(), events.dst.tolist(), events.t.tolist())
    return [f"{s},{d},{t!r}\n" for s, d, t in zip(*cols, strict=True)]


def append(path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def test_a_growing_file_hands_out_each_complete_line_once(tmp_path):
    path = tmp_path / "events.csv"
    rows = [f"{i},{100 + i},{float(i)!r}\n" for i in range(20)]
    path.write_text("# a comment\nsrc,dst,t\n" + "".join(rows[:5]) + rows[5][:3])
    source = GrowingFileSource(str(path))
    got = [source.next_events(0)[1]]  # phase 1: the complete lines, not the cut one
    assert got[0].src.tolist() == [0, 1, 2, 3, 4]
    assert source.next_events(0) is None  # a cut line alone is no increment
    # written in pieces: the cut line completed, a blank line, another cut line
    append(path, rows[5][3:] + "\n" + rows[6] + rows[7][:2])
    got.append(source.next_events(0)[1])
    append(path, rows[7][2:] + "".join(rows[8:12]))
    got.append(source.next_events(0)[1])
    assert [len(g) for g in got] == [5, 2, 5]
    assert source.next_events(0) is None  # nothing new: nothing handed out
    assert torch.cat([g.src for g in got]).tolist() == list(range(12))  # each line once
    # a restarted source continues right after the state's last line
    again = GrowingFileSource(str(path), lines=3)
    again.load_state_dict(source.state_dict())
    assert again.lines == 0  # the run's increment rule is kept
    again.lines = 3
    append(path, "".join(rows[12:20]))
    sizes = [len(again.next_events(0)[1]) for _ in range(3)]
    assert sizes == [3, 3, 2]  # N lines each; the last short once the file is quiet
    assert again.next_events(0) is None
    assert torch.equal(load_events(path).src, torch.arange(20))


def test_n_line_increments_wait_for_their_last_line(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text("src,dst,t\n1,2,1.0\n")
    source = GrowingFileSource(str(path), lines=2)
    source.poll_interval = 0.02
    assert len(source.next_events(0)[1]) == 1  # phase 1
    append(path, "2,3,2.0\n3,4")

    def finish_the_line():
        time.sleep(0.3)
        append(path, ",3.0\n4,5,4.0\n")

    writer = Watched(finish_the_line)
    writer.start()
    try:
        assert source.next_events(30)[1].src.tolist() == [2, 3]  # not [2] alone
    finally:
        writer.join(60)
    assert source.next_events(0)[1].src.tolist() == [4]  # quiet: the short last one


def test_bad_rows_of_a_growing_file_carry_the_whole_files_line_numbers(tmp_path):
    path = tmp_path / "events.csv"
    good = [f"{i},{100 + i},{float(i)!r}\n" for i in range(12)]
    bad = {3: "3,103,not-a-time\n", 7: "7,1.5,7.0\n", 10: "10,110\n"}
    lines = [bad.get(i, g) for i, g in enumerate(good)]
    lines.insert(5, "\n")  # a blank line: the loaders do not count it
    path.write_text("src,dst,t\n" + "".join(lines[:4]))
    source = GrowingFileSource(str(path), quarantine=str(tmp_path / "bad.csv"), lines=4)
    n = len(source.next_events(0)[1])
    append(path, "".join(lines[4:]))
    while (got := source.next_events(0)) is not None:
        n += len(got[1])
    assert n == 9
    load_events(path, quarantine=str(tmp_path / "whole-bad.csv"))
    quarantined = (tmp_path / "bad.csv").read_text()
    assert quarantined == (tmp_path / "whole-bad.csv").read_text()
    assert [row.split(",")[0] for row in quarantined.splitlines()[1:]] == ["5", "9", "12"]
    # without a quarantine: the error names the followed file and the whole file's line
    path.write_text("src,dst,t\n" + "".join(good[:3]))
    strict = GrowingFileSource(str(path))
    strict.next_events(0)
    append(path, "".join(good[3:6]) + bad[7])
    with pytest.raises(LoaderError, match=f"{path}: line 8: "):
        strict.next_events(0)


def test_a_truncated_rewritten_or_replaced_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "events.csv"
    two = "src,dst,t\n1,2,1.0\n2,3,2.0\n"
    path.write_text(two)
    source = GrowingFileSource(str(path))
    source.next_events(0)
    state = source.state_dict()
    path.write_text("src,dst,t\n")  # truncated in place
    with pytest.raises(ValueError, match=f"{path}: it shrank .*truncated"):
        source.next_events(0)
    path.write_text("src,dst,t\n9,9,9.0\n9,9,9.5\n7,7,10.0\n")  # longer again, other bytes
    with pytest.raises(ValueError, match=f"{path}: .*rewritten"):
        source.next_events(0)
    with pytest.raises(ValueError, match=f"{path}: it no longer holds the lines"):
        GrowingFileSource(str(path)).load_state_dict(state)
    path.write_text(two)
    rotated = GrowingFileSource(str(path))
    rotated.next_events(0)
    other = tmp_path / "new.csv"
    other.write_text(two + "3,4,3.0\n")
    other.replace(path)  # another file under the name (same first lines)
    with pytest.raises(ValueError, match=f"{path}: it is another file now"):
        rotated.next_events(0)


def test_a_growing_jodie_file_keeps_phase_1s_item_shift(tmp_path):
    path = tmp_path / "jodie.csv"
    head = "user_id,item_id,timestamp,state_label,f0\n"
    path.write_text(head + "0,0,1.0,0,0.5\n2,1,2.0,0,0.5\n")  # 3 users: items shift by 3
    source = GrowingFileSource(str(path), quarantine=str(tmp_path / "bad.csv"))
    assert source.next_events(0)[1].dst.tolist() == [3, 4]
    append(path, "1,1,3.0,0,0.25\n5,0,4.0,0,0.5\n")  # user 5: past phase 1's users
    got = source.next_events(0)[1]
    assert got.dst.tolist() == [4] and got.edge_feat.tolist() == [[0.25]]
    assert (tmp_path / "bad.csv").read_text().splitlines()[1].startswith("5,")  # its line


# ---- resuming a followed run -------------------------------------------------------------------

ARGS = ["--epochs", "1", "--no-progress", "--backend", "local", "--shards", "2",
        "--trainers", "2", "--follow-timeout", "0.3"]  # fmt: skip


def records(path) -> list[dict]:
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith(("_per_s", "_seconds"))} for r in rows]


@pytest.fixture
def fast_polls(monkeypatch):
    monkeypatch.setattr(DirectorySource, "poll_interval", 0.02)
    monkeypatch.setattr(GrowingFileSource, "poll_interval", 0.02)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def orchestrator(tmp_path, name: str, source) -> Orchestrator:
    """A followed run in this process, made as the job makes it (tests step it by hand)."""
    cfg = parse_config(ARGS)
    cfg.run_name, cfg.storage, cfg.out_dir = name, str(tmp_path), str(tmp_path / name)
    set_determinism(cfg.seed, 0, cfg.deterministic, cfg.threads)
    return Orchestrator(cfg, run_dir=RunDir(str(tmp_path), name), source=source,
                        follow_timeout=0.3)  # fmt: skip


def cut_mid_increment(run: Orchestrator, increments: int) -> None:
    """Phase 1 and `increments` increments, then the next one taken and ingested (its events
    in the event log) but not checkpointed: the driver dies there."""
    for _ in range(1 + 2 * increments):  # phase 1, then (take, run) per increment
        assert run.step() is RunState.RUNNING
    assert run.step() is RunState.RUNNING and not run.learner.done  # taken
    learner = run.learner
    learner.run_unit(learner.schedule.units[learner.cursor.unit])  # its ingest unit
    assert learner.ingested == learner.end


def assert_same_run(whole, cut, total: int) -> None:
    """`cut` ended as `whole`: metrics of every increment, summary, and the event log holds
    each event once (it reads without gaps or overlaps) as the uninterrupted run's does."""
    assert records(cut) == records(whole)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (whole, cut))
    assert a == b
    x, y = EventLog(str(whole)).read(), EventLog(str(cut)).read()
    assert len(y) == total and torch.equal(y.eid, torch.arange(total))
    assert torch.equal(x.src, y.src) and torch.equal(x.dst, y.dst) and torch.equal(x.t, y.t)
    assert len(list((cut / "events").glob("*.superseded"))) == 1  # the cut increment's file


def test_a_resumed_followed_directory_run_ends_as_an_uninterrupted_one(
    tmp_path, fast_polls, capsys
):
    events = load_stream("wikipedia", 2000).events
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    cuts = [0, 1200, 1400, 1600, 1800, 2000]
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
        write_events(inbox / f"part-{i:03d}.csv", events.select(slice(lo, hi)))
    common = ARGS + ["--follow", str(inbox), "--storage", str(tmp_path)]
    assert main(common + ["--run-name", "whole"]) == 0
    run = orchestrator(tmp_path, "cut", DirectorySource(str(inbox)))
    assert run.step() is RunState.RUNNING  # scheduling: phase 1 is the first file
    cut_mid_increment(run, 2)
    del run
    assert main(common + ["--run-name", "cut", "--resume"]) == 0
    assert_same_run(tmp_path / "whole", tmp_path / "cut", 2000)
    assert EventLog(str(tmp_path / "cut")).read().edge_feat.shape == (2000, 1)
    # a followed run resumes only with its source
    capsys.readouterr()
    assert main(ARGS + ["--storage", str(tmp_path), "--run-name", "cut", "--resume"]) == 2
    assert f"pass --follow {inbox}" in capsys.readouterr().err


def test_a_resumed_growing_file_run_ends_as_an_uninterrupted_one(tmp_path, fast_polls):
    lines = csv_lines(load_stream("wikipedia", 2000).events)
    rest = "".join(lines[1200:])
    for name in ("whole", "cut"):  # each run follows its own copy of the file
        path = tmp_path / f"from-{name}" / "events.csv"
        path.parent.mkdir()
        path.write_text("src,dst,t\n" + "".join(lines[:1200]))
        run = orchestrator(tmp_path, name, GrowingFileSource(str(path), lines=200))
        assert run.step() is RunState.RUNNING  # phase 1: the 1200 lines there
        for piece in (rest[:1000], rest[1000:5001], rest[5001:]):  # cut inside lines
            append(path, piece)
        if name == "whole":
            run.run()
        else:
            cut_mid_increment(run, 2)
        del run
    assert [r["events"] for r in records(tmp_path / "whole")[1:]] == [200, 200, 200, 200]
    args = ["--follow", str(tmp_path / "from-cut" / "events.csv"), "--follow-lines", "200",
            "--storage", str(tmp_path), "--run-name", "cut", "--resume"]  # fmt: skip
    assert main(ARGS + args) == 0
    assert_same_run(tmp_path / "whole", tmp_path / "cut", 2000)


def test_a_resumed_followed_run_with_huge_and_negative_ids_ends_as_an_uninterrupted_one(
    tmp_path, fast_polls
):
    """Ids of any int64 value in arriving files: the id map is checkpointed with the run, the
    event log names the files' ids, and a resumed run maps new ids as the uninterrupted one."""
    gen = torch.Generator().manual_seed(7)
    pool = torch.randint(-(2**63), 2**63 - 1, (150,), generator=gen)
    pool[:3] = torch.tensor([2**63 - 1, -(2**63), -1])
    n = 1400
    src = pool[torch.randint(0, 150, (n,), generator=gen)]
    dst = pool[torch.randint(0, 150, (n,), generator=gen)]
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    cuts = [0, 800, 950, 1100, 1250, 1400]
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
        rows = [
            f"{s},{d},{float(t)!r}\n"
            for s, d, t in zip(src[lo:hi].tolist(), dst[lo:hi].tolist(), range(lo, hi), strict=True)
        ]
        (inbox / f"part-{i:03d}.csv").write_text("src,dst,t\n" + "".join(rows))
    common = ARGS + ["--follow", str(inbox), "--storage", str(tmp_path)]
    assert main(common + ["--run-name", "whole"]) == 0
    run = orchestrator(tmp_path, "cut", DirectorySource(str(inbox)))
    assert run.step() is RunState.RUNNING
    cut_mid_increment(run, 2)
    del run
    assert main(common + ["--run-name", "cut", "--resume"]) == 0
    assert_same_run(tmp_path / "whole", tmp_path / "cut", n)
    logged = EventLog(str(tmp_path / "cut")).read()
    assert torch.equal(logged.src, src) and torch.equal(logged.dst, dst)
