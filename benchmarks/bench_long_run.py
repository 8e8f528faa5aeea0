"""A long followed run: what the driver holds, what checkpoints write and keep, per increment.

A synthetic power-law stream (`common.power_law_stream`, drawn increment by increment from a
seed per increment, times increasing) is handed to the orchestrator one increment at a time by
an in-process source, as `--follow` hands it files; the run is on the Ray backend (2 shards,
2 trainers by default), TGN with dims 16, with a run directory (event log, checkpoints after
every increment, `--keep-checkpoints`). Per increment it records the driver's RSS (VmRSS, and
its private part RssAnon apart from the object store's shared pages it maps),
the seconds of ingest, evaluation, training and checkpoint, the bytes the checkpoint wrote
(files new or changed under the run's checkpoints/ and updates/) and the bytes on disk there
and in the whole run directory. It reads only files and the orchestrator's public steps, so
an older commit is measured the same way (`--compare` in RESULTS.md).

    python benchmarks/bench_long_run.py --increments 200 --events-per-increment 100000

`--source file` writes the same stream to one Parquet file first and runs it as a job given
`--dataset FILE` does (phase 1 and the increments cut to the followed run's sizes), so the
driver's memory of a run from a file is measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from tidegraph.orchestrator import Orchestrator, RunState  # noqa: E402
from tidegraph.orchestrator.cluster import loopback_cluster  # noqa: E402
from tidegraph.orchestrator.rundir import RunDir  # noqa: E402
from tidegraph.runtime import set_determinism, tune_host_allocator  # noqa: E402
from tidegraph.storage.events import EventBatch  # noqa: E402
from tidegraph.training import RunConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, power_law_stream, write_json  # noqa: E402


class PowerLawSource:
    """Increment k: `size` events of a power-law stream over `nodes` ids (seed k), at times
    after increment k - 1's; phase 1 (k = 0): `first` events (default `size`). The
    orchestrator's source interface (`tidegraph.storage.live`)."""

    waiting_for = "synthetic increment"
    path = "synthetic"

    def __init__(self, increments: int, size: int, nodes: int, first: int = 0) -> None:
        self.increments, self.size, self.nodes, self.k = increments, size, nodes, 0
        self.first = first or size

    def next_events(self, timeout: float):
        if self.k > self.increments:  # phase 1, then the increments
            return None
        n = self.first if self.k == 0 else self.size
        start = 0 if self.k == 0 else self.first + (self.k - 1) * self.size
        src, dst, t = power_law_stream(n, self.nodes, seed=self.k)
        self.k += 1
        return f"increment-{self.k - 1}", EventBatch(src, dst, t + start, torch.arange(n))

    def state_dict(self) -> dict:
        return {"kind": "synthetic", "k": self.k}

    def load_state_dict(self, state: dict) -> None:
        self.k = state["k"]


