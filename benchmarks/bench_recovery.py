"""Trainer failure on Ray (issue 13): detection, replica recovery, and the checkpoint-restart
baseline, on one run (TGN, W = 2 trainers, P = 2 shards, whole-pass tasks).

Scenarios, each a whole continual run compared with a fault-free run of the same config:
- `kill`: trainer 1's process SIGKILLed from outside (`os.kill` of its pid) mid training pass;
- `allreduce`: the fault knob kills trainer 1 inside its all-reduce (`cluster.faults`);
- `forward`, `after_step`: the knob at the other two points of a step;
- `kill_spare`, `allreduce_spare`: `kill` (once the spare is up) and the all-reduce knob
  (at --spare-fault-step) with `cluster.spare_trainers: 1`, a trainer started ahead that
  takes the lost rank without a process start;
- `hang`: trainer 1 SIGSTOPped mid-pass, with `cluster.collective_timeout_s` = --hang-timeout
  and `RayGroup.probe_s` = --probe-s (the stopped process is killed by `recover`, or at the
  end by this script, never left stopped);
- `restart`: the baseline (Ray Train / TorchElastic): both trainers killed by the knob, the
  `Orchestrator` restarts the whole group from its newest checkpoint (`RunDir`); its teardown,
  new group start and checkpoint load are timed on that real path; recomputing the steps since
  a checkpoint every 100 steps is the measured seconds per training step x the steps since
  a seeded uniformly random failure step;
- `logging`, `logging_toggled`: the failure-free cost of the update log at every step, as
  back-to-back runs with it off and on (--log-pairs pairs), or switched at every training
  pass of two runs;
- `node`: a `ray.cluster_utils.Cluster` on loopback (head + 3 one-CPU worker nodes, a two-CPU
  node); the node holding trainer 1 (a one-CPU node, without trainer 0) is removed.

Times: the kill is stamped just before `os.kill` (outside) or by a 1 ms poller of the pid's
/proc entry (knob: when the process is gone or a zombie); detection is the driver entering
`RayGroup.recover` (wrapped here, the code is unchanged); `recover`'s own `seconds` includes
its probe of the trainers, reported apart.

    python benchmarks/bench_recovery.py --max-events 20000 --batch-size 200
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on loopback
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import ray  # noqa: E402
import torch  # noqa: E402
from common import machine, write_json  # noqa: E402

from tidegraph.orchestrator import Orchestrator, RunState, make_group  # noqa: E402
from tidegraph.orchestrator.ray_group import RayGroup  # noqa: E402
from tidegraph.orchestrator.rundir import RunDir  # noqa: E402
from tidegraph.runtime import set_determinism  # noqa: E402
from tidegraph.training import ContinualLearner, RunConfig, load_stream  # noqa: E402

SCENARIOS = (
    "kill",
    "kill_spare",
    "allreduce",
    "allreduce_spare",
    "forward",
    "after_step",
    "hang",
    "restart",
    "replay",
    "logging",
    "logging_toggled",
    "node",
)
MARKS: dict = {}  # what the wrappers below saw during the current run


def _mark(key: str, value) -> None:
    MARKS.setdefault(key, []).append(value)


# the timed parts of a trainer recovery (after the probes)
PARTS = ("replacement_up", "_refresh", "_connect")


def _timed(cls, name: str, key: str):
    """Wrap `cls.name` to record (start, seconds) of each call in MARKS[key]."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            _mark(key, (t0, time.perf_counter() - t0))

    setattr(cls, name, wrapper)


