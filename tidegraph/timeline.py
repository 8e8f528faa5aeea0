"""Step timelines in the Chrome trace event format (Perfetto, chrome://tracing).

Every process that works for a run keeps a `Tracer`: trainers record the phases of their
steps (sample, fetch, forward, backward, allreduce and its buckets, exchange, optimizer,
apply), shards the requests they serve, the driver its own work (ingest, routing, checkpoint,
evaluation, recovery, resize). With `--timeline K` a trainer records every K-th step of each
pass kind (training steps by their global number, evaluation batches by their own count);
shards record every request and the driver keeps those that overlap a recorded step.

Clocks. A span's time is the process's wall clock (`time.time_ns`) at the tracer's start plus
`perf_counter` since, in microseconds: monotonic within a process, and aligned across the
processes of one node (one system clock). A process on another node is shifted by its clock's
offset from the driver's, estimated from round trips (`clock_offset`, as NTP does): the
sample with the shortest round trip, offset = remote - midpoint, within half that round trip.

The driver writes what it collected at the end of phase 1 and of every increment to
`RUN_DIR/timeline/NNNNN.json` (each file a whole trace: bounded files for a run that never
ends); `load_trace` merges them in order into one document (`tidegraph.whatif` reads it).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterator

__all__ = [
    "Tracer",
    "clock_offset",
    "keep_overlapping",
    "load_trace",
    "payload_bytes",
    "read_trace",
    "trainer_step_spans",
    "shift",
    "timeline_meta",
    "trace_document",
    "validate",
    "wall_us",
]


class Tracer:
    """Spans of one process (or, in one process, of one trainer or shard: its `tid`).

    `every`: 0 off; K records the steps `begin(step)` is called with where step % K == 0,
    and every `span` outside steps (driver and shard work)."""

    def __init__(self, name: str, every: int = 0, tid: int = 0, process: str | None = None) -> None:
        """`name`: the track's (thread's) name; `process`: the process's (default `name`)."""
        self.name, self.every, self.tid, self.process = name, every, tid, process
        self.pid = os.getpid()
        self.events: list[dict] = []
        self.on = False  # the current step is recorded
        self.label: dict = {}  # args of the current step's spans (its step number, pass)
        self.wall0_us = wall_us()
        self.perf0 = time.perf_counter()

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def us(self, t: float) -> float:
        """`time.perf_counter()` value `t` on this tracer's wall clock, in microseconds."""
        return self.wall0_us + (t - self.perf0) * 1e6

    def begin(self, step: int, kind: str = "train") -> bool:
        """A step (or evaluation batch) `step` of pass kind `kind` starts: whether its
        spans are recorded."""
        self.on = self.every > 0 and step % self.every == 0
        self.label = {"step": step, "pass": kind}
        return self.on

    def add(self, name: str, t0: float, t1: float, cat: str = "step", **args) -> None:
        """Span `name` from perf_counter `t0` to `t1`, if the current step is recorded."""
        if self.on:
            self._append(name, t0, t1, cat, {**self.label, **args})

    def record(self, name: str, t0: float, t1: float, cat: str, **args) -> None:
        """Span `name` outside steps (driver or shard work), whenever the tracer is on."""
        if self.every > 0:
            self._append(name, t0, t1, cat, args)

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "driver", **args) -> Iterator[dict]:
        """`with tracer.span("checkpoint"):` records the block; the yielded dict takes
        args known only at its end."""
        t0 = time.perf_counter()
        extra: dict = {}
        try:
            yield extra
        finally:
            self.record(name, t0, time.perf_counter(), cat, **args, **extra)

    def _append(self, name: str, t0: float, t1: float, cat: str, args: dict) -> None:
        self.events.append({"name": name, "cat": cat, "ph": "X", "ts": self.us(t0),
                            "dur": max((t1 - t0) * 1e6, 0.0), "pid": self.pid,
                            "tid": self.tid, "args": args})  # fmt: skip

    def take(self) -> list[dict]:
        """The spans recorded since the last call, after this process's and thread's names
        (Chrome trace metadata events); [] when nothing was recorded."""
        out, self.events = self.events, []
        if not out:
            return []
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "tid": self.tid,
                 "args": {"name": self.process_name()}},
                {"name": "thread_name", "ph": "M", "pid": self.pid, "tid": self.tid,
                 "args": {"name": self.name}}]  # fmt: skip
        return meta + out

    def process_name(self) -> str:
        return f"{self.process or self.name} (pid {self.pid})"


def trainer_step_spans(doc: dict) -> Iterator[tuple[str, dict]]:
    """(track name, span) of every training step's span on a trainer's track in `doc` (the
    what-if model and the run report read these)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "thread_name"}  # fmt: skip
    for e in doc["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") != "step" or e["args"].get("pass") != "train":
            continue
        name = names.get((e["pid"], e["tid"]), "")
        if name.startswith("trainer"):
            yield name, e


def payload_bytes(obj) -> int:
    """Bytes of the tensors in `obj` (nested dicts, lists and tuples): what a message of it
    carries, for a span's args."""
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return obj.numel() * obj.element_size() if hasattr(obj, "element_size") else 0


