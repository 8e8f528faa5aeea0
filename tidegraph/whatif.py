"""What-if: a recorded training step replayed under other settings (dPRO's idea, for
tidegraph's data-parallel step).

A step of W data-parallel trainers is a small dependency graph, which the recorded timeline
(`tidegraph.timeline`) measures span by span on every rank:

    per rank r: sample -> fetch -> forward -> updates -> backward      (compute_r, local)
    all ranks:  all-reduce of the gradient (waits for the slowest rank, then the ring)
    all ranks:  exchange of node-state updates, optimizer, apply, the pass loop   (post)

so the step takes max_r compute_r + all-reduce + post, and with `comm.overlap` the all-reduce
starts during backward. `profile` reads that from a trace:

- compute per span as a + b * (slice events), least squares over the recorded steps (slices
  differ: a pass's last batch, replayed events in retraining, the balancer's cuts), and the
  ratio of the slowest rank's compute to the mean (stragglers);
- the link: the pure all-reduce time of a step is the last-arriving rank's span (it waits for
  nobody); with the exchange's pure time (small messages: latency) this gives the ring's
  latency alpha and bandwidth beta (T = 2(W-1) alpha + 2(W-1)/W bytes / beta);
- the rest of the period (post) per step, with the exchange's share apart.

`predict` rebuilds the step for W' trainers (global batch kept, or grown with W' under
`scale_rule: linear`), a link of B Gbit/s and L us latency, compression (bytes per value and
the codec's time, measured here on the gradient's size) and overlap, and names the span on
the critical path that takes longest. Assumptions (stated in `Prediction.assumptions`): one
trainer per core or GPU (no sharing), stragglers as recorded, the shards not a bottleneck.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

__all__ = ["COMPUTE", "Prediction", "Setting", "StepProfile", "codec_seconds", "predict",
           "profile"]  # fmt: skip

COMPUTE = ("sample", "fetch", "forward", "updates", "backward")  # a rank's local spans
BITS = {"none": 32, "q8": 8, "q4": 4, "adaptive": 4}  # adaptive: its narrowest default


@dataclass
class StepProfile:
    """What a recorded timeline says about a training step (times in milliseconds)."""

    world: int
    global_batch: float  # mean events of a recorded step
    fit: dict[str, tuple[float, float]]  # span -> (a, b): ms = a + b * slice events
    straggle: float  # mean over steps of max_r compute_r / mean_r compute_r
    allreduce_ms: float  # pure all-reduce per step (mean of the last arriver's span)
    exchange_ms: float  # pure exchange per step
    post_ms: float  # the period after the all-reduce (exchange, a pass's own cost per step)
    period_ms: float  # mean time between a rank's step starts, plus a pass's cost per step
    grad_bytes: int  # the gradient in fp32
    buckets: int
    steps: int
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def events_per_s(self) -> float:
        return self.global_batch / self.period_ms * 1e3


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares a + b x; one distinct x: b = 0 (no slope can be read)."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return statistics.median(y for _, y in points), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def _ring_ms(world: int, nbytes: float, alpha_ms: float, beta_gbps: float) -> float:
    if world < 2:
        return 0.0
    wire = 2 * (world - 1) / world * nbytes * 8 / (beta_gbps * 1e9) * 1e3
    return 2 * (world - 1) * alpha_ms + wire


def profile(doc: dict) -> StepProfile:
    """The `StepProfile` of a trace document (`timeline.load_trace`), from its training steps
    with every rank recorded."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "thread_name"}  # fmt: skip
    steps: dict = defaultdict(lambda: defaultdict(dict))  # step -> rank track -> span -> [..]
    for e in doc["traceEvents"]:
        a = e.get("args", {})
        if e.get("ph") != "X" or e.get("cat") != "step" or a.get("pass") != "train":
            continue
        track = names.get((e["pid"], e["tid"]), "")
        if not track.startswith("trainer"):
            continue
        steps[a["step"]][(e["pid"], e["tid"])].setdefault(e["name"], []).append(e)
    world = max((len(ranks) for ranks in steps.values()), default=0)
    whole = {s: r for s, r in steps.items() if len(r) == world and all(
        "step" in spans and "forward" in spans for spans in r.values())}  # fmt: skip
    if not whole:
        raise ValueError("what-if: the trace holds no training step recorded on every trainer "
                         "(record with --timeline on the ray backend)")  # fmt: skip
    points: dict = defaultdict(list)
    straggle, pure_ar, pure_ex, batch, buckets = [], [], [], [], 1
    starts: dict = defaultdict(list)
    for _, ranks in sorted(whole.items()):
        compute = []
        for track, spans in ranks.items():
            n = spans["forward"][0]["args"]["events"]
            total = 0.0
            for name in COMPUTE:
                ms = sum(e["dur"] for e in spans.get(name, [])) / 1e3
                points[name].append((n, ms))
                total += ms
            compute.append(total)
            starts[track].append(spans["step"][0]["ts"])
        straggle.append(max(compute) / max(statistics.fmean(compute), 1e-9))
        batch.append(ranks[next(iter(ranks))]["step"][0]["args"]["global_size"])
        if world > 1:
            ar = [spans["allreduce"][0] for spans in ranks.values()]
            pure_ar.append(min(e["dur"] for e in ar) / 1e3)
            buckets = max(buckets, len(ar[0]["args"].get("bits", [1])))
            ex = [sum(e["dur"] for e in spans.get("exchange", [])) for spans in ranks.values()]
            pure_ex.append(min(ex) / 1e3)
    # the mean period, spikes included (a pass's wall time is their sum): between a rank's
    # consecutive recorded steps of one pass (the driver's pass spans; none: one pass)
    passes = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["name"] == "train pass"]
    order = sorted(whole)  # each track's starts were appended in this order
    total_us, total_steps = 0.0, 0
    for ts in starts.values():
        for i in range(len(ts) - 1):
            t0, t1 = ts[i], ts[i + 1]
            if passes and not any(p["ts"] <= t0 and t1 <= p["ts"] + p["dur"] for p in passes):
                continue
            total_us += t1 - t0
            total_steps += order[i + 1] - order[i]
    period = total_us / total_steps / 1e3 if total_steps else float("nan")
    fit = {name: _fit(pts) for name, pts in points.items()}
    # what a pass costs beside its steps (dispatch, the first step's inputs, results), per
    # step: the driver's "train pass" spans, or the wall time a benchmark measured
    meta = doc.get("otherData", {})
    wall_ms, n_steps = None, None
    if passes:
        wall_ms = sum(e["dur"] for e in passes) / 1e3
        n_steps = sum(e["args"].get("steps", 0) for e in passes)
    elif "wall_s" in meta and "steps" in meta:
        wall_ms, n_steps = meta["wall_s"] * 1e3, meta["steps"]
    pass_ms = max(wall_ms / n_steps - period, 0.0) if n_steps else 0.0
    g = statistics.fmean(batch)
    n_mean = g / world
    compute_ms = sum(a + b * n_mean for a, b in fit.values()) * statistics.fmean(straggle)
    ar_ms = statistics.fmean(pure_ar) if pure_ar else 0.0
    ex_ms = statistics.fmean(pure_ex) if pure_ex else 0.0
    post_ms = max(period - compute_ms - ar_ms, 0.0) + pass_ms
    grad_bytes = 4 * int(meta.get("grad_values", 0))
    return StepProfile(world=world, global_batch=g, fit=fit, straggle=statistics.fmean(straggle),
                       allreduce_ms=ar_ms, exchange_ms=ex_ms, post_ms=post_ms,
                       period_ms=period + pass_ms, grad_bytes=grad_bytes, buckets=buckets,
                       steps=len(whole), meta=meta)  # fmt: skip