def _instrument() -> None:
    train_pass = RayGroup.train_pass

    def timed_pass(self, batches, progress=None):
        MARKS.setdefault("pass_started", threading.Event())
        _mark("pass_start", (time.perf_counter(), len(batches)))
        MARKS["pass_started"].set()
        t0 = time.perf_counter()
        out = train_pass(self, batches, progress)
        _mark("train_pass", (t0, time.perf_counter() - t0, len(batches)))
        return out

    RayGroup.train_pass = timed_pass
    recover = RayGroup.recover

    def timed_recover(self, cause):
        _mark("recover_enter", (time.perf_counter(), type(cause).__name__, str(cause)[:300]))
        return recover(self, cause)

    RayGroup.recover = timed_recover
    _timed(RayGroup, "_probe", "probe")
    _timed(RayGroup, "_probe_shards", "probe_shards")
    _timed(RayGroup, "__init__", "group_start")
    for name in ("_wait_placed", "_start", "_refresh", "_connect"):
        _timed(RayGroup, name, name)
    replacement = RayGroup._replacement

    def timed_replacement(self, *args, **kwargs):
        """A lost rank's replacement, timed until it is up: its slot placed, its process
        started and its constructor run (or a spare taking the rank). The code waits for
        the constructor later, in the replica copy; waiting here first moves that wait,
        not its length, into this mark."""
        t0 = time.perf_counter()
        got = replacement(self, *args, **kwargs)
        if got is not None:
            ray.get(got[0].__ray_ready__.remote())
        _mark("replacement_up", (t0, time.perf_counter() - t0))
        return got

    RayGroup._replacement = timed_replacement
    _timed(RayGroup, "shutdown", "group_shutdown")
    _timed(RunDir, "load_checkpoint", "checkpoint_read")
    _timed(RunDir, "save_checkpoint", "checkpoint_write")
    _timed(ContinualLearner, "load_state_dict", "state_load")
    _timed(Orchestrator, "_restart", "orchestrator_restart")


def config(args, faults=(), **cluster) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"name": "tgn"},
        "data": {"dataset": args.dataset, "max_events": args.max_events},
        "train": {"batch_size": args.batch_size},
        "cluster": {"backend": "ray", "shards": 2, "trainers": 2, "faults": list(faults),
                    **cluster},
        "progress": False, "out_dir": None, "threads": 1, "seed": 0,
        "run_name": "bench-recovery",
    })  # fmt: skip


def run(cfg: RunConfig, stream, during=None, update_log: str | None = None) -> dict:
    """A whole run; `during(learner, stop)` runs in a thread from when the group is up;
    `update_log`: a directory trainer 0 writes the update log to (`update_log_every`)."""
    MARKS.clear()
    MARKS["pass_started"] = threading.Event()
    set_determinism(cfg.seed, threads=1)
    t0 = time.perf_counter()
    learner = ContinualLearner(cfg, stream, make_group)
    if update_log is not None:
        learner.group.set_update_log(update_log, cfg.cluster.update_log_every, ())
    stop = threading.Event()
    thread = None
    if during is not None:
        thread = threading.Thread(target=during, args=(learner, stop), daemon=True)
        thread.start()
    try:
        learner.run_phase1()
        while not learner.done:
            learner.step()
        wall = time.perf_counter() - t0
        seconds = learner.group.take_seconds()
        return {
            "wall": wall,
            "model": learner.group.model_state(),
            "steps": learner.cursor.step,
            "trainer_steps": learner.group._all("__getattribute__", "steps"),
            "recoveries": list(learner.group.recoveries),
            "seconds": seconds,
            "marks": {k: v for k, v in MARKS.items() if k != "pass_started"},
            "history": learner.history,
        }
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=120)
        learner.group.shutdown()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_pass(stop, index: int) -> bool:
    """Until the `index`-th training pass (from 0) has started; False if the run ended."""
    while not stop.is_set():
        if len(MARKS.get("pass_start", [])) > index:
            return True
        time.sleep(0.002)
    return False


def outside(sig: int, pass_index: int, delay: float, rank: int = 1):
    """A `during`: signal trainer `rank`'s process `delay` s into training pass `pass_index`.
    A SIGSTOPped process still there when the run ends is continued and killed."""

    def during(learner, stop) -> None:
        pid = ray.get(learner.group.trainers[rank].pid.remote())
        _wait_spares(learner.group, stop)
        if not _wait_pass(stop, pass_index):
            return
        time.sleep(delay)
        MARKS["kill"] = time.perf_counter()
        MARKS["pid"] = pid
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            while not stop.is_set() and not _gone(pid):
                time.sleep(0.01)
            MARKS["stopped_gone"] = time.perf_counter()
            if not _gone(pid):  # recover did not kill it: never leave it stopped
                MARKS["left_stopped"] = True
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)

    return during


def _wait_spares(group, stop) -> None:
    """Until the group's spare trainers (`cluster.spare_trainers`) are up (none: at once)."""
    want = group.config.cluster.spare_trainers
    while not stop.is_set():
        refs = [j[2] for j in list(group.joiners.values())]
        if len(refs) >= want and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(
            refs
        ):
            MARKS["spares_up"] = time.perf_counter()
            return
        time.sleep(0.005)


def poll_death(rank: int = 1):
    """A `during`: stamp when trainer `rank`'s process dies (1 ms polls of /proc)."""

    def during(learner, stop) -> None:
        pid = ray.get(learner.group.trainers[rank].pid.remote())
        while not stop.is_set():
            if _gone(pid):
                MARKS["kill"] = time.perf_counter()
                return
            time.sleep(0.001)

    return during


