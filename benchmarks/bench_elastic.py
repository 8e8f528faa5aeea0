"""Elastic scaling on Ray (issue 16): a node joins mid-run and a trainer there joins the
group; later the node is drained and its trainer leaves; side by side with what Ray Train v2
and TorchElastic do on a membership change (stop the whole group, start it again at the new
size, load the latest checkpoint, repeat the steps since it).

Scenario: Ray nodes on this machine (loopback). The head has room for the run's 2 shards and
one trainer; `cluster.trainers: {min: 1, max: 2}`. At `--join-at` of the run's training
steps a worker node with one CPU is added: Ray places the run's pending slot there, a
trainer starts in it while the group trains, and joins at the next step boundary (a copy of
a replica, a new group generation). At `--drain-at` of the steps left after the join the
node is drained (Ray's DrainNode, as a spot preemption notice with a 30 s deadline): its
trainer leaves at the next step boundary, its slot is given back, and the node is removed.

Measured: node added -> slot placed -> trainer process up -> joined (-> its first gradient,
the next step); the group's pause for the join; training events/s of the increments run at
W = 1 before the join and at W = 2 after it; drain notice -> trainer gone -> no actor of the
run on the node. The baseline is timed on tidegraph's own path: the group's state written
as a checkpoint, the group shut down, a new group started at the new size, the checkpoint
read and loaded; repeating the steps since a checkpoint taken every `--interval` steps
costs interval / 2 steps on average (a change at a uniformly random step), at the measured
seconds per step. Ray Train v2 also only looks for new resources every 60 s (elastic
mode's poll), which is not added here.

With `--what shards` the same scenario grows and shrinks the shard actors instead:
`cluster.shards: {min: 1, max: 2}` (2 partitions) with one trainer, and a head with room for
one shard actor (`shard_cpus` 1), which holds both partitions; on the joined node a shard
actor starts and takes a partition over at a step boundary (its state copied and checked),
and on the drain notice the partition goes back to the head's actor. Measured: node added
-> partition moved (and the group's pause for the move), drain notice -> partition back ->
no actor of the run on the node, and training events/s with one actor and with two.

    python benchmarks/bench_elastic.py [--events 60000] [--what trainers|shards]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
import torch  # noqa: E402
from ray.core.generated import autoscaler_pb2  # noqa: E402

from tidegraph.orchestrator import make_group  # noqa: E402
from tidegraph.orchestrator.cluster import loopback_cluster, until  # noqa: E402
from tidegraph.orchestrator.ray_group import RayGroup  # noqa: E402
from tidegraph.runtime import set_determinism  # noqa: E402
from tidegraph.training import ContinualLearner, RunConfig, load_stream  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402


def config(args, trainers, shards=2) -> RunConfig:
    raw = {
        "model": {"name": "tgn"},
        "data": {"dataset": "wikipedia", "max_events": args.events},
        "train": {"batch_size": args.batch_size},
        "continual": {"num_increments": args.increments},
        "cluster": {"backend": "ray", "trainers": trainers, "shards": shards, "trainer_cpus": 1,
                    "shard_cpus": 0.5 if isinstance(shards, int) else 1.0,
                    "elastic_poll_s": 0.2},
        "progress": False, "out_dir": None, "seed": 0, "run_name": "bench-elastic",
    }  # fmt: skip
    return RunConfig.from_dict(raw)


def _until(check, timeout_s: float):
    """`check()`'s first truthy value, or None after `timeout_s` (the scenario goes on)."""
    try:
        return until(check, timeout_s, "the scenario", every_s=0.01)
    except TimeoutError:
        return None


def _node_actors(node_id: str, namespace: str) -> list:
    """Live actors of the run's namespace on `node_id` (from the GCS)."""
    from ray._private import state

    return [a for a in state.actors().values()
            if a["State"] == "ALIVE" and a["Address"]["NodeID"] == node_id
            and a.get("RayNamespace") == namespace]  # fmt: skip