@dataclass(kw_only=True)
class Setting:
    trainers: int
    link_gbps: float | None = None  # None: the recorded link
    link_latency_us: float | None = None
    compression: str = "none"  # none, q8, q4, adaptive
    overlap: bool = False
    scale_rule: str = "keep"  # keep the global batch, or "linear": grow it with W

    def __post_init__(self) -> None:
        if self.trainers < 1:
            raise ValueError(f"trainers must be >= 1, got {self.trainers}")
        if self.compression not in BITS:
            raise ValueError(f"compression must be one of {', '.join(BITS)}, got "
                             f"{self.compression!r}")  # fmt: skip
        if self.scale_rule not in ("keep", "linear"):
            raise ValueError(f"scale_rule must be keep or linear, got {self.scale_rule!r}")


@dataclass
class Prediction:
    step_ms: float
    events_per_s: float
    path: list[tuple[str, float]]  # the critical path's spans, in order, ms
    bottleneck: str
    assumptions: list[str]


_codec_cache: dict = {}


def codec_seconds(values: int, bits: int) -> float:
    """Seconds to encode and decode `values` gradient values at `bits` on this machine (the
    stochastic-rounding codec the trainers use), measured once per size."""
    key = (values, bits)
    if key not in _codec_cache and values:
        from tidegraph.comm.quantize import dequantize, quantize

        x = torch.randn(values)
        gen = torch.Generator().manual_seed(0)
        dequantize(quantize(x, bits, generator=gen, codec="eager"), codec="eager")  # warm
        t0 = time.perf_counter()
        for _ in range(3):
            dequantize(quantize(x, bits, generator=gen, codec="eager"), codec="eager")
        _codec_cache[key] = (time.perf_counter() - t0) / 3
    return _codec_cache.get(key, 0.0)