def same_run(got: dict, want: dict) -> dict:
    model = got["model"].keys() == want["model"].keys() and all(
        torch.equal(got["model"][k], v) for k, v in want["model"].items()
    )
    return {
        "bitwise_equal": bool(model),
        "steps": got["steps"],
        "trainer_steps": got["trainer_steps"],
        "fault_free_steps": want["steps"],
        "metrics_equal": [h.get("ap") for h in got["history"]]
        == [h.get("ap") for h in want["history"]],
    }


def summarize(name: str, got: dict, base: dict, step_s: float) -> dict:
    marks = got["marks"]
    row = {"scenario": name, "recoveries": len(got["recoveries"]), **same_run(got, base)}
    row["extra_wall_s"] = got["wall"] - base["wall"]
    if got["recoveries"]:
        rec = got["recoveries"][0]
        enter = marks["recover_enter"][0]
        probe = marks["probe"][0][1]
        row.update(
            lost=rec["lost"], source=rec["source"], steps_done=rec["steps_done"],
            cause=rec["cause"], cause_text=enter[2], recover_s=rec["seconds"], probe_s=probe,
            probe_shards_s=marks["probe_shards"][0][1], generation=rec["generation"],
            resume_after_probe_s=rec["seconds"] - probe - marks["probe_shards"][0][1],
        )  # fmt: skip
        t_in = enter[0]
        first = lambda key: next(x[1] for x in marks[key] if x[0] >= t_in)  # noqa: E731
        # the replacement up (slot, process, constructor), the others' tables refreshed, the
        # new gloo group; the rest is the survivors' reports and the state copy
        parts = {k: first(k) if any(x[0] >= t_in for x in marks.get(k, [])) else 0.0
                 for k in PARTS}  # fmt: skip
        row["spares_used"] = rec.get("spares_used", [])
        parts["reports_and_copy"] = row["resume_after_probe_s"] - sum(parts.values())
        row["recover_parts_s"] = parts
        if "kill" in marks:
            row["detect_s"] = enter[0] - marks["kill"]
            row["detect_incl_probe_s"] = row["detect_s"] + probe
            # lost: detection, recovery, and the failed step's partial work (< 1 step)
            row["time_lost_s"] = row["detect_s"] + rec["seconds"] + step_s
    row["left_stopped"] = bool(marks.get("left_stopped"))
    return row


def step_seconds(got: dict) -> tuple[float, float]:
    """Seconds per training step and events/s over the run's training passes."""
    passes = got["marks"]["train_pass"]
    seconds = sum(p[1] for p in passes)
    steps = sum(p[2] for p in passes)
    return seconds / steps, steps


