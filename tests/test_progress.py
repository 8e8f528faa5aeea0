"""Progress bars: rates over a sliding window, one complete line per interval when not on a
terminal, a line redrawn in place on one, never past 100%, and totals that count every event a
pass processes (replayed ones included), so a real run's bars end at exactly their totals on
both backends. A fake clock and a StringIO stream: no test waits or times anything."""

import io
import re

import pytest
import torch

from tidegraph.orchestrator import make_group
from tidegraph.training import ContinualLearner, RunConfig, load_stream
from tidegraph.training.config import ContinualConfig
from tidegraph.training.progress import Progress, begin_pass, close_pass_bar, pass_bar
from tidegraph.training.schedule import Schedule


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def bar(total, tty: bool = False, **kwargs) -> tuple[Progress, Clock, io.StringIO]:
    clock, out = Clock(), io.StringIO()
    return Progress(total, "pass", stream=out, tty=tty, clock=clock, **kwargs), clock, out


def test_the_rate_is_over_the_last_window_of_updates_and_waits_for_a_meaningful_span():
    b, clock, _ = bar(10_000, enabled=False)
    first = 2.0**-20  # a first batch done a microsecond after the bar opened: no rate yet
    clock.now = first
    b.update(200)
    assert b.window_rate() is None
    for i in range(1, 41):  # 20 s at 100 events/s, an update every 0.5 s
        clock.now = first + 0.5 * i
        b.update(50)
        span = 0.5 * i
        assert (b.window_rate() is None) == (span < Progress.min_span)
    assert b.window_rate() == pytest.approx(100.0)
    for i in range(1, 25):  # then 20 events/s for 12 s: the window forgets the faster part
        clock.now = first + 20 + 0.5 * i
        b.update(10)
    assert b.window_rate() == pytest.approx(20.0)
    clock.now += 10  # nothing done since: the rate falls
    assert b.window_rate() < 20.0
    assert b.close() == pytest.approx((b.done - 0) / clock.now)  # the mean since opening


def test_without_a_terminal_a_complete_line_per_interval_then_the_closing_line():
    b, clock, out = bar(1000)
    b.line_interval = 10.0
    for i in range(1, 101):  # 10 events a second for 100 s
        clock.now = float(i)
        b.update(10)
    assert b.close() == pytest.approx(10.0)
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == 11  # at 10, 20, ..., 100 s, and the closing line
    # the rate over updates since the first (1 s to 10 s: 90 events in 9 s), and an ETA
    assert lines[0] == "pass: 100/1,000 events  10.0% 10 ev/s ETA 1:30"
    assert lines[4] == "pass: 500/1,000 events  50.0% 10 ev/s ETA 0:50"
    assert lines[-2] == "pass: 1,000/1,000 events 100.0% 10 ev/s ETA 0:00"
    assert lines[-1] == "pass: 1,000/1,000 events 100.0% in 1:40, mean 10 ev/s"


def test_on_a_terminal_one_line_is_redrawn_in_place_and_padded_over():
    b, clock, out = bar(None, tty=True)
    b.tty_interval = 0.5
    for i in range(1, 9):
        clock.now = 0.25 * i
        b.update(1000)
    b.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    draws = text[:-1].split("\r")[1:]
    assert len(draws) == 5  # at 0.5, 1, 1.5 and 2 s, and the closing line
    assert draws[0] == "pass: 2,000 events (total unknown)"  # no rate: one update so far
    assert draws[2] == "pass: 6,000 events (total unknown) 4,000 ev/s"
    assert draws[-1].startswith("pass: 8,000 events (total unknown) in 2.00 s, mean 4,000 ev/s")
    assert all(len(d) >= len(p) for p, d in zip(draws, draws[1:], strict=False))  # padded


@pytest.mark.parametrize("steps", [[7] * 15, [100], [1, 2, 3, 94], [60, 40, 5]])
def test_never_past_100_percent_a_wrong_total_becomes_unknown(steps):
    b, clock, out = bar(100)
    b.line_interval = 0.0
    for n in steps:
        clock.now += 1
        b.update(n)
    b.close()
    percents = [float(p) for p in re.findall(r"([\d.]+)%", out.getvalue())]
    assert percents and max(percents) <= 100.0
    last = out.getvalue().splitlines()[-1]
    if sum(steps) == 100:
        assert last.startswith("pass: 100/100 events 100.0% in ")
    else:  # the count went past the total: no percentage once it did
        assert last.startswith(f"pass: {sum(steps):,} events (total unknown) in ")


def test_disabled_bars_write_nothing_but_keep_their_rate():
    b, clock, out = bar(10, enabled=False)
    clock.now = 2.0
    b.update(10)
    assert b.close() == 5.0 and out.getvalue() == ""


# ---- a pass's bar in the learner's pass state -------------------------------------------------