def _expected_max(world: int) -> float:
    """E[max of `world` standard normal draws] (Blom's approximation): how far the slowest
    of W ranks' compute lies above the mean, in standard deviations."""
    if world < 2:
        return 0.0
    from statistics import NormalDist

    return NormalDist().inv_cdf((world - 0.375) / (world + 0.25))


def predict(p: StepProfile, s: Setting) -> Prediction:
    """The step of `p` under setting `s` (see the module's docstring)."""
    W, R = s.trainers, p.world
    batch = p.global_batch * (W / R if s.scale_rule == "linear" else 1.0)
    n = batch / W
    # stragglers: the recorded spread of a rank's compute, as the max of W draws
    cv = (p.straggle - 1) / _expected_max(R) if R > 1 else 0.0
    straggle = 1 + cv * _expected_max(W)
    parts = {name: max(a + b * n, 0.0) * straggle for name, (a, b) in p.fit.items()}
    bits = BITS[s.compression]
    # the all-reduce: what the recorded one cost (copies, sums, the loopback) scaled with
    # the ring's bytes per rank, plus the wire of a given link
    share = (W - 1) / W / ((R - 1) / R) if R > 1 else 0.0
    software = p.allreduce_ms * share * bits / 32 if W > 1 else 0.0
    wire = 0.0
    if W > 1 and (s.link_gbps is not None or s.link_latency_us is not None):
        latency = (s.link_latency_us or 0.0) / 1e3
        gbps = s.link_gbps if s.link_gbps is not None else float("inf")
        wire = _ring_ms(W, p.grad_bytes * bits / 32, latency, gbps)
    codec = codec_seconds(p.grad_bytes // 4, bits) * 1e3 if bits < 32 and W > 1 else 0.0
    comm = software + wire
    # the exchange: an all-gather of the slices' updates (fixed in all): each rank receives
    # and unpacks (W-1)/W of them, one message per peer on a given link
    exchange = p.exchange_ms * share
    if W > 1 and s.link_latency_us is not None:
        exchange += (W - 1) * s.link_latency_us / 1e3
    rest = max(p.post_ms - p.exchange_ms, 0.0)
    before = sum(ms for k, ms in parts.items() if k != "backward")
    backward = parts.get("backward", 0.0)
    if s.overlap and W > 1:
        sync = comm + codec
        tail = sync / max(p.buckets, 1)  # the last bucket leaves after backward
        path = [("compute before backward", before),
                ("backward | all-reduce", max(backward, sync - tail) + tail)]  # fmt: skip
    else:
        path = [("compute before backward", before), ("backward", backward)]
        if codec:
            path.append(("codec", codec))
        path.append(("all-reduce", comm))
    path += [("exchange", exchange), ("optimizer, apply, loop", rest)]
    step = sum(ms for _, ms in path)
    link = ("as recorded" if wire == 0.0 else
            f"{s.link_gbps} Gbit/s, {s.link_latency_us or 0} us added")  # fmt: skip
    assumptions = [
        f"recorded: W = {R}, {p.steps} steps, global batch {p.global_batch:.0f}, period "
        f"{p.period_ms:.2f} ms ({p.events_per_s:.0f} events/s)",
        f"one trainer per core or GPU; a rank's compute spread as recorded (cv {cv:.3f})",
        f"link: {link}; gradient {p.grad_bytes / 1e6:.2f} MB fp32, {bits} bits on the wire"
        + (f", codec {codec:.2f} ms measured here" if codec else ""),
    ]
    return Prediction(
        step_ms=step,
        events_per_s=batch / step * 1e3,
        path=path,
        bottleneck=max(path, key=lambda x: x[1])[0],
        assumptions=assumptions,
    )
