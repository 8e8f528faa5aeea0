"""The Ray Serve application that serves a run while it learns.

Each replica of `TidegraphServer` holds a `ServedState` of the run's newest checkpoint and a
thread that, every `poll_s` seconds, applies the events the durable log received since (one
log file per turn, so queries interleave) and, when the run has written a newer checkpoint,
loads it beside the one in use, brings it up to the log, and swaps it in: a request holds the
state it started with, so none is dropped or fails during a swap.

Routes (JSON; ids are the stream's external ids):
- `POST /score` `{"src": [...], "dst": [...], "t": [...] | number}` -> `{"scores": [...]}`;
- `POST /topk` `{"src": id, "t": number, "k": int, "candidates": [...]?}` -> `{"dst": [...],
  "scores": [...]}` (default candidates: every destination seen); with `"candidates": "tgb",
  "dst": id, "negatives": n?, "seed": s?`, TGB's protocol for the positive (src, dst, t): the
  candidates are dst and its hist_rnd negatives, and the answer adds `"rank"` (dst's, by TGB's
  rule) and `"negatives"` (how many were drawn);
- `POST /embed` `{"nodes": [...], "t": [...] | number}` -> `{"embeddings": [[...], ...]}`;
- `GET /status` -> the checkpoint served, the last event applied, the lag behind the log.
Every answer names the checkpoint and log offset it was computed at. A request that cannot
be answered gets HTTP 400 with `{"error": "FIELD: why"}`.

`build(args)` is the application builder `serve run` and `serve deploy` use:
`serve run tidegraph.serving.app:build run_name=R storage=runs` (see deploy/serve.yaml).
"""

import json
import logging
import os
import threading

import ray
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from starlette.concurrency import run_in_threadpool

from tidegraph.serving.engine import (
    ModelOutputError,
    QueryError,
    RunSource,
    ServedState,
    checked_run,
)
from tidegraph.serving.protocol import parse_embed, parse_score, parse_tgb, parse_topk

__all__ = ["TidegraphServer", "answer_embed", "answer_score", "answer_topk", "build", "server_app"]

log = logging.getLogger(__name__)

api = FastAPI(title="tidegraph")


def _locked(handler, state: ServedState, body) -> dict:
    """`handler`'s answer from `state` with no log event applied meanwhile (ids mapped, times
    checked and the answer computed at one offset, which it names)."""
    with state.lock:
        out = handler(state, body)
        out.update(checkpoint=state.tag, applied_offset=state.offset)
    return out


# the routes' answers from one state (also timed in process by benchmarks/bench_serve.py)
def answer_score(state: ServedState, body) -> dict:
    src, dst, t = parse_score(body)
    s, d = state.nodes(src, "src"), state.nodes(dst, "dst")
    return {"scores": state.score(s, d, state.times(t, len(src))).tolist()}


def answer_topk(state: ServedState, body) -> dict:
    src, t, k, candidates = parse_topk(body)
    s = state.nodes([src], "src")
    ts = state.times(t, 1)
    if candidates == "tgb":  # dst against TGB's hist_rnd negatives of it
        dst, negatives, seed = parse_tgb(body)
        d = state.nodes([dst], "dst")
        cand, logits, rank = state.tgb_rank(int(s[0]), int(d[0]), float(ts[0]), negatives, seed)
        if k > cand.numel():
            raise QueryError(f"k: {k} is more than the {cand.numel()} candidates (dst and its "
                             f"negatives)")  # fmt: skip
        best = torch.topk(logits, k)
        return {"dst": state.external(cand[best.indices]),
                "scores": torch.sigmoid(best.values).tolist(), "rank": rank,
                "negatives": cand.numel() - 1}  # fmt: skip
    if candidates is None:  # every destination seen
        best, scores = state.topk(int(s[0]), float(ts[0]), k)
        ids = state.external(state.negatives.pool[best])
    else:  # each distinct candidate once (new nodes share a dense id, not a place)
        named = list(dict.fromkeys(candidates))
        best, scores = state.topk(int(s[0]), float(ts[0]), k, state.nodes(named, "candidates"))
        ids = [named[i] for i in best.tolist()]
    return {"dst": ids, "scores": scores.tolist()}


def answer_embed(state: ServedState, body) -> dict:
    nodes, t = parse_embed(body)
    ids = state.nodes(nodes, "nodes")
    z = state.embed(ids, state.times(t, len(nodes)))
    return {"embeddings": z.tolist()}