def _pass_sizes(schedule: Schedule, replayed: int):
    """Per pass of `schedule`: (index of its first unit, its units, the events each unit
    processes: a training batch gets its share of `replayed` events as `_unit_replay` splits
    them)."""
    units = schedule.units
    at = 0
    while at < len(units):
        u = units[at]
        if u.kind in ("train", "eval") and u.part == 0:
            todo = units[at : at + u.parts]
            sizes = [x.hi - x.lo for x in todo]
            if u.kind == "train" and u.increment >= 0:
                shares = torch.tensor_split(torch.arange(replayed), u.parts)
                sizes = [n + len(s) for n, s in zip(sizes, shares, strict=True)]
            yield at, todo, sizes
            at += u.parts
        else:
            at += 1


@pytest.mark.parametrize("resume_at", [0, 2])
def test_a_pass_bar_totals_every_event_its_pass_processes(resume_at):
    """Batches of a pass, replayed events in training passes, the last batch short: each bar
    ends at exactly its total, also when it opens midway (a run resumed from a checkpoint)."""
    c = ContinualConfig(num_increments=2, train_fraction=0.6, replay_ratio=0.5)
    schedule = Schedule(torch.arange(1050.0), c, batch_size=100, epochs=2)
    replayed = 157
    passes = list(_pass_sizes(schedule, replayed))
    assert max(len(todo) for _, todo, _ in passes) >= 3 and 1 in {len(t) for _, t, _ in passes}
    for at, todo, sizes in passes:
        ps = {"replayed": replayed} if todo[0].increment >= 0 else {}
        begin_pass(ps, schedule, at, todo[0], enabled=False)
        if resume_at and len(todo) > resume_at:  # a checkpoint's pass state: no bar
            del ps["bar"]
            ps["loss_events"] = sum(sizes[:resume_at])
        for i, (u, n) in enumerate(zip(todo, sizes, strict=True)):
            if i < resume_at < len(todo):
                continue
            begin_pass(ps, schedule, at + i, u, enabled=False)
            pass_bar(ps, n)
        b = ps["bar"]
        assert (b.done, b.total) == (sum(sizes), sum(sizes)), todo[0]
        close_pass_bar(ps, sum(sizes))
        assert "bar" not in ps


# ---- a real run's bars on both backends -------------------------------------------------------

LINE = re.compile(
    r"^(?P<desc>(phase1|increment \d+) (train|eval) \d+): (?P<done>[\d,]+)/(?P<total>[\d,]+)"
    r" events +(?P<pct>[\d.]+)%(?P<rest>.*)$"
)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_runs_bars_end_at_exactly_their_totals(backend, ray_session, quick_polls, monkeypatch,
                                                 capsys):  # fmt: skip
    """A small run with replay, a line at every update (the Ray group's updates come from the
    steps trainer 0 reports while a whole pass runs): every pass closes at done == total,
    100%, and no line is ever past its total; a retraining pass's total is its increment's
    events plus those replayed."""
    monkeypatch.setattr(Progress, "line_interval", 0.0)
    raw = {
        "model": {"dim": 16, "time_dim": 8, "memory_dim": 16, "slot_precision": "fp32"},
        "train": {"batch_size": 100, "epochs": 1, "eval_negatives": 3},
        "continual": {"num_increments": 2, "forget_sample": 100, "train_fraction": 0.6,
                      "replay_ratio": 0.5},
        "cluster": {"backend": backend, "shards": 2, "trainers": 2},
        "seed": 7, "progress": True, "out_dir": None, "run_name": "tidegraph-progress-test",
    }  # fmt: skip
    learner = ContinualLearner(RunConfig.from_dict(raw), load_stream("wikipedia", 1500),
                               make_group)  # fmt: skip
    try:
        learner.run()
        assert learner.group.runs_passes == (backend == "ray")  # both paths of the learner
    finally:
        learner.group.shutdown()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [m for x in err.splitlines() if (m := LINE.match(x))]
    finals = {}
    for m in lines:
        done, total = int(m["done"].replace(",", "")), int(m["total"].replace(",", ""))
        assert done <= total and float(m["pct"]) <= 100.0, m[0]
        if m["rest"].startswith(" in "):  # the closing line
            assert done == total and m["pct"] == "100.0", m[0]
            finals[m["desc"]] = total
    increments = [r for r in learner.history if r["phase"] == "increment"]
    assert [r["replayed"] > 0 for r in increments] == [True, True]
    want = {"phase1 train 1": learner.val_start,
            "phase1 eval 1": learner.phase1_end - learner.val_start}  # fmt: skip
    for k, r in enumerate(increments):
        want[f"increment {k + 1} eval 1"] = r["events"]
        want[f"increment {k + 1} train 1"] = r["events"] + r["replayed"]
    assert finals == want
    assert len(lines) > len(finals)  # lines while the passes ran, not only the closing ones
