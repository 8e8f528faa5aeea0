"""The step timeline (`tidegraph.timeline`): what a tracer records, clock alignment, the shard
requests kept, and the run directory's trace files (runs on both backends with the timeline
on are in test_backends.py: a combined run, the job flags' run, and the slow matrix)."""

from __future__ import annotations

import json
import time

import pytest

from tidegraph.timeline import (
    Tracer,
    clock_offset,
    keep_overlapping,
    load_trace,
    shift,
    trace_document,
    validate,
)


def test_a_tracer_records_every_kth_step_and_all_work_outside_steps():
    tr = Tracer("trainer 0", every=3)
    for step in range(7):
        tr.begin(step)
        t = time.perf_counter()
        tr.add("forward", t, t + 0.001, roots=10)
    t = time.perf_counter()
    tr.record("ingest", t, t + 0.002, "driver", events=5)
    events = tr.take()
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["args"]["step"] for e in spans if e["name"] == "forward"] == [0, 3, 6]
    assert spans[-1]["name"] == "ingest" and spans[-1]["args"] == {"events": 5}
    assert abs(spans[0]["dur"] - 1000.0) < 1e-3  # microseconds
    # metadata first: the process and the track are named
    assert [e["name"] for e in events[:2]] == ["process_name", "thread_name"]
    validate(trace_document(events))
    assert tr.take() == []  # taken: nothing twice


def test_an_off_tracer_records_nothing():
    tr = Tracer("driver", every=0)
    tr.begin(0)
    with tr.span("checkpoint"):
        pass
    tr.add("forward", 0.0, 1.0)
    assert tr.take() == [] and not tr.enabled


def test_a_tracer_clock_is_the_wall_clock_in_microseconds():
    before = time.time_ns() / 1e3
    tr = Tracer("x", every=1)
    with tr.span("work"):
        time.sleep(0.01)
    after = time.time_ns() / 1e3
    (span,) = [e for e in tr.take() if e["ph"] == "X"]
    assert before - 1e3 <= span["ts"] and span["ts"] + span["dur"] <= after + 1e3
    assert span["dur"] >= 1e4 * 0.9


def test_clock_offset_recovers_a_remote_clock_within_half_the_round_trip():
    true_offset = 3.5e6  # the remote clock runs 3.5 s ahead

    def remote():
        time.sleep(0.001)
        return time.time_ns() / 1e3 + true_offset

    offset, error = clock_offset(remote, samples=4)
    assert abs(offset - true_offset) <= error + 200  # + the remote's own delay asymmetry
    events = shift([{"ts": 10.0 + true_offset, "ph": "X"}, {"ph": "M"}], offset)
    assert abs(events[0]["ts"] - 10.0) <= error + 200


def _x(name, cat, ts, dur):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 0,
            "args": {}}  # fmt: skip


def test_shard_requests_are_kept_only_where_they_meet_a_recorded_step():
    events = [_x("forward", "step", 100, 50), _x("forward", "step", 400, 10),
              _x("sample_hop", "shard", 120, 5), _x("sample_hop", "shard", 200, 5),
              _x("fetch", "shard", 405, 30), _x("fetch", "shard", 395, 4),
              _x("ingest", "ingest", 300, 5), _x("checkpoint", "driver", 600, 5)]  # fmt: skip
    kept = keep_overlapping(events, "shard")
    assert [(e["name"], e["ts"]) for e in kept] == [
        ("forward", 100), ("forward", 400), ("sample_hop", 120), ("fetch", 405),
        ("ingest", 300), ("checkpoint", 600)]  # fmt: skip
    # no recorded step at all: no request is kept
    assert [e["name"] for e in keep_overlapping(events[2:], "shard")] == ["ingest", "checkpoint"]


def test_validate_names_the_first_bad_event():
    good = _x("forward", "step", 0, 1)
    validate(trace_document([good]))
    with pytest.raises(ValueError, match="event 1"):
        validate(trace_document([good, {**good, "dur": -1}]))
    with pytest.raises(ValueError, match="event 0"):
        validate(trace_document([{"name": "x", "ph": "B", "pid": 1, "tid": 0, "args": {}}]))
    with pytest.raises(ValueError, match="no traceEvents"):
        validate({"events": []})


def test_load_trace_merges_the_run_directory_files_in_order(tmp_path):
    (tmp_path / "timeline").mkdir()
    tr = Tracer("trainer 0", every=1)
    parts = []
    for k in range(3):
        tr.begin(k)
        t = time.perf_counter()
        tr.add("forward", t, t + 0.001)
        parts.append(tr.take())
    for k, part in enumerate(parts):
        doc = trace_document(part, {"part": k})
        (tmp_path / "timeline" / f"{k:05d}.json").write_text(json.dumps(doc))
    merged = load_trace(str(tmp_path))
    validate(merged)
    spans = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["step"] for e in spans] == [0, 1, 2]
    assert sum(e["ph"] == "M" for e in merged["traceEvents"]) == 2  # names once
    assert merged["otherData"] == {"part": 0}
    with pytest.raises(FileNotFoundError, match="--timeline"):
        load_trace(str(tmp_path / "elsewhere"))
