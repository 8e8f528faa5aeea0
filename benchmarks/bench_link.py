"""A real training pass of W = 2 trainers whose traffic crosses a rate-limited link, for the
what-if model (`python -m tidegraph.jobs.whatif`) to be checked against (issue 26).

A two-node Ray cluster across a veth pair: the head in this (the root) network namespace on
the veth's end 10.231.0.1, a second node in the network namespace `tglink` on its other end
10.231.0.2. Custom resources place the actors (`cluster.trainer_resources`,
`shard_resources`): "tg_trainer" on both nodes, one trainer each; "tg_shard" on the head
only, with every shard. Trainer 1's all-reduce and node-state exchange with trainer 0, and its
requests to the shards (sampling, features), cross the veth; trainer 0's stay on the head.
Both ends are shaped with `tc tbf` (burst: 2 ms of the rate, at least 256 KiB; with
--latency-us, under a `netem delay` of that much each way); `unlimited`: the bare veth.

For each rate x compression x overlap a fresh learner ingests phase 1 of the stream, trains an
untimed warm-up pass, then one timed training pass with the timeline on (bench_scaling's
`timed_pass`); the bytes the veth carried in each direction during the timed pass are read
from its counters (headers and Ray's own traffic included). Each setting's trace goes to
benchmarks/out/link_{rate}_{compression}_{overlap}.json (otherData: events, wall_s, steps,
link_gbps, link_latency_us, veth bytes), and a table and link_summary.json (or --out) give
events/s per setting beside the all-reduce bytes the trace counts.

Needs root, `ip` and `tc`. The namespace and the veth are made here and deleted by name in
`finally`, only those this run made; it refuses to run if either exists (and then deletes
nothing). The two Ray nodes are started here (`ray start --block`, each in a session of its
own, under a temporary directory) and stopped by their process ids: SIGTERM, then SIGKILL after
a bounded wait (never `ray stop`, which stops every Ray on the machine). SIGTERM to this script
ends it through the same cleanup. Ray's token authentication is taken as this environment has
it (RAY_AUTH_MODE; unset: on where a token exists, as `ray start --head` decides) and passed to
both nodes and this driver explicitly, since a node joining with `ray start --address` does not
look for a token on its own.

    python benchmarks/bench_link.py --rates unlimited,1gbit --compression none --overlap off
    python benchmarks/bench_link.py --rates unlimited,10gbit,1gbit --compression none,q8 \\
        --overlap off,on
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _auth_mode() -> str:
    """Ray's authentication mode: RAY_AUTH_MODE, or where unset token when a token exists."""
    if os.environ.get("RAY_AUTH_MODE"):
        return os.environ["RAY_AUTH_MODE"]
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return "token" if os.environ.get("RAY_AUTH_TOKEN") or Path(path).is_file() else "disabled"


# read when ray is first imported: this driver, both nodes and their workers agree on them;
# a real cluster (the tests' "0" keeps Ray on loopback, and a second node would refuse to join)
AUTH = os.environ["RAY_AUTH_MODE"] = _auth_mode()
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scaling import PHASES, timed_pass  # noqa: E402
from common import machine, print_table, write_json  # noqa: E402

from tidegraph.orchestrator.cluster import until  # noqa: E402
from tidegraph.timeline import trace_document  # noqa: E402
from tidegraph.training import RunConfig, load_stream  # noqa: E402

NS = "tglink"
VETH = ("tglinkh", "tglinkn")  # the head's end (root namespace), the other node's end
ADDR = ("10.231.0.1", "10.231.0.2")
RAY = str(Path(sys.executable).parent / "ray")


# -- the link ---------------------------------------------------------------------------------


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, timeout=30, capture_output=True)