def scenario_restart(args, stream, base: dict, step_s: float, log_every: int = 0) -> dict:
    """Both trainers lost late in the run: the `Orchestrator` restarts the whole group from
    its newest checkpoint. Timed on that path: teardown of the old group, start of the new
    one, checkpoint read and load; recomputation is computed for a 100-step interval. With
    `log_every` (the update log), checkpoints are taken after phase 1 only, so the restart
    replays the logged steps of every increment up to the failure: their replay seconds are
    measured against the computed steps' seconds."""
    late = base["steps"] - args.restart_back
    cfg = config(args, [{"trainer": w, "step": late, "at": "forward"} for w in (0, 1)],
                 update_log_every=log_every)  # fmt: skip
    cfg.checkpoint_every = 1000 if log_every else 1
    MARKS.clear()
    MARKS["pass_started"] = threading.Event()
    set_determinism(cfg.seed, threads=1)
    with tempfile.TemporaryDirectory() as tmp:
        orch = Orchestrator(cfg, stream, run_dir=RunDir(tmp, "restart"))
        t0 = time.perf_counter()
        try:
            running_again = None
            while True:
                state = orch.step()
                if state in (RunState.FINISHED, RunState.ERRORED):
                    break
                if orch.restarts and running_again is None and state is RunState.RUNNING:
                    running_again = time.perf_counter()
            wall = time.perf_counter() - t0
            if orch.state is not RunState.FINISHED:
                raise RuntimeError(f"restart run failed: {orch.error!r}")
            learner = orch.learner
            got = {"model": learner.group.model_state(), "steps": learner.cursor.step,
                   "trainer_steps": learner.group._all("__getattribute__", "steps"),
                   "history": learner.history}  # fmt: skip
            records = list(Path(tmp).rglob("updates/step-*.pt"))
            replay = learner.group.replay_stats() if log_every else {}
            plan = list(orch.replay_plan)
            ckpts_found = [p for p in Path(tmp).rglob("*.pt") if p not in records]
            ckpt_bytes = sum(p.stat().st_size for p in ckpts_found)
            ckpts = len(ckpts_found)
            record_bytes = sum(p.stat().st_size for p in records) / max(len(records), 1)
        finally:
            orch.close()
    m = MARKS
    restart_t = m["orchestrator_restart"][0][0]
    after = lambda key: [x for x in m[key] if x[0] >= restart_t]  # noqa: E731
    teardown = after("group_shutdown")[0][1]
    first_start = m["group_start"][0][1]
    parts = {k: after(k)[0][1] for k in ("_wait_placed", "_start", "_connect")}
    start = after("group_start")[0][1]
    read = after("checkpoint_read")[0][1]
    load = after("state_load")[0][1]
    rng = random.Random(args.seed)
    draws = [rng.randrange(args.interval) for _ in range(args.draws)]
    recompute = [k * step_s for k in draws]
    fixed = teardown + start + read + load
    logged = {}
    if log_every:
        per_step = replay["replay_s"] / max(replay["replayed"], 1)
        logged = {
            "update_log_every": log_every, "replay_plan_steps": len(plan),
            "replayed": replay["replayed"], "replay_s": replay["replay_s"],
            "replay_s_per_step": per_step, "computed_s_per_step": step_s,
            "replay_speedup": step_s / per_step if per_step else None,
            "record_bytes": record_bytes, "records": len(records),
            "recompute_same_steps_s": len(plan) * step_s,
        }  # fmt: skip
    return {
        "scenario": f"replay_k{log_every}" if log_every else "restart", **logged,
        **same_run(got, base), "wall_s": wall,
        "extra_wall_s": wall - base["wall"], "restarts": orch.restarts,
        "teardown_s": teardown, "group_start_s": start, "checkpoint_read_s": read,
        "state_load_s": load, "restart_fixed_s": fixed, "group_start_parts_s": parts,
        "first_group_start_s": first_start,
        "restart_to_running_s": running_again - restart_t if running_again else None,
        "recover_probe_s": m["probe"][0][1], "checkpoint_bytes": ckpt_bytes // max(ckpts, 1),
        "checkpoint_write_s": statistics.median(x[1] for x in m["checkpoint_write"]),
        "interval_steps": args.interval, "failure_steps": draws,
        "recompute_s": recompute, "expected_recompute_s": (args.interval - 1) / 2 * step_s,
        "time_lost_s": [fixed + r for r in recompute],
        "expected_time_lost_s": fixed + (args.interval - 1) / 2 * step_s,
    }  # fmt: skip


