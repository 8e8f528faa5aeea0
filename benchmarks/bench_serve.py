"""Serving a run (`tidegraph.serving`) on Ray Serve: latency, queries/s and freshness.

1. A run to serve: the README's default job on the local backend (Wikipedia, TGN, phase 1 and
   10 increments; `--max-events` for less), trained once into `--storage` and reused.
2. Load: a local Ray on 127.0.0.1, Ray Serve on a loopback port, 1 and 2 replicas (one CPU and
   one torch thread each); for each of /score with batches of 1 and 200 pairs and /topk with
   k = 10 over every destination seen (and GET /status, Ray Serve's HTTP path without model
   work), `--requests` requests from each of `--clients`
   concurrent clients (one keep-alive connection each; bounded): latency p50/p99 and
   queries/s (requests per wall second; pairs per second for batches). The same requests are
   first answered in this process by the replica's handlers (the model's share of latency).
3. Freshness: a second training run (local backend, `--fresh-events` events in 10 increments)
   beside one replica that polls every `--poll-s`: for each log file the run writes, the time
   from the file's appearance (this script polls the log every 20 ms) to /status reporting it
   applied; and /score latency (one client) while the run trains.

    python benchmarks/bench_serve.py [--max-events N] [--requests 200] [--clients 1 4]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from common import machine, write_json  # noqa: E402

from tidegraph.serving.engine import RunSource, ServedState  # noqa: E402

TRAIN = [sys.executable, "-m", "tidegraph.jobs.train", "--backend", "local", "--no-progress",
         "--metrics-port", "-1"]  # fmt: skip


def _train(storage: Path, name: str, extra: list[str], wait: bool = True):
    cmd = [*TRAIN, "--storage", str(storage), "--run-name", name, *extra]
    log = (storage / f"{name}.log").open("w")
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    if wait and job.wait() != 0:
        raise SystemExit(f"training {name} failed: see {storage / (name + '.log')}")
    return job


class Client:
    """One keep-alive HTTP connection to the server."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def call(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body)
        self.conn.request("POST" if data else "GET", path, data,
                          {"Content-Type": "application/json"})  # fmt: skip
        answer = self.conn.getresponse()
        return answer.status, json.loads(answer.read())


def _load(port: int, bodies: list[tuple[str, dict]], clients: int) -> dict:
    """Every client sends all of `bodies` (path, body); latencies and queries/s."""
    lat: list[float] = []
    failed = []
    lock = threading.Lock()

    def run() -> None:
        c = Client(port)
        mine = []
        for path, body in bodies:
            t0 = time.perf_counter()
            status, answer = c.call(path, body)
            mine.append(time.perf_counter() - t0)
            if status != 200:
                failed.append(answer)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=run) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0]}")
    return {"requests": len(lat), "clients": clients, "wall_s": wall, "qps": len(lat) / wall,
            **_percentiles(lat)}  # fmt: skip


def _percentiles(lat: list[float]) -> dict:
    lat = sorted(lat)
    at = lambda q: 1e3 * lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    return {"p50_ms": at(0.5), "p99_ms": at(0.99), "mean_ms": 1e3 * statistics.fmean(lat)}


def _bodies(state: ServedState, kind: str, n: int, seed: int = 0) -> list[tuple[str, dict | None]]:
    rng = random.Random(seed)
    ev = state.source.events.read(max(0, state.offset - 20_000), state.offset)
    src, dst = ev.src.tolist(), ev.dst.tolist()
    t = state.last_t + 1.0
    out = []
    for _ in range(n):
        if kind == "status":  # no model work: Ray Serve's HTTP path alone
            out.append(("/status", None))
            continue
        if kind == "topk":
            out.append(("/topk", {"src": rng.choice(src), "t": t, "k": 10}))
            continue
        b = 1 if kind == "score1" else 200
        rows = [rng.randrange(len(src)) for _ in range(b)]
        out.append(("/score", {"src": [src[i] for i in rows],
                               "dst": [rng.choice(dst) for _ in rows], "t": t}))  # fmt: skip
    return out


def _in_process(state: ServedState, bodies: list[tuple[str, dict | None]]) -> dict:
    """The same requests answered by the replica's handlers in this process (one torch
    thread): the model's share of a request's latency, without Ray Serve's HTTP path."""
    import torch

    from tidegraph.serving.app import answer_score, answer_topk

    handlers = {"/score": answer_score, "/topk": answer_topk}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lat = []
    try:
        for path, body in bodies:
            t0 = time.perf_counter()
            if body is None:
                state.status()
            else:
                handlers[path](state, body)
            lat.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return _percentiles(lat)


def _deploy(name: str, storage: Path, replicas: int, poll_s: float) -> None:
    from ray import serve

    from tidegraph.serving.app import server_app

    serve.run(server_app(name, str(storage), poll_s=poll_s, replicas=replicas, num_cpus=1.0),
              name="tidegraph", route_prefix="/")  # fmt: skip