def wall_us() -> float:
    """This process's wall clock in microseconds (what `clock_offset` asks a remote for)."""
    return time.time_ns() / 1e3


def clock_offset(remote_clock: Callable[[], float], samples: int = 5) -> tuple[float, float]:
    """(offset, error) in microseconds of a remote wall clock from this one: `remote_clock()`
    returns the remote `time.time_ns() / 1e3`; of `samples` round trips the shortest gives
    offset = remote - midpoint, within half its round trip."""
    best = None
    for _ in range(samples):
        t0 = wall_us()
        remote = remote_clock()
        t1 = wall_us()
        if best is None or t1 - t0 < best[1]:
            best = (remote - (t0 + t1) / 2, t1 - t0)
    return best[0], best[1] / 2


def shift(events: list[dict], offset_us: float) -> list[dict]:
    """`events` of a process whose clock is `offset_us` ahead of the driver's, on the
    driver's clock."""
    if offset_us:
        for e in events:
            if "ts" in e:
                e["ts"] -= offset_us
    return events


def keep_overlapping(events: list[dict], cat: str) -> list[dict]:
    """`events` without the spans of category `cat` (shard requests) that overlap no
    recorded trainer step (the requests of unrecorded steps)."""
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "step")  # fmt: skip
    if not steps:
        return [e for e in events if e.get("cat") != cat]
    import bisect

    starts = [s for s, _ in steps]
    ends = [e for _, e in steps]
    running, reach = 0.0, []  # the latest end among steps starting at or before each one
    for e in ends:
        running = max(running, e)
        reach.append(running)

    def overlaps(e: dict) -> bool:
        i = bisect.bisect_right(starts, e["ts"] + e["dur"]) - 1
        return i >= 0 and reach[i] >= e["ts"]

    return [e for e in events if e.get("cat") != cat or overlaps(e)]


def timeline_meta(config, group) -> dict:
    """What a trace file says about its run (its `otherData`): what the what-if model and
    the report need besides the spans."""
    c = config
    return {"run_name": c.run_name, "every": c.timeline, "model": c.model.name,
            "batch_size": c.train.batch_size, "trainers": group.num_trainers,
            "shards": group.num_shards, "backend": c.cluster.backend, "device": c.device,
            "threads": c.threads, "compression": c.comm.compression,
            "overlap": c.comm.overlap, "memory": group.memory_placement,
            "grad_values": group.grad_values(), "cpus": os.cpu_count(),
            "host": platform.node(), "clock": "unix time, microseconds"}  # fmt: skip


def trace_document(events: list[dict], meta: dict | None = None) -> dict:
    """A Chrome trace JSON object of `events` (the object form: Perfetto and
    chrome://tracing open it; `otherData` carries the run's facts)."""
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta or {}}


def validate(doc: dict) -> None:
    """Raise ValueError naming the first event of `doc` that is not a Chrome trace complete
    ("X") or metadata ("M") event as this module writes them."""
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise ValueError("trace: no traceEvents list")
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise ValueError(f"trace: event {i} is not an object: {e!r}")
        ph = e.get("ph")
        ok = isinstance(e.get("name"), str) and isinstance(e.get("pid"), int) and (
            isinstance(e.get("tid"), int)) and isinstance(e.get("args"), dict)  # fmt: skip
        if ph == "X":
            ok = ok and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (
                int, float)) and e["dur"] >= 0 and isinstance(e.get("cat"), str)  # fmt: skip
        elif ph != "M" or e.get("name") not in ("process_name", "thread_name"):
            ok = False
        if not ok:
            raise ValueError(f"trace: event {i} is not a complete or metadata event: {e}")


def read_trace(file: str) -> dict:
    """The trace document in `file`; one that is not (not UTF-8, not JSON, not this module's
    format): ValueError naming it."""
    try:
        with open(file, encoding="utf-8") as f:
            doc = json.load(f)
        validate(doc)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{file}: not a trace file ({e})") from None
    return doc


def load_trace(path: str) -> dict:
    """The merged trace of run directory `path` (its `timeline/*.json`, in order): one
    document whose `otherData` is the first part's. A file that is not a trace: ValueError
    naming it."""
    directory = os.path.join(path, "timeline")
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no timeline/ (run with --timeline to record one)"
        ) from None
    if not names:
        raise FileNotFoundError(f"{directory}: no trace files (run with --timeline)")
    events, meta, seen = [], None, set()
    for name in names:
        doc = read_trace(os.path.join(directory, name))
        meta = doc.get("otherData", {}) if meta is None else meta
        for e in doc["traceEvents"]:
            if e.get("ph") == "M":  # names repeat in every part: keep each once
                key = (e["name"], e["pid"], e.get("tid"), json.dumps(e.get("args")))
                if key in seen:
                    continue
                seen.add(key)
            events.append(e)
    return trace_document(events, meta)