def scenario_node(args, stream) -> dict:
    """A Cluster on loopback; remove the worker node that holds trainer 1 (not trainer 0's)."""
    from tidegraph.orchestrator.cluster import loopback_cluster

    # three 1-CPU workers, and a 2-CPU one: a free slot to replace on
    cluster, workers = loopback_cluster([1, 1, 1, 2], "bench-recovery-node")
    nodes = workers[:3]
    out: dict = {"scenario": "node"}
    try:
        by_id = {n.node_id: n for n in nodes}
        cfg = config(args)
        cfg.run_name = "bench-recovery-node"

        def during(learner, stop) -> None:
            placement = learner.group.placement()
            out["placement"] = {k: v[:8] for k, v in placement.items()}
            t1 = placement["tidegraph-trainer-1"]
            if t1 not in by_id or t1 == placement["tidegraph-trainer-0"]:
                out["skipped"] = "trainer 1 is not alone on a worker node"
                return
            out["shards_on_node"] = [k for k, v in placement.items() if v == t1 and "shard" in k]
            if not _wait_pass(stop, args.pass_index):
                return
            time.sleep(args.delay)
            MARKS["kill"] = time.perf_counter()
            cluster.remove_node(by_id[t1], allow_graceful=False)
            MARKS["removed"] = time.perf_counter()

        t0 = time.perf_counter()
        try:
            got = run(cfg, stream, during)
            out.update(finished=True, wall_s=time.perf_counter() - t0,
                       recoveries=got["recoveries"], steps=got["steps"],
                       trainer_steps=got["trainer_steps"], model=got["model"])  # fmt: skip
            m = got["marks"]
        except Exception as exc:  # report it: replacing on a dead node may not work yet
            import traceback

            out.update(finished=False, error=f"{type(exc).__name__}: {exc}"[:2000],
                       traceback=traceback.format_exc()[-4000:])  # fmt: skip
            m = dict(MARKS)
        if "kill" in m:
            out["remove_node_call_s"] = m["removed"] - m["kill"]
            if m.get("recover_enter"):
                out["detect_s"] = m["recover_enter"][0][0] - m["kill"]
                out["cause_text"] = m["recover_enter"][0][2]
            if m.get("probe"):
                out["probe_s"] = m["probe"][0][1]
                out["probe_shards_s"] = m.get("probe_shards", [(0, None)])[0][1]
                out["probe_limit_s"] = RayGroup.probe_s
                enters = m["recover_enter"]  # more than one: a failure during recovery
                out["recover_attempts"] = len(enters)
                out["detect_to_resume_s"] = (
                    enters[-1][0] + out["recoveries"][-1]["seconds"] - enters[0][0]
                    if out.get("recoveries") else None
                )  # fmt: skip
                t_in = m["recover_enter"][0][0]
                out["recover_parts_s"] = {
                    k: next((x[1] for x in m.get(k, []) if x[0] >= t_in), None) for k in PARTS
                }  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def scenario_logging(args, stream, step_s: float) -> dict:
    """Seconds per training step with the update log written at every step, in --log-pairs
    back-to-back pairs with the log off (the first pair's off run is the fault-free run
    before it; later pairs alternate which goes first), each with the load average."""
    pairs = []
    off_s = step_s
    for i in range(args.log_pairs):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        load = os.getloadavg()[0]
        for what in order[1:] if i == 0 else order:
            if what == "off":
                off_s, _ = step_seconds(run(config(args), stream))
                continue
            with tempfile.TemporaryDirectory() as tmp:
                got = run(config(args, update_log_every=1), stream, update_log=tmp)
            on_s, _ = step_seconds(got)
        pair = {"off_s_per_step": off_s, "on_s_per_step": on_s, "overhead": on_s / off_s - 1,
                "load_before": load, "load_after": os.getloadavg()[0]}  # fmt: skip
        print("logging pair", i + 1, pair)
        pairs.append(pair)
    overheads = sorted(p["overhead"] for p in pairs)
    return {"scenario": "logging", "pairs": pairs, "median_overhead": statistics.median(overheads),
            "train_events_per_s": args.batch_size / pairs[-1]["on_s_per_step"]}  # fmt: skip