def _freshness(storage: Path, port: int, args) -> dict:
    """A run trains while one replica serves it: per log file, seconds from its appearance to
    being applied; /score latency meanwhile."""
    from ray import serve

    name = f"fresh-{int(time.time())}"
    job = _train(storage, name, ["--max-events", str(args.fresh_events), "--epochs", "1"],
                 wait=False)  # fmt: skip
    source = None
    for _ in range(6000):  # bounded: until phase 1's checkpoint
        try:
            source = source or RunSource(str(storage), name)
            if source.latest() is not None:
                break
        except ValueError:
            pass
        if job.poll() is not None:
            raise SystemExit(f"training {name} ended early")
        time.sleep(0.1)
    _deploy(name, storage, 1, args.poll_s)
    client = Client(port)
    seen: dict[int, float] = {}  # log file end -> when this script first saw it
    applied: dict[int, float] = {}
    lat = []
    body = None
    for _ in range(200_000):  # bounded: until the run ends and the server applied its log
        now = time.perf_counter()
        for _lo, hi, _ in source.events.files():
            seen.setdefault(hi, now)
        status, answer = client.call("/status")
        at = answer["applied_offset"]
        for hi in seen:
            if hi <= at and hi not in applied:
                applied[hi] = time.perf_counter()
        if body is None or body["t"] < answer["last_event_time"]:
            body = {"src": [1], "dst": [8300], "t": answer["last_event_time"] + 1e6}
        t0 = time.perf_counter()
        status, _ = client.call("/score", body)
        lat.append(time.perf_counter() - t0)
        if job.poll() is not None and answer["lag_events"] == 0 and len(applied) == len(seen):
            break
        time.sleep(0.02)
    serve.delete("tidegraph")
    base = min(seen)  # files before the server started count from then
    start = seen[min(seen)]
    lags = sorted(applied[hi] - max(seen[hi], start) for hi in applied if seen[hi] > start)
    during = {f"score_{k}": v for k, v in _percentiles(lat).items()}
    return {
        "run": name, "events": args.fresh_events, "files_after_start": len(lags),
        "lag_s_median": statistics.median(lags) if lags else None,
        "lag_s_max": max(lags) if lags else None, "lags_s": lags, "first_file_end": base,
        "score_requests": len(lat), **during,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--storage", default="benchmarks/out/serve_runs")
    p.add_argument("--max-events", type=int, default=None, help="of the served run")
    p.add_argument("--requests", type=int, default=200, help="per client and case")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--fresh-events", type=int, default=60_000)
    p.add_argument("--poll-s", type=float, default=0.2)
    p.add_argument("--no-freshness", action="store_true")
    args = p.parse_args()
    storage = Path(args.storage).absolute()
    storage.mkdir(parents=True, exist_ok=True)
    name = "wiki" if args.max_events is None else f"wiki-{args.max_events}"
    if not (storage / name / "checkpoints" / "latest").exists():
        t0 = time.perf_counter()
        extra = [] if args.max_events is None else ["--max-events", str(args.max_events)]
        _train(storage, name, extra)
        print(f"trained {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    state = ServedState(RunSource(str(storage), name))
    state.catch_up()
    alone = {}
    for kind in ("status", "score1", "score200", "topk"):
        _in_process(state, _bodies(state, kind, 10, 98))  # warm up
        alone[kind] = _in_process(state, _bodies(state, kind, args.requests))
        print(f"in process {kind:>8}: p50 {alone[kind]['p50_ms']:.1f} ms p99 "
              f"{alone[kind]['p99_ms']:.1f} ms", flush=True)  # fmt: skip

    import ray
    from ray import serve

    ray.init(_node_ip_address="127.0.0.1", num_cpus=max(4, max(args.replicas) + 2),
             include_dashboard=False, configure_logging=False)  # fmt: skip
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    try:
        for replicas in args.replicas:
            _deploy(name, storage, replicas, args.poll_s)
            _load(port, _bodies(state, "score1", 20, 99), 1)  # warm up
            for kind in ("status", "score1", "score200", "topk"):
                for clients in args.clients:
                    got = _load(port, _bodies(state, kind, args.requests), clients)
                    got.update(replicas=replicas, kind=kind)
                    if kind == "score200":
                        got["pairs_per_s"] = 200 * got["qps"]
                    rows.append(got)
                    print(f"replicas {replicas} {kind:>8} clients {clients}: p50 "
                          f"{got['p50_ms']:.1f} ms p99 {got['p99_ms']:.1f} ms "
                          f"{got['qps']:.1f} req/s", flush=True)  # fmt: skip
            serve.delete("tidegraph")
        fresh = None if args.no_freshness else _freshness(storage, port, args)
        if fresh and fresh["lags_s"]:
            print(f"freshness: {fresh['files_after_start']} log files, lag median "
                  f"{fresh['lag_s_median']:.2f} s max {fresh['lag_s_max']:.2f} s; /score "
                  f"during training p50 {fresh['score_p50_ms']:.1f} ms p99 "
                  f"{fresh['score_p99_ms']:.1f} ms", flush=True)  # fmt: skip
    finally:
        serve.shutdown()
        ray.shutdown()
    candidates = int(state.negatives.pool.numel())
    write_json("serve.json", {"machine": machine(), "run": name, "candidates": candidates,
                         "nodes": state.num_nodes, "in_process": alone, "load": rows,
                         "freshness": fresh})  # fmt: skip


if __name__ == "__main__":
    main()
