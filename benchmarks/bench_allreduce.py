"""Quantized all-reduce against fp32: time per all-reduce and bytes on the wire, per link.

Three parts, each run once:

1. Codec throughput in this process: quantize + dequantize of an fp32 tensor (8/4/2 bits,
   chunks of 256) in GB/s of input, against a plain copy of the same tensor (the memory-bandwidth
   bound) measured in the same run, at 1 thread and at all threads.
2. W gloo processes on loopback (W = 2, 3): for each tensor size and each compression (none,
   q8, q4, q2, adaptive at lambda 1 and 4, top-k 1%), one untimed call then `--reps` timed ones
   (barrier before each; the median of rank 0's times), bytes this rank sent by the
   algorithm's count (`CommStats.bytes_sent`) and its ratio to an fp32 ring all-reduce.
3. The same for W = 2 over a rate-limited link: two network namespaces joined by a veth pair,
   `tc tbf` on both ends (1 Gbit/s, 100 Mbit/s), ranks started inside them with `ip netns exec`;
   there the bytes are also read from the veth's own counter (`tx_bytes`, headers included).
   Per-bucket messages (each bucket its own exchange, as when overlapping with backward) for a
   model-like list of tensors, fixed 4 MiB / 256 KiB buckets against the link cost model.
   Namespaces (`tgq14a`, `tgq14b`) are made by this script and deleted by name in `finally`;
   it refuses to run if they already exist. Needs root.

4. `--overlap` (alone): W = 2 training steps of an MLP (8 Linear(1024) layers, 8.4M
   parameters, FlatAdam, batch 32 per rank) on loopback and over each --rates link: compute
   only, then fp32 and q8 with the all-reduce after backward, overlapped with it (buckets
   leave from the gradient hooks, `QuantizedAllReduce.begin`), and overlapped with buckets
   from the link cost model (MG-WFBP) instead of fixed 4 MiB ones.

The input is Gaussian with a scale falling from 1 to 1e-3 along the tensor (so adaptive bits
have something to decide); every rank draws its own. Adaptive bits decide on the untimed call.

    python benchmarks/bench_allreduce.py                 # all parts, 1M and 8M floats
    python benchmarks/bench_allreduce.py --no-netns --sizes 1000000
    python benchmarks/bench_allreduce.py --sizes 100000000 --worlds --rates 1gbit --reps 1 \
        --compressions none q8 q4 --no-codec --no-buckets --out allreduce_100m.json
    python benchmarks/bench_allreduce.py --overlap --rates 1gbit --reps 5 --out overlap.json
JSON goes to benchmarks/out/allreduce.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import print_table, write_json  # noqa: E402

from tidegraph.comm.config import CommConfig  # noqa: E402
from tidegraph.comm.qallreduce import QuantizedAllReduce, plan_buckets  # noqa: E402
from tidegraph.comm.quantize import dequantize, quantize  # noqa: E402

COMPRESSIONS = [
    ("none", {}),
    ("q8", {}),
    ("q4", {}),
    ("q2", {}),
    ("adaptive", {"adaptive_lambda": 1.0}),
    ("adaptive", {"adaptive_lambda": 4.0}),
    ("topk", {"topk_ratio": 0.01}),
]
NS = ("tgq14a", "tgq14b")
VETH = ("tgq14va", "tgq14vb")
ADDR = ("10.231.14.1", "10.231.14.2")
# a model-like gradient: one large embedding-sized tensor and many layers
MODEL_SIZES = [1_000_000] + [40_000] * 20 + [2_000] * 40 + [64] * 40
OVERLAP_LAYERS, OVERLAP_WIDTH = 8, 1024  # part 4's MLP: 8.4M parameters
TIMEOUT = datetime.timedelta(seconds=120)


def _input(n: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, generator=g) * torch.logspace(0, -3, n)


def _label(name: str, extra: dict) -> str:
    if name == "adaptive":
        return f"adaptive l={extra['adaptive_lambda']:g}"
    if name == "topk":
        return f"topk {extra['topk_ratio']:g}"
    return name


# -- part 1 --------------------------------------------------------------------------------


def codec_throughput(n: int, reps: int, codecs: list[str]) -> list[dict]:
    """quantize + dequantize of `n` values against a copy of the same tensor, timed right
    before (pairs: the shared box's load moves both alike)."""
    rows = []
    x = torch.randn(n)
    g = torch.Generator().manual_seed(0)
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        for codec in codecs:
            for bits in (8, 4, 2):
                dequantize(quantize(x, bits, 256, g, codec), codec)  # compiles if compiled
                copy_s = _median_time(lambda: x.clone(), reps)
                s = _median_time(
                    lambda b=bits, c=codec: dequantize(quantize(x, b, 256, g, c), c), reps
                )
                rows.append({
                    "threads": threads, "codec": codec, "bits": bits,
                    "codec_GBps": x.nbytes / s / 1e9, "copy_GBps": x.nbytes / copy_s / 1e9,
                    "ratio": copy_s / s,
                })  # fmt: skip
    return rows


def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- worker (one rank) ---------------------------------------------------------------------


def _tx_bytes(iface: str | None) -> int | None:
    if not iface or iface == "lo":
        return None
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def _timed(fn, reps: int, iface: str | None):
    """(median seconds, wire bytes per call) of `fn` after one untimed call, ranks aligned."""
    fn()
    times, before = [], _tx_bytes(iface)
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    dist.barrier()  # the peers have received all we sent: none of it still queued here
    after = _tx_bytes(iface)
    wire = None if before is None else (after - before) / reps  # barriers are a few bytes
    return statistics.median(times), wire


def worker(args) -> None:
    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    store = dist.TCPStore(args.master, args.port, world, is_master=rank == 0,
                          wait_for_workers=False, timeout=TIMEOUT)  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    rows = []
    try:
        for n in [] if args.overlap else args.sizes:
            x = _input(n, rank)
            for (name, extra), stages in itertools.product(COMPRESSIONS, args.stages):
                if name not in args.compressions or (name in ("none", "topk") and stages > 1):
                    continue
                cfg = CommConfig(compression=name, warmup_steps=0, codec=args.codec,
                                 pipeline_stages=stages, **extra)  # fmt: skip
                red = QuantizedAllReduce(cfg, None, rank, world, seed=0)
                stats = []
                step = iter(range(10**6))
                flat = x.clone()

                def call(red=red, flat=flat, stats=stats, step=step, x=x):
                    flat.copy_(x)
                    stats.append(red.allreduce_(flat, next(step), average=True))

                seconds, wire = _timed(call, args.reps, args.iface)
                s = stats[-1]
                rows.append({
                    "W": world, "n": n, "compression": _label(name, extra), "stages": stages,
                    "ms": seconds * 1e3, "bytes_sent": s.bytes_sent, "ratio": s.ratio,
                    "wire_bytes": wire, "bits": sorted(set(s.bits)),
                })  # fmt: skip
        if args.buckets:
            rows.extend(_bucket_rows(args, rank, world))
        if args.overlap:
            rows.extend(_overlap_rows(args, rank, world))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def _bucket_rows(args, rank: int, world: int) -> list[dict]:
    """Per-bucket messages over MODEL_SIZES: fixed 4 MiB, 256 KiB, or the link cost model."""
    x = _input(sum(MODEL_SIZES), rank)
    alpha = _message_latency(rank, world, args)
    base = {"compression": "q8", "warmup_steps": 0, "codec": args.codec}
    plans = {
        "fixed 4 MiB": CommConfig(**base),
        "fixed 256 KiB": CommConfig(**base, bucket_bytes=256 << 10),
        "cost model": CommConfig(**base, bucketing="cost_model",
                                 link_bandwidth_gbps=args.link_gbps, link_latency_s=alpha),
    }  # fmt: skip
    rows = []
    for label, cfg in plans.items():
        for name in ("none", "q8"):
            cfg_n = CommConfig(**{**cfg.__dict__, "compression": name})
            buckets = plan_buckets(MODEL_SIZES, cfg_n)
            reducers = [QuantizedAllReduce(cfg_n, None, rank, world, seed=i)
                        for i in range(len(buckets))]  # fmt: skip
            flat = x.clone()

            def call(buckets=buckets, reducers=reducers, flat=flat):
                flat.copy_(x)
                for (lo, hi), red in zip(buckets, reducers, strict=True):
                    red.allreduce_(flat[lo:hi], 0, average=True)

            seconds, wire = _timed(call, args.reps, args.iface)
            rows.append({
                "W": world, "n": sum(MODEL_SIZES), "compression": name,
                "buckets": f"{label} ({len(buckets)})", "ms": seconds * 1e3, "wire_bytes": wire,
                "alpha_ms": alpha * 1e3,
            })  # fmt: skip
    return rows


def _overlap_rows(args, rank: int, world: int) -> list[dict]:
    """Training steps of an MLP (OVERLAP_LAYERS Linear(OVERLAP_WIDTH) layers, FlatAdam, batch
    32 per rank): forward, backward, all-reduce, optimizer; the all-reduce after backward or
    overlapped with it (buckets sent from the parameters' gradient hooks), fp32 and q8,
    fixed 4 MiB buckets or the link cost model. `compute` is the step without any exchange.
    The variants train one model in turn (speed only; tests check that overlap changes no
    bit)."""
    from torch import nn

    from tidegraph.training.optim import FlatAdam

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(OVERLAP_LAYERS):
        layers += [nn.Linear(OVERLAP_WIDTH, OVERLAP_WIDTH), nn.Tanh()]
    model = nn.Sequential(*layers)
    opt = FlatAdam(model.parameters(), lr=1e-5)
    live: dict = {"round": None}

    def final(index: int, _param) -> None:
        if live["round"] is not None:
            live["round"].ready(index)

    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(functools.partial(final, i))
    x = torch.randn(32, OVERLAP_WIDTH, generator=torch.Generator().manual_seed(rank))
    alpha = _message_latency(rank, world, args)
    base = {"warmup_steps": 0, "codec": args.codec}
    cost = {"bucketing": "cost_model", "link_bandwidth_gbps": args.link_gbps,
            "link_latency_s": alpha}  # fmt: skip
    plans = [("compute", None, False)]
    for name in ("none", "q8"):
        plans += [(f"{name} 4 MiB", CommConfig(compression=name, **base), False),
                  (f"{name} 4 MiB", CommConfig(compression=name, **base), True),
                  (f"{name} cost model", CommConfig(compression=name, **base, **cost),
                   True)]  # fmt: skip
    rows = []
    for label, cfg, overlap in plans:
        red = None if cfg is None else QuantizedAllReduce(cfg, None, rank, world, seed=0,
                                                          sizes=opt.sizes)  # fmt: skip
        counter = iter(range(10**6))
        early = []

        def step(red=red, overlap=overlap, counter=counter, early=early):
            k = next(counter)
            opt.zero_grad()
            loss = model(x).square().mean()
            if red is not None and overlap:
                live["round"] = red.begin(opt.flat_grad, k, average=True)
            loss.backward()
            if red is not None and overlap:
                early.append(live["round"].finish().early)
                live["round"] = None
            elif red is not None:
                red.allreduce_(opt.flat_grad, k, average=True)
            opt.step()

        seconds, wire = _timed(step, args.reps, args.iface)
        rows.append({
            "W": world, "step": label, "overlap": overlap, "ms": seconds * 1e3,
            "buckets": 0 if red is None else len(red.buckets),
            "sent_in_backward": early[-1] if early else 0, "wire_bytes": wire,
            "gradient_MB": opt.flat.numel() * 4 / 1e6,
        })  # fmt: skip
    return rows


def _message_latency(rank: int, world: int, args) -> float:
    """The cost model's alpha, measured: seconds of one quantized exchange of one chunk (two
    collectives and the codec's fixed work), the same on every rank (rank 0's, broadcast)."""
    cfg = CommConfig(compression="q8", warmup_steps=0, min_bucket_bytes=0, codec=args.codec)
    red = QuantizedAllReduce(cfg, None, rank, world)
    flat = torch.randn(256)
    seconds, _ = _timed(lambda: red.allreduce_(flat, 0), max(args.reps, 5), None)
    alpha = torch.tensor([seconds], dtype=torch.float64)
    dist.broadcast(alpha, src=0)
    return float(alpha)


# -- launching ranks -------------------------------------------------------------------------


def _run_ranks(
    world: int,
    sizes: list[int],
    reps: int,
    netns: bool,
    buckets: bool,
    link_gbps: float,
    timeout_s: float,
    compressions: list[str],
    extra: list[str],
    overlap: bool = False,
) -> list[dict]:
    port = 29614 if netns else _free_port()
    master = ADDR[0] if netns else "127.0.0.1"
    procs = []
    for rank in range(world):
        cmd = [sys.executable, __file__, "--worker", "--rank", str(rank), "--world", str(world),
               "--master", master, "--port", str(port), "--reps", str(reps),
               "--link-gbps", str(link_gbps), "--sizes", *map(str, sizes),
               "--compressions", *compressions, *extra]  # fmt: skip
        if buckets:
            cmd.append("--buckets")
        if overlap:
            cmd.append("--overlap")
        if netns:
            cmd = ["ip", "netns", "exec", NS[rank], *cmd, "--iface", VETH[rank]]
        else:
            cmd += ["--iface", "lo"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    line = next(s for s in outs[0].splitlines() if s.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, timeout=30)


def _make_link() -> None:
    existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    if any(name in existing.split() for name in NS):
        raise RuntimeError(f"network namespaces {NS} exist already; not touching them")
    for ns in NS:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", VETH[0], "netns", NS[0], "type", "veth", "peer", "name", VETH[1],
        "netns", NS[1])  # fmt: skip
    for ns, veth, addr in zip(NS, VETH, ADDR, strict=True):
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        _sh("ip", "-n", ns, "link", "set", veth, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")


def _set_rate(rate: str) -> None:
    for ns, veth in zip(NS, VETH, strict=True):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", veth, "root"],
                       capture_output=True, timeout=30)  # fmt: skip
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf",
            "rate", rate, "burst", "256kb", "latency", "50ms")  # fmt: skip