def scenario(args, cluster, stream) -> dict:
    """The elastic run: join at `join_at`, drain at `drain_at` of the training steps."""
    shards = args.what == "shards"
    if shards:
        cfg = config(args, 1, {"min": 1, "max": 2})
    else:
        cfg = config(args, {"min": 1, "max": 2})
    marks: dict = {}

    def during(learner) -> None:
        group = learner.group
        steps = sum(u.kind == "train" for u in learner.schedule.units)
        _until(lambda: learner.cursor.step >= args.join_at * steps, 600)
        marks["join_step"] = learner.cursor.step
        t0 = time.monotonic()
        node = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        marks["node_added_s"] = time.monotonic() - t0
        marks["t_node"] = time.time()
        pending = (lambda: [pg for pg, _ in group.shard_spares]) if shards else \
            (lambda: list(group.spares))  # fmt: skip
        slot = _until(lambda: [s for s in pending()
                               if ray.util.placement_group_table(s)["state"] == "CREATED"]
                      or (shards and group.shard_joiners), 60)  # fmt: skip
        marks["slot_placed_s"] = time.time() - marks["t_node"] if slot else None
        changes = (lambda: group.shard_resizes) if shards else (lambda: group.resizes)
        grow = _until(lambda: changes()[:1], 300)
        if not grow:
            return
        marks["grow"] = grow[0]
        at = marks["grow_step"] = learner.cursor.step  # drain after a share of the rest
        _until(lambda: learner.cursor.step >= at + args.drain_at * (steps - at), 600)
        marks["drain_step"] = learner.cursor.step
        gcs = ray._raylet.GcsClient(address=cluster.address)
        marks["t_drain"] = time.time()
        gcs.drain_node(
            node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "bench: spot preemption", int(time.time() * 1000) + 30_000,
        )  # fmt: skip
        shrink = _until(lambda: changes()[1:2], 60)
        if shrink:
            marks["shrink"] = shrink[0]
        free = _until(lambda: not _node_actors(node.node_id, cfg.run_name), 60)
        marks["node_free_s"] = time.time() - marks["t_drain"] if free is not None else None
        cluster.remove_node(node)

    set_determinism(cfg.seed, threads=1)
    learner = ContinualLearner(cfg, stream, make_group)
    done: dict = {}

    def train() -> None:  # in a thread: Ray's Cluster.add_node works in the main one only
        try:
            t0 = time.perf_counter()
            learner.run_phase1()
            while not learner.done:
                learner.step()
            done["wall_s"] = time.perf_counter() - t0
        except BaseException as exc:
            done["error"] = exc

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        during(learner)
        thread.join()
        if "error" in done:
            raise done["error"]
        out = {"wall_s": done["wall_s"], "steps": learner.cursor.step,
               "history": learner.history}  # fmt: skip
        out["baseline"] = restart_baseline(learner, cfg)
        return {**out, **marks}
    finally:
        thread.join(timeout=120)
        learner.group.shutdown()


def restart_baseline(learner, cfg) -> dict:
    """The group restarted at another size from a checkpoint, timed on tidegraph's path."""
    group = learner.group
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        t0 = time.perf_counter()
        torch.save(group.state_dict(), path)
        write = time.perf_counter() - t0
        t0 = time.perf_counter()
        group.shutdown()
        teardown = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh = RayGroup(config(args_global, 1), learner.num_nodes, learner.stream.edge_dim,
                         expected_nodes=learner.stream.num_nodes)  # fmt: skip
        start = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            fresh.load_state_dict(torch.load(path, weights_only=False))
            load = time.perf_counter() - t0
        finally:
            learner.group = fresh  # shut down by the caller
    return {"checkpoint_write_s": write, "teardown_s": teardown, "group_start_s": start,
            "checkpoint_load_s": load, "restart_s": teardown + start + load}  # fmt: skip