def scenario_logging_toggled(args, stream) -> dict:
    """The update log switched on and off at every training pass of one run (so load that
    drifts over minutes hits both alike), in two runs, the first starting with it on and the
    second with it off. An on pass is timed to the end of its last record's write (the log
    is closed, flushing its queue, inside the timing)."""
    train_pass = RayGroup.train_pass
    passes, runs = [], []
    for first_on in (True, False):
        state = {"on": first_on}
        with tempfile.TemporaryDirectory() as tmp:

            def toggled(self, batches, progress=None, state=state, tmp=tmp):
                on, state["on"] = state["on"], not state["on"]
                self.set_update_log(tmp if on else None, 1, ())
                t0 = time.perf_counter()
                out = train_pass(self, batches, progress)
                if on:
                    self.set_update_log(None, 1, ())
                passes.append((on, time.perf_counter() - t0, len(batches)))
                return out

            RayGroup.train_pass = toggled
            load = os.getloadavg()[0]
            try:
                run(config(args), stream)
            finally:
                RayGroup.train_pass = train_pass
            runs.append({"first_on": first_on, "load_before": load,
                         "load_after": os.getloadavg()[0]})  # fmt: skip
    per_step = {
        on: sum(s for o, s, _ in passes if o == on) / sum(n for o, _, n in passes if o == on)
        for on in (True, False)
    }
    return {"scenario": "logging_toggled", "runs": runs, "passes": len(passes),
            "on_s_per_step": per_step[True], "off_s_per_step": per_step[False],
            "overhead": per_step[True] / per_step[False] - 1}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--max-events", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--pass-index", type=int, default=1, help="training pass the kill hits")
    p.add_argument("--delay", type=float, default=0.3, help="seconds into that pass")
    p.add_argument("--fault-step", type=int, default=40, help="knob: global step of the fault")
    p.add_argument(
        "--spare-fault-step",
        type=int,
        default=90,
        help="knob with a spare: a step late enough for the spare to be up",
    )
    p.add_argument("--hang-timeout", type=float, default=5.0)
    p.add_argument("--probe-s", type=float, default=2.0, help="RayGroup.probe_s when hung")
    p.add_argument("--interval", type=int, default=100, help="baseline checkpoint interval")
    p.add_argument("--draws", type=int, default=5, help="seeded failure steps in it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart-back", type=int, default=3, help="baseline: steps before end")
    p.add_argument("--log-pairs", type=int, default=3, help="`logging`: off/on run pairs")
    p.add_argument(
        "--replay-every", default="1,4", help="`replay` scenario: update-log intervals k to measure"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    _instrument()
    todo = args.scenarios.split(",")
    stream = load_stream(args.dataset, args.max_events)
    # address "local": a new Ray of our own, even when others run on this machine
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=8,
             include_dashboard=False, configure_logging=False)  # fmt: skip
    rows = []
    try:
        base = run(config(args), stream)
        step_s, steps = step_seconds(base)
        sec = base["seconds"]
        ms = {k: statistics.mean(s.get(k, 0.0) for s in sec) / steps * 1e3
              for k in sorted(sec[0])}  # fmt: skip
        free = {"scenario": "fault-free", "wall_s": base["wall"], "steps": base["steps"],
                "train_steps_timed": steps, "s_per_step": step_s,
                "train_events_per_s": args.batch_size / step_s, "ms_per_step": ms}  # fmt: skip
        print(free, "load average", os.getloadavg())
        rows.append(free)
        save(args, rows)
        knob = lambda at: [{"trainer": 1, "step": args.fault_step, "at": at}]  # noqa: E731
        for name in todo:
            if name == "kill":
                got = run(config(args), stream, outside(signal.SIGKILL, args.pass_index,
                                                        args.delay))  # fmt: skip
            elif name == "kill_spare":  # a spare trainer started ahead takes the rank
                got = run(config(args, spare_trainers=1), stream,
                          outside(signal.SIGKILL, args.pass_index, args.delay))  # fmt: skip
            elif name in ("allreduce", "forward", "after_step"):
                got = run(config(args, knob(name)), stream, poll_death())
            elif name == "allreduce_spare":
                late = [{"trainer": 1, "step": args.spare_fault_step, "at": "allreduce"}]
                got = run(config(args, late, spare_trainers=1), stream, poll_death())
            elif name == "hang":
                default = RayGroup.probe_s
                RayGroup.probe_s = args.probe_s
                try:
                    cfg = config(args, collective_timeout_s=args.hang_timeout)
                    got = run(cfg, stream, outside(signal.SIGSTOP, args.pass_index,
                                                   args.delay))  # fmt: skip
                finally:
                    RayGroup.probe_s = default
            else:
                continue
            row = summarize(name, got, base, step_s)
            print(row)
            rows.append(row)
            save(args, rows)
        if "restart" in todo:
            row = scenario_restart(args, stream, base, step_s)
            print(row)
            rows.append(row)
            save(args, rows)
        for k in (int(x) for x in args.replay_every.split(",") if x) if "replay" in todo else ():
            row = scenario_restart(args, stream, base, step_s, log_every=k)
            print(row)
            rows.append(row)
            save(args, rows)
        if "logging" in todo:  # failure-free overhead of writing the update log
            row = scenario_logging(args, stream, step_s)
            print(row)
            rows.append(row)
            save(args, rows)
        if "logging_toggled" in todo:
            row = scenario_logging_toggled(args, stream)
            print(row)
            rows.append(row)
            save(args, rows)
        if "node" in todo:
            row = scenario_node(args, stream)
            if "model" in row:
                row.update(same_run({**row, "history": [], "model": row.pop("model")},
                                    {**base, "history": []}))  # fmt: skip
            print(row)
            rows.append(row)
    finally:
        ray.shutdown()
    print(machine(), "load average at the end", os.getloadavg())
    save(args, rows)


def save(args, rows: list) -> None:
    """Written after each scenario, so results survive a later hang or timeout."""
    import subprocess

    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout  # noqa: E731
    code = {"head": git("rev-parse", "HEAD").strip(),
            "dirty": git("status", "--short", "tidegraph").split()}  # fmt: skip
    name = f"recovery_{args.dataset}_{args.max_events}_{'-'.join(args.scenarios.split(','))}.json"
    write_json(name, {"args": vars(args), "load_avg": os.getloadavg(), "code": code,
                      "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
