"""What a trainer or shard process costs to start: CPU seconds of its first steps, each in a
fresh Python process, and a whole Ray group's start (a coordinator, 2 shard actors, 2 trainer
actors) with each actor's CPU read from /proc.

Per fresh process (median of `--repeats`), cumulative:
  torch          `import torch`
  determinism    + torch.use_deterministic_algorithms(True)   (imports inductor, dynamo)
  torch adam     + torch.optim.Adam(fused=True) and one step   (imports dynamo)
  tidegraph      `import torch` + tidegraph's set_determinism + FlatAdam and one step

The group start runs `--groups` times on a local Ray (TGN on 5,000 Wikipedia events, the
elastic tests' configuration): wall seconds from `ContinualLearner(...)` to its return, and
CPU seconds per actor kind.

    python benchmarks/bench_actor_start.py [--repeats 5] [--groups 3]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import time

from common import write_json

STEPS = {
    "torch": "import torch",
    "determinism": "import torch; torch.use_deterministic_algorithms(True, warn_only=True)",
    "torch adam": (
        "import torch; torch.use_deterministic_algorithms(True, warn_only=True)\n"
        "net = torch.nn.Linear(64, 64); opt = torch.optim.Adam(net.parameters(), fused=True)\n"
        "net(torch.ones(2, 64)).sum().backward(); opt.step()"
    ),
    "tidegraph": (
        "import torch\nfrom tidegraph.runtime import set_determinism\n"
        "from tidegraph.training.optim import FlatAdam\nset_determinism(0, threads=1)\n"
        "net = torch.nn.Linear(64, 64); opt = FlatAdam(net.parameters(), lr=1e-3)\n"
        "net(torch.ones(2, 64)).sum().backward(); opt.step()"
    ),
}


def process_cpu(code: str) -> float:
    """User + system CPU seconds of a fresh interpreter running `code`."""
    before = os.times()
    subprocess.run([sys.executable, "-c", code], check=True)
    after = os.times()
    return (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )


def actor_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds per Ray actor process (by its title, e.g. ray::_Trainer)."""
    out = {}
    for d in glob.glob("/proc/[0-9]*"):
        try:
            title = open(d + "/cmdline").read().split("\0")[0]
            fields = open(d + "/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if title.startswith("ray::_"):
            ticks = int(fields[11]) + int(fields[12])  # utime + stime
            out[int(d[6:])] = (title[5:], ticks / os.sysconf("SC_CLK_TCK"))
    return out


def group_starts(groups: int) -> list[dict]:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import ray

    from tidegraph.orchestrator import make_group
    from tidegraph.runtime import set_determinism
    from tidegraph.training import ContinualLearner, RunConfig, load_stream

    raw = {
        "model": {"name": "tgn", "dim": 16, "time_dim": 8, "memory_dim": 16},
        "data": {"max_events": 5000, "dataset": "wikipedia"},
        "cluster": {"backend": "ray", "trainers": 2, "shards": 2},
        "progress": False, "out_dir": None, "run_name": "bench-actor-start",
    }  # fmt: skip
    stream = load_stream("wikipedia", 5000)
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=8,
             include_dashboard=False, configure_logging=False)  # fmt: skip
    rows = []
    try:
        time.sleep(3)  # Ray's own start settles
        for _ in range(groups):
            set_determinism(7, threads=1)
            before = actor_cpu()
            start = time.perf_counter()
            learner = ContinualLearner(RunConfig.from_dict(raw), stream, make_group)
            wall = time.perf_counter() - start
            per_kind: dict[str, list[float]] = {}
            for pid, (kind, cpu) in actor_cpu().items():
                per_kind.setdefault(kind, []).append(cpu - before.get(pid, (kind, 0.0))[1])
            learner.group.shutdown()
            rows.append({"wall_s": wall, "cpu_s": {k: sorted(v) for k, v in per_kind.items()}})
            print(f"group start {wall:.2f} s; actor CPU s {rows[-1]['cpu_s']}", flush=True)
            time.sleep(2)
    finally:
        ray.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--groups", type=int, default=3)
    args = ap.parse_args()
    process = {}
    for name, code in STEPS.items():
        runs = [process_cpu(code) for _ in range(args.repeats)]
        process[name] = statistics.median(runs)
        print(f"{name:12s} {process[name]:.2f} CPU s (median of {args.repeats})", flush=True)
    groups = group_starts(args.groups) if args.groups else []
    write_json("actor_start.json", {"process_cpu_s": process, "group_starts": groups})


if __name__ == "__main__":
    main()
