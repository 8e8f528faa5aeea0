"""A live source: event files arriving in a directory while the run goes on."""

import json
import threading
import time

import torch

from tidegraph.jobs.train import main
from tidegraph.storage.eventlog import EventLog
from tidegraph.storage.live import DirectorySource
from tidegraph.training import load_stream


def write_events(path, events) -> None:
    """A JODIE CSV of `events` (written under a temporary name, then renamed: whole)."""
    rows = ["user_id,item_id,timestamp,state_label,f0"]
    cols = (events.src.tolist(), events.dst.tolist(), events.t.tolist())
    rows += [f"{s},{d},{t!r},0,{(s % 7) / 7:.3f}" for s, d, t in zip(*cols, strict=True)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    tmp.rename(path)


def test_files_arriving_in_a_followed_directory_become_increments(tmp_path, capsys):
    events = load_stream("wikipedia", 3000).events
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    write_events(inbox / "part-000.csv", events.select(slice(0, 2000)))
    write_events(inbox / "part-001.csv", events.select(slice(2000, 2500)))
    (inbox / ".hidden.csv").write_text("not,events\n")  # never read (hidden)
    (inbox / "part-003.csv.part").write_text("garbage")  # never read (partial)

    def later():
        time.sleep(2.0)
        write_events(inbox / "part-002.csv", events.select(slice(2500, 3000)))

    writer = threading.Thread(target=later)
    writer.start()
    threads = torch.get_num_threads()
    DirectorySource.poll_interval = 0.1
    try:
        args = ["--follow", str(inbox), "--follow-timeout", "6", "--epochs", "1",
                "--backend", "local", "--shards", "2", "--trainers", "2", "--no-progress",
                "--out", str(tmp_path / "run")]  # fmt: skip
        assert main(args) == 0
    finally:
        writer.join()
        torch.set_num_threads(threads)
        DirectorySource.poll_interval = 0.5
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