def _drop_link() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _overlap_main(args, payload: dict) -> None:
    """Part 4: W = 2 training steps on loopback and over each rate of --rates."""
    extra = ["--codec", args.codec]
    payload["overlap"] = {"loopback": _run_ranks(2, [0], args.reps, False, False, 10.0, 1800,
                                                 ["none"], extra, overlap=True)}  # fmt: skip
    print("-- W = 2, loopback")
    print_table(payload["overlap"]["loopback"])
    try:
        if args.rates and not args.no_netns:
            _make_link()
        for rate in args.rates if not args.no_netns else []:
            _set_rate(rate)
            gbps = _gbps(rate)
            rows = _run_ranks(2, [0], args.reps, True, False, gbps, 1800, ["none"], extra,
                              overlap=True)  # fmt: skip
            payload["overlap"][rate] = rows
            print(f"-- W = 2 over veth at {rate}")
            print_table(rows)
    finally:
        if args.rates and not args.no_netns:
            _drop_link()
    print("wrote", write_json(args.out, payload))


def _gbps(rate: str) -> float:
    if rate.endswith("gbit"):
        return float(rate.removesuffix("gbit"))
    return float(rate.removesuffix("mbit")) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 8_000_000])
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 3])
    ap.add_argument("--compressions", nargs="+", default=sorted({n for n, _ in COMPRESSIONS}))
    ap.add_argument("--no-buckets", action="store_true", help="skip per-bucket messages")
    ap.add_argument("--out", default="allreduce.json")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rates", nargs="*", default=["1gbit", "100mbit"])
    ap.add_argument("--no-netns", action="store_true")
    ap.add_argument("--no-codec", action="store_true")
    ap.add_argument("--codec", default="compiled", help="the ranks' codec kernels (see CODECS)")
    ap.add_argument("--codecs", nargs="+", default=["compiled", "eager"],
                    help="codec kernels timed in part 1")  # fmt: skip
    ap.add_argument(
        "--stages",
        type=int,
        nargs="+",
        default=[1, 8],
        help="pipeline_stages of the quantized exchanges (each value is a row)",
    )
    ap.add_argument("--codec-size", type=int, default=8_000_000)
    # worker mode (started by this script)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--master", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--iface", default=None)
    ap.add_argument("--buckets", action="store_true")
    ap.add_argument("--overlap", action="store_true",
                    help="part 4 only: training steps with the all-reduce after or during "
                         "backward (loopback and --rates)")  # fmt: skip
    ap.add_argument("--link-gbps", type=float, default=10.0)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    payload: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d")}
    if args.overlap:
        _overlap_main(args, payload)
        return
    if not args.no_codec:
        payload["codec"] = codec_throughput(args.codec_size, args.reps, args.codecs)
        print_table(payload["codec"])
    extra = ["--codec", args.codec, "--stages", *map(str, args.stages)]
    payload["loopback"] = []
    for world in args.worlds:
        payload["loopback"] += _run_ranks(world, args.sizes, args.reps, False,
                                          world == 2 and not args.no_buckets, 10.0, 900,
                                          args.compressions, extra)  # fmt: skip
    print_table([r for r in payload["loopback"] if "buckets" not in r])
    print_table([r for r in payload["loopback"] if "buckets" in r])
    if not args.no_netns and args.rates:
        payload["netns"] = {}
        try:
            _make_link()
            for rate in args.rates:
                _set_rate(rate)
                gbps = _gbps(rate)
                sizes = args.sizes if gbps >= 1 else [min(args.sizes)]
                rows = _run_ranks(2, sizes, 1 if gbps < 1 else args.reps, True,
                                  gbps >= 1 and not args.no_buckets, gbps, 1800,
                                  args.compressions, extra)  # fmt: skip
                payload["netns"][rate] = rows
                print(f"-- W = 2 over veth at {rate}")
                print_table([r for r in rows if "buckets" not in r])
                print_table([r for r in rows if "buckets" in r])
        finally:
            _drop_link()
    print("wrote", write_json(args.out, payload))


if __name__ == "__main__":
    main()