def write_parquet(path: Path, increments: int, size: int, nodes: int, first: int = 0) -> None:
    """The stream `PowerLawSource` hands out (phase 1, then `increments`), as one Parquet file
    written an increment at a time (a row group each)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = PowerLawSource(increments, size, nodes, first)
    with pq.ParquetWriter(str(path), pa.schema([("src", pa.int64()), ("dst", pa.int64()),
                                                ("t", pa.float64())])) as out:  # fmt: skip
        while (got := source.next_events(0)) is not None:
            ev = got[1]
            out.write_table(pa.table({"src": ev.src.numpy(), "dst": ev.dst.numpy(),
                                      "t": ev.t.numpy()}))  # fmt: skip


def file_stream(cfg: RunConfig, run_dir: RunDir):
    """The job's stream of the file: spooled to the run directory where this commit spools
    (the driver holds a block at a time), else loaded whole (older commits, `--compare`)."""
    from tidegraph.training.data import stream_for

    if hasattr(run_dir, "spool_uri"):
        return stream_for(cfg.data, run_dir.spool_uri())
    return stream_for(cfg.data)


def config(args, storage: str, data: str | None = None) -> RunConfig:
    file_run = {}
    if data is not None:  # phase 1 and the increments of the followed run, cut from a file
        first = args.phase1_events or args.events_per_increment
        total = first + args.increments * args.events_per_increment
        file_run = {"data": {"dataset": data},
                    "continual": {"forget_sample": 200, "num_increments": args.increments,
                                  "train_fraction": first / total}}  # fmt: skip
    if args.window:
        file_run.setdefault("continual", {"forget_sample": 200})["window_events"] = args.window
    return RunConfig.from_dict({
        "model": {"name": "tgn", "dim": 16, "time_dim": 16, "memory_dim": 16},
        "sampler": {"fanouts": [5]},
        "train": {"batch_size": args.batch, **({"epochs": args.epochs} if args.epochs else {})},
        "continual": {"forget_sample": 200},
        "cluster": {"backend": "ray", "shards": args.shards, "trainers": args.trainers,
                    **({"trainer_resources": {"work": 1}, "shard_resources": {"work": 1}}
                       if args.layout == "head" else {})},
        "run_name": "long", "storage": storage, "out_dir": None, "progress": False,
        "checkpoint_every": 1, **({"keep_checkpoints": args.keep} if args.keep else {}),
        **file_run,
    })  # fmt: skip


def rss_bytes(field: str = "VmRSS", pid: int | str = "self") -> int:
    """The driver's resident memory (`VmRSS`), or one part of it: `RssAnon` (its own heap,
    without the pages of Ray's shared-memory object store it has mapped: `RssShmem`); of
    process `pid` (this machine's) instead."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def shard_memory(group) -> dict:
    """The shard actors' own memory (RssAnon) and the object-store pages they map
    (RssShmem), summed over them, in MB (processes of this machine)."""
    pids = ray.get([s.pid.remote() for s in group.shards])
    return {f"shards_{k.lower()}_mb": sum(rss_bytes(k, p) for p in pids) / 2**20
            for k in ("RssAnon", "RssShmem")}  # fmt: skip


def plasma_used_bytes() -> int:
    """Bytes in use in the object store of the driver's node (its raylet's store stats)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used)


def driver_refs() -> int:
    """Object refs the driver's core worker counts (held by it or borrowed)."""
    return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


def held_tensors(top: int = 12) -> dict:
    """The tensors the driver's Python objects hold (`--diag`): total bytes of their distinct
    storages and the largest ones (shape, dtype, MB), to tell a table that grows from heap
    the allocator keeps."""
    import gc

    seen: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            st = obj.untyped_storage()
            seen[st.data_ptr()] = (st.nbytes(), f"{tuple(obj.shape)} {obj.dtype}")
    largest = sorted(seen.values(), reverse=True)[:top]
    return {"tensor_mb": sum(n for n, _ in seen.values()) / 2**20, "tensors": len(seen),
            "largest": [f"{d} {n / 2**20:.2f}" for n, d in largest]}  # fmt: skip


def files(root: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every file under `root`."""
    out = {}
    for p in root.rglob("*"):
        if p.is_file():
            st = p.stat()
            out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


def du(root: Path, sub: str = "") -> int:
    """Bytes of the files under root/sub."""
    return sum(size for size, _ in files(root / sub).values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--increments", type=int, default=200)
    p.add_argument("--events-per-increment", type=int, default=100_000)
    p.add_argument("--nodes", type=int, default=500_000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--keep", type=int, default=0, help="--keep-checkpoints (0: the default)")
    p.add_argument(
        "--layout",
        choices=("one", "head"),
        default="one",
        help="one: a single Ray node; head: the driver alone on a head node, the "
        "shards and trainers on a second node (a cluster's layout, on this machine)",
    )
    p.add_argument(
        "--diag",
        type=int,
        default=0,
        help="every DIAG increments, record the tensors the driver holds",
    )
    p.add_argument("--source", choices=("follow", "file"), default="follow",
                   help="follow: increments handed out one at a time, as --follow does; file: "
                   "the same stream written to one Parquet file first, the run reading it "
                   "as a job given --dataset FILE does")  # fmt: skip
    p.add_argument("--phase1-events", type=int, default=0,
                   help="phase 1's events (default: one increment's)")  # fmt: skip
    p.add_argument("--epochs", type=int, default=0, help="phase 1's epochs (0: the default)")
    p.add_argument("--window", type=int, default=0,
                   help="continual.window_events (0: the default)")  # fmt: skip
    p.add_argument("--label", default="", help="names the output (e.g. a commit)")
    p.add_argument("--storage", default=None, help="keep the run directory here (default: a "
                   "temporary one, deleted at the end)")  # fmt: skip
    args = p.parse_args()
    set_determinism(0, threads=1)
    tune_host_allocator()  # as the job does
    cluster = None
    if args.layout == "head":
        cluster, _ = loopback_cluster([8], "long-run", resources=[{}, {"work": 100}])
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=8,
                 include_dashboard=False, configure_logging=False)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="tidegraph-long-") as tmp:
        storage = args.storage or tmp
        run_path = Path(storage) / "long"
        run_dir = RunDir(storage, "long")
        if args.source == "file":
            data = Path(tmp) / "stream.parquet"
            write_parquet(data, args.increments, args.events_per_increment, args.nodes,
                          args.phase1_events)  # fmt: skip
            cfg = config(args, storage, str(data))
            t_load = time.perf_counter()
            stream = file_stream(cfg, run_dir)
            print(
                json.dumps(
                    {
                        "load_s": round(time.perf_counter() - t_load, 2),
                        "driver_hwm_mb": round(rss_bytes("VmHWM") / 2**20, 1),
                        "driver_rss_mb": round(rss_bytes() / 2**20, 1),
                    }
                ),
                flush=True,
            )
            orch = Orchestrator(cfg, stream, run_dir=run_dir)
        else:
            source = PowerLawSource(args.increments, args.events_per_increment, args.nodes,
                                    args.phase1_events)  # fmt: skip
            orch = Orchestrator(config(args, storage), run_dir=run_dir, source=source)
        timing = {"ingest": 0.0, "checkpoint": 0.0}
        wrapped = False
        t_start = time.perf_counter()
        try:
            done = -1
            for _ in range(10 * args.increments + 100):  # bounded
                before = files(run_path / "checkpoints") | files(run_path / "updates")
                t0 = time.perf_counter()
                state = orch.step()
                step_s = time.perf_counter() - t0
                if state in (RunState.FINISHED, RunState.ERRORED):
                    break
                learner = orch.learner
                if learner is not None and not wrapped:  # time ingest and checkpoints
                    wrapped = True
                    for obj, name, key in (
                        (learner, "ingest", "ingest"),
                        (orch, "_checkpoint", "checkpoint"),  # the actors' chunks too
                    ):
                        fn = getattr(obj, name)

                        def timed(*a, _fn=fn, _key=key, **k):
                            t = time.perf_counter()
                            try:
                                return _fn(*a, **k)
                            finally:
                                timing[_key] += time.perf_counter() - t

                        setattr(obj, name, timed)  # fmt: skip
                if learner is None or learner.cursor.increment == done or not learner.history:
                    continue
                record = learner.history[-1]
                if record.get("phase") != "increment" or record["increment"] == done:
                    continue
                done = record["increment"]
                after = files(run_path / "checkpoints") | files(run_path / "updates")
                written = sum(size for path, (size, mt) in after.items()
                              if before.get(path, (None, None))[1] != mt)  # fmt: skip
                n = record["events"]
                train_events = n + record["replayed"]
                rows.append({
                    "increment": done, "events_so_far": learner.cursor.ingested,
                    "driver_rss_mb": rss_bytes() / 2**20,
                    "driver_hwm_mb": rss_bytes("VmHWM") / 2**20,
                    "driver_anon_mb": rss_bytes("RssAnon") / 2**20,
                    "driver_shmem_mb": rss_bytes("RssShmem") / 2**20,
                    "plasma_used_mb": plasma_used_bytes() / 2**20, "driver_refs": driver_refs(),
                    **shard_memory(learner.group),
                    "step_s": step_s,
                    "ingest_s": timing["ingest"], "checkpoint_s": timing["checkpoint"],
                    "eval_s": n / record["eval_events_per_s"],
                    "train_s": train_events / record["train_events_per_s"],
                    "checkpoint_written_mb": written / 2**20,
                    "checkpoints_on_disk_mb": du(run_path, "checkpoints") / 2**20,
                    "run_dir_mb": du(run_path) / 2**20,
                    "ap": record["ap"],
                })  # fmt: skip
                if args.diag and done % args.diag == 0:
                    rows[-1]["held"] = held_tensors()
                timing.update(ingest=0.0, checkpoint=0.0)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in rows[-1].items()}), flush=True)  # fmt: skip
            if orch.error is not None:
                raise orch.error
        finally:
            orch.close()
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
    tenth = max(1, len(rows) // 10)
    first, last = rows[:tenth], rows[-tenth:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    summary = {k: {"first_tenth": mean(first, k), "last_tenth": mean(last, k),
                   "ratio": mean(last, k) / max(mean(first, k), 1e-9)}
               for k in ("driver_rss_mb", "driver_hwm_mb", "driver_anon_mb", "driver_shmem_mb",
                         "shards_rssanon_mb", "shards_rssshmem_mb", "plasma_used_mb",
                         "driver_refs", "checkpoint_written_mb",
                         "checkpoints_on_disk_mb", "step_s", "checkpoint_s")}  # fmt: skip
    summary["wall_s"] = time.perf_counter() - t_start
    print(json.dumps(summary, indent=1))
    layout = "" if args.layout == "one" else f"_{args.layout}"
    source = "" if args.source == "follow" else f"_{args.source}"
    name = (f"long_run_{args.increments}x{args.events_per_increment}{layout}{source}"
            f"{args.label}.json")  # fmt: skip
    write_json(name, {"args": vars(args), "machine": machine(), "summary": summary,
                      "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