# (the deployment is pickled when it is declared: what its methods call is defined above it)
@serve.deployment(name="tidegraph", ray_actor_options={"num_cpus": 1})
@serve.ingress(api)
class TidegraphServer:
    # (no `from __future__ import annotations` here: FastAPI reads the routes' annotations)
    def __init__(self, run_name: str, storage: str = "runs", poll_s: float = 1.0,
                 device: str = "cpu", threads: int = 1) -> None:  # fmt: skip
        import torch

        torch.set_num_threads(max(1, threads))
        self.source = RunSource(storage, run_name)
        self.state = ServedState(self.source, device=device)
        self.state.catch_up()
        self.device, self.poll_s = device, poll_s
        self.swaps = 0
        self.error = None  # the last refresh's failure (retried next turn)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh_loop, daemon=True,
                                        name="tidegraph-refresh")  # fmt: skip
        self._thread.start()

    # ---- keeping fresh ------------------------------------------------------------------------

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
                self.error = None
            except Exception as exc:  # a checkpoint deleted under us, storage hiccups: next turn
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("refresh failed (retried in %.1f s): %s", self.poll_s, self.error)

    def refresh(self) -> None:
        """Swap in a newer checkpoint (brought up to the log first; the newest again when the
        state in use failed to apply a log file), then apply one log file."""
        latest = self.source.latest()
        if latest is not None and (latest != self.state.tag or self.state.broken):
            fresh = ServedState(self.source, latest, self.device)
            fresh.catch_up()
            self.state, old = fresh, self.state  # requests under way keep the old one
            self.swaps += 1
            log.info("serving checkpoint %s (was %s)", latest, old.tag)
        self.state.catch_up(max_files=1)

    def __del__(self) -> None:
        self._stop.set()

    # ---- routes -------------------------------------------------------------------------------

    @api.post("/score")
    async def score(self, request: Request):
        return await self._answer(request, answer_score)

    @api.post("/topk")
    async def topk(self, request: Request):
        return await self._answer(request, answer_topk)

    @api.post("/embed")
    async def embed(self, request: Request):
        return await self._answer(request, answer_embed)

    @api.get("/status")
    def status(self) -> dict:
        out = self.state.status()
        out.update(swaps=self.swaps, refresh_error=self.error, replica_pid=os.getpid(),
                   replica_node=ray.get_runtime_context().get_node_id())  # fmt: skip
        return out

    async def _answer(self, request: Request, handler):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            return JSONResponse({"error": f"body: not JSON ({exc})"}, status_code=400)
        state = self.state  # the state this request is answered from, whatever swaps meanwhile
        try:
            return await run_in_threadpool(_locked, handler, state, body)
        except QueryError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except ModelOutputError as exc:
            log.error("%s (body %.200s)", exc, body)
            return JSONResponse({"error": str(exc)}, status_code=500)


def server_app(run_name: str, storage: str = "runs", poll_s: float = 1.0, device: str = "cpu",
               replicas: int | dict = 1, num_cpus: float = 1.0, num_gpus: float = 0.0,
               resources: dict | None = None, threads: int = 1):  # fmt: skip
    """The application serving `run_name` under `storage`: `replicas` a count, or Ray Serve's
    autoscaling config ({"min_replicas", "max_replicas", ...}); each replica asks Ray for
    `num_cpus`, `num_gpus` and custom `resources` (reserve serving nodes with them). A missing
    run, or one without a checkpoint, is a ValueError here, before anything starts."""
    storage = checked_run(storage, run_name)
    _check_poll(poll_s)
    actor = {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": dict(resources or {})}
    scaling = (
        {"autoscaling_config": replicas} if isinstance(replicas, dict) else
        {"num_replicas": replicas}
    )  # fmt: skip
    deployment = TidegraphServer.options(ray_actor_options=actor, **scaling)
    return deployment.bind(run_name, storage, poll_s, device, threads)


def build(args: dict):
    """`serve run tidegraph.serving.app:build run_name=R [storage=S poll_s=1 device=cpu]`
    (and `serve deploy` configs): the application, with replicas and their resources set by
    Serve's own deployment options in the config file."""
    known = {"run_name", "storage", "poll_s", "device", "threads"}
    unknown = set(args) - known
    if unknown or "run_name" not in args:
        raise ValueError(f"tidegraph serve app: arguments {sorted(known)} (run_name required), "
                         f"got {sorted(args)}")  # fmt: skip
    storage = checked_run(args.get("storage", "runs"), args["run_name"])
    _check_poll(float(args.get("poll_s", 1.0)))
    return TidegraphServer.bind(
        args["run_name"], storage, float(args.get("poll_s", 1.0)),
        args.get("device", "cpu"), int(args.get("threads", 1)),
    )  # fmt: skip


def _check_poll(poll_s: float) -> None:
    if not poll_s > 0:
        raise ValueError(f"serve: poll_s must be a positive number of seconds, got {poll_s!r}")