def make_link(made: set[str]) -> None:
    """The namespace and the veth pair, addressed and up; refused if either exists. Each one
    made goes into `made` ("netns", "veth") as soon as it exists: `drop_link` deletes those
    only, never another run's."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           timeout=30).stdout.split()  # fmt: skip
    if NS in names or any(Path(f"/sys/class/net/{v}").exists() for v in VETH):
        raise RuntimeError(f"network namespace {NS} or veth {VETH[0]} exists already; not "
                           "touching them (another run of this benchmark?)")  # fmt: skip
    _sh("ip", "netns", "add", NS)
    made.add("netns")
    _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1], "netns", NS)
    made.add("veth")
    _sh("ip", "addr", "add", f"{ADDR[0]}/24", "dev", VETH[0])
    _sh("ip", "link", "set", VETH[0], "up")
    _sh("ip", "-n", NS, "addr", "add", f"{ADDR[1]}/24", "dev", VETH[1])
    _sh("ip", "-n", NS, "link", "set", VETH[1], "up")
    _sh("ip", "-n", NS, "link", "set", "lo", "up")


def drop_link(made: set[str]) -> None:
    """Delete, by name, what `make_link` made: the namespace (its end of the veth goes with
    it, and so the pair), and the veth."""
    if "netns" in made:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=30)
    if "veth" in made:
        subprocess.run(["ip", "link", "del", VETH[0]], capture_output=True, timeout=30)


def gbps(rate: str) -> float | None:
    """Gbit/s of a tc rate ("10gbit", "100mbit"); None for "unlimited"."""
    if rate == "unlimited":
        return None
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if rate.endswith(unit):
            return float(rate.removesuffix(unit)) * scale
    raise ValueError(f"--rates: {rate!r} is not unlimited, N gbit, N mbit or N kbit")


def shape(rate: str, latency_us: float) -> None:
    """Both ends of the veth: `tbf` at `rate` (none: unlimited) under a `netem delay` of
    `latency_us` (none: 0), each replacing what was there."""
    ends = (((), VETH[0]), (("ip", "netns", "exec", NS), VETH[1]))
    for prefix, dev in ends:
        tc = [*prefix, "tc", "qdisc"]
        subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True, timeout=30)
        parent = ["root"]
        if latency_us:
            _sh(*tc, "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                f"{latency_us:g}us", "limit", "100000")  # fmt: skip
            parent = ["parent", "1:1"]
        if rate != "unlimited":
            burst = max(int(gbps(rate) * 1e9 / 8 * 2e-3), 256 << 10)  # 2 ms of the rate
            _sh(*tc, "add", "dev", dev, *parent, "handle", "10:", "tbf", "rate", rate,
                "burst", str(burst), "latency", "50ms")  # fmt: skip


def veth_bytes() -> dict:
    """Bytes through the veth so far: to the namespace (the head's end sends) and from it."""
    stats = Path(f"/sys/class/net/{VETH[0]}/statistics")
    return {"to_ns": int((stats / "tx_bytes").read_text()),
            "from_ns": int((stats / "rx_bytes").read_text())}  # fmt: skip


# -- the two Ray nodes --------------------------------------------------------------------------


def _free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_nodes(args, tmp: str, procs: list[subprocess.Popen]) -> str:
    """The head (here, on the veth's end) and the second node (in the namespace), each a
    `ray start --block` in a session of its own, appended to `procs` as each starts (so a
    wait that times out leaves them to the caller's cleanup); the head's address."""
    env = {**os.environ, "RAY_AUTH_MODE": AUTH, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    env.pop("RAY_ADDRESS", None)
    port = _free_port(ADDR[0])
    common = ["--block", f"--temp-dir={tmp}", "--disable-usage-stats",
              f"--object-store-memory={args.object_store_mb << 20}"]  # fmt: skip
    head = [RAY, "start", "--head", f"--node-ip-address={ADDR[0]}", f"--port={port}",
            f"--num-cpus={args.head_cpus}", "--include-dashboard=false",
            "--resources=" + json.dumps({"tg_trainer": 1, "tg_shard": args.shards}),
            # the head's agents on free ports: another Ray on this machine may hold the
            # fixed defaults (the other node has its own network namespace)
            *(f"--{flag}={_free_port()}" for flag in (
                "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                "runtime-env-agent-port", "metrics-export-port", "ray-client-server-port")),
            *common]  # fmt: skip
    other = ["ip", "netns", "exec", NS, RAY, "start", f"--address={ADDR[0]}:{port}",
             f"--node-ip-address={ADDR[1]}", f"--num-cpus={args.worker_cpus}",
             "--resources=" + json.dumps({"tg_trainer": 1}), *common]  # fmt: skip
    for cmd, iface, name in ((head, VETH[0], "head"), (other, VETH[1], "other")):
        with open(Path(tmp, f"{name}.log"), "w") as log:  # the node holds its own copy
            procs.append(subprocess.Popen(cmd, env={**env, "GLOO_SOCKET_IFNAME": iface},
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
        if name == "head":  # the other node joins once the head's GCS answers
            until(lambda: _listening(ADDR[0], port) or _exited(procs), 120, "the head's GCS")
        if _exited(procs):
            break
    return f"{ADDR[0]}:{port}"


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _exited(procs: list[subprocess.Popen]) -> bool:
    return any(p.poll() is not None for p in procs)


def _tree(roots: set[int], tmp: str) -> set[int]:
    """Processes under `roots`, and those whose command line names `tmp` (Ray's workers and
    agents rename themselves, and may outlive their parents)."""
    parent, named = {}, set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            if tmp.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                named.add(int(entry))
    found = frontier = (roots | named) & set(parent)
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found = found | frontier
    return found - {os.getpid()}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_nodes(procs: list[subprocess.Popen], tmp: str) -> None:
    """SIGTERM each node's `ray start` (it stops what it started), then SIGKILL, by id, what
    is left of their processes after 20 s."""
    pids = _tree({p.pid for p in procs}, tmp)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in _tree({p.pid for p in procs}, tmp) | pids:
        if _alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _log_tail(tmp: str) -> str:
    logs = sorted(Path(tmp).glob("*.log"))
    return "\n".join(f"-- {f.name}:\n{f.read_text()[-2000:]}" for f in logs)


# -- measuring ----------------------------------------------------------------------------------


def config(args, compression: str, overlap: str) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"name": "tgn"},
        "data": {"dataset": args.dataset, "max_events": args.max_events},
        "train": {"batch_size": args.batch_size},
        "cluster": {"backend": "ray", "shards": args.shards, "trainers": 2,
                    "trainer_cpus": args.trainer_cpus, "shard_cpus": args.shard_cpus,
                    "trainer_resources": {"tg_trainer": 1}, "shard_resources": {"tg_shard": 1}},
        "progress": False, "out_dir": None, "threads": 1, "run_name": "bench-link",
        "timeline": args.timeline,
        "comm": {"compression": compression, "overlap": overlap == "on"},
    })  # fmt: skip


def measure(args, stream, rate: str, compression: str, overlap: str) -> dict:
    """One setting's timed pass: its trace file, and its row."""
    run = timed_pass(config(args, compression, overlap), stream, args.warmup, veth_bytes)
    wall, steps = run["wall_s"], run["steps"]
    moved = {k: run["after"][k] - run["before"][k] for k in run["before"]}
    link = {"link_rate": rate, "link_gbps": gbps(rate), "link_latency_us": args.latency_us}
    meta = {**run["meta"], **link, "events": run["events"], "wall_s": wall,
            "events_per_s": run["events"] / wall, "steps": steps, "veth_bytes": moved,
            "machine": machine()}  # fmt: skip
    name = f"link_{rate}_{compression}_{overlap}.json"
    write_json(name, trace_document(run["trace"], meta))
    split = {p: statistics.mean(s.get(p, 0.0) for s in run["seconds"]) / steps * 1e3
             for p in PHASES}  # fmt: skip
    return {"rate": rate, "compression": compression, "overlap": overlap,
            "events_per_s": run["events"] / wall, "ms_per_step": wall / steps * 1e3,
            "allreduce_ms": split["allreduce"], "exchange_ms": split["exchange"],
            "veth_MB": sum(moved.values()) / 1e6, "to_ns_MB": moved["to_ns"] / 1e6,
            "from_ns_MB": moved["from_ns"] / 1e6,
            "allreduce_MB": _allreduce_bytes(run["trace"]) / 1e6, "trace": name}  # fmt: skip


def _allreduce_bytes(trace: list[dict]) -> int:
    """Bytes the trainers' recorded all-reduces sent, all ranks together (by the algorithm's
    count: payload only)."""
    return sum(e.get("args", {}).get("bytes", 0) for e in trace
               if e.get("ph") == "X" and e.get("name") == "allreduce")  # fmt: skip


def _terminated(signum: int, frame) -> None:
    """SIGTERM: leave through `main`'s `finally` (the nodes stopped, the link deleted)."""
    raise SystemExit(128 + signum)


def _list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=_list, default=["unlimited", "10gbit", "1gbit"],
                    help="comma-separated tc rates (unlimited: the bare veth)")  # fmt: skip
    ap.add_argument("--compression", type=_list, default=["none", "q8"])
    ap.add_argument("--overlap", type=_list, default=["off", "on"])
    ap.add_argument("--latency-us", type=float, default=0.0,
                    help="netem delay each way on both ends (0: none)")  # fmt: skip
    ap.add_argument("--dataset", default="wikipedia")
    ap.add_argument("--max-events", type=int, default=20000)
    ap.add_argument("--batch-size", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--timeline", type=int, default=1, help="record every K-th step")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--trainer-cpus", type=float, default=1.0)
    ap.add_argument("--shard-cpus", type=float, default=0.5)
    ap.add_argument("--head-cpus", type=int, default=None,
                    help="the head's CPUs (default: a trainer's and the shards')")  # fmt: skip
    ap.add_argument("--worker-cpus", type=int, default=None,
                    help="the other node's (default: a trainer's)")  # fmt: skip
    ap.add_argument("--object-store-mb", type=int, default=1024, help="per node")
    ap.add_argument("--out", default="link_summary.json")
    args = ap.parse_args()
    if bad := [o for o in args.overlap if o not in ("on", "off")]:
        ap.error(f"--overlap: on or off, got {bad}")
    for rate in args.rates:
        gbps(rate)
    if args.head_cpus is None:
        args.head_cpus = math.ceil(args.trainer_cpus + args.shards * args.shard_cpus)
    if args.worker_cpus is None:
        args.worker_cpus = math.ceil(args.trainer_cpus)
    import ray

    stream = load_stream(args.dataset, args.max_events)
    tmp = tempfile.mkdtemp(prefix="tglink", dir="/tmp")  # short: Ray's socket paths
    procs: list[subprocess.Popen] = []
    made: set[str] = set()
    rows = []
    signal.signal(signal.SIGTERM, _terminated)  # ray.init sets one that exits the same way
    try:
        make_link(made)
        address = start_nodes(args, tmp, procs)
        if _exited(procs):
            raise RuntimeError(f"a Ray node did not start:\n{_log_tail(tmp)}")
        ray.init(address=address, _node_ip_address=ADDR[0], namespace="bench-link",
                 configure_logging=False)  # fmt: skip
        until(lambda: sum(n["Alive"] for n in ray.nodes()) >= 2 or _exited(procs), 120,
              "the second Ray node")  # fmt: skip
        if _exited(procs):
            raise RuntimeError(f"a Ray node stopped:\n{_log_tail(tmp)}")
        print(f"two Ray nodes across {VETH[0]} ({ADDR[0]}) - {NS}:{VETH[1]} ({ADDR[1]}); "
              f"token authentication {AUTH}", flush=True)  # fmt: skip
        for rate in args.rates:
            shape(rate, args.latency_us)
            for compression in args.compression:
                for overlap in args.overlap:
                    rows.append(measure(args, stream, rate, compression, overlap))
                    print_table(rows[-1:])
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM: the cleanup goes on
        if ray.is_initialized():
            ray.shutdown()
        stop_nodes(procs, tmp)
        drop_link(made)
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print(f"{machine()}; {args.dataset} {args.max_events} events, TGN, batch {args.batch_size}, "
          f"W = 2 across a veth, latency {args.latency_us:g} us each way")  # fmt: skip
    print_table(rows)
    print("wrote", write_json(args.out, {"command": " ".join(sys.argv), "auth": AUTH,
                                         "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                                         "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