def rates(history: list, grow: dict | None, shrink: dict | None) -> dict:
    """Median training events/s of the increments run wholly at W = 1 before the join and
    wholly at W = 2 between the join and the drain (by when each record was made; an
    increment's retraining ends its record)."""
    w1, w2 = [], []
    t_grow = grow["time"] if grow else float("inf")
    t_shrink = shrink["time"] if shrink else float("inf")
    prev = 0.0
    for r in history:
        if r.get("phase") == "increment" and "train_events_per_s" in r:
            if r["_t"] < t_grow:
                w1.append(r["train_events_per_s"])
            elif prev > t_grow and r["_t"] < t_shrink:
                w2.append(r["train_events_per_s"])
        prev = r["_t"]
    return {"w1_train_ev_s": statistics.median(w1) if w1 else None,
            "w2_train_ev_s": statistics.median(w2) if w2 else None,
            "increments_w1": len(w1), "increments_w2": len(w2)}  # fmt: skip


args_global = None


def main() -> None:
    global args_global
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--events", type=int, default=60000)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--increments", type=int, default=10)
    p.add_argument("--join-at", type=float, default=0.2, help="fraction of training steps")
    p.add_argument(
        "--drain-at",
        type=float,
        default=0.6,
        help="fraction of the training steps left after the join",
    )
    p.add_argument("--interval", type=int, default=100, help="baseline checkpoint interval")
    p.add_argument("--what", choices=("trainers", "shards"), default="trainers",
                   help="grow and shrink the trainers or the shard actors")  # fmt: skip
    p.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = args_global = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    stream = load_stream("wikipedia", args.events)
    cluster, _ = loopback_cluster([], "bench-elastic", head_cpus=2)
    _stamp_records()
    try:
        got = scenario(args, cluster, stream)
    finally:
        ray.shutdown()
        cluster.shutdown()
    grow, shrink = got.get("grow"), got.get("shrink")
    step_s = got["wall_s"] / max(got["steps"], 1)  # wall time per training step, all in
    base = got["baseline"]
    speed = rates(got["history"], grow, shrink)
    train_step_s = args.batch_size / speed["w1_train_ev_s"] if speed["w1_train_ev_s"] else step_s
    lost_baseline = base["restart_s"] + args.interval / 2 * train_step_s
    row = {
        "machine": machine(), "date": time.strftime("%Y-%m-%d"), "events": args.events,
        "steps": got["steps"], "wall_s": got["wall_s"], "step_s": step_s,
        "join_step": got.get("join_step"), "grow_step": got.get("grow_step"),
        "drain_step": got.get("drain_step"),
        "node_added_s": got.get("node_added_s"), "slot_placed_s": got.get("slot_placed_s"),
        "node_to_joined_s": grow["time"] - got["t_node"] if grow else None,
        "join_pause_s": grow["seconds"] if grow else None,
        "drain_to_left_s": shrink["time"] - got["t_drain"] if shrink else None,
        "leave_pause_s": shrink["seconds"] if shrink else None,
        "drain_to_node_free_s": got.get("node_free_s"),
        **speed, "train_step_s_w1": train_step_s,
        "baseline": base, "baseline_interval": args.interval,
        "baseline_lost_s": lost_baseline,
        "resizes": [g for g in (grow, shrink) if g],
    }  # fmt: skip
    print(json.dumps({k: v for k, v in row.items() if k != "resizes"}, indent=2, default=str))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"elastic_{args.what}_wikipedia_{args.events}.json").write_text(
        json.dumps(row, indent=2, default=str)
    )


def _stamp_records() -> None:
    """Every learner record gets the wall time it was made at (`_t`), to split the rates."""
    original = ContinualLearner._log

    def stamped(self, record: dict) -> None:
        record["_t"] = time.time()
        original(self, record)

    ContinualLearner._log = stamped


if __name__ == "__main__":
    main()
