"""What-if: a recorded training step replayed under other settings (dPRO's idea, for
tidegraph's data-parallel step).

A step of W data-parallel trainers is a small dependency graph, which the recorded timeline
(`tidegraph.timeline`) measures span by span on every rank:

    per rank r: sample -> fetch -> forward -> updates        (phase A, local)
    all ranks:  the node-state exchange starts: an all-gather (waits for the slowest A)
    per rank r: backward                                     (phase B, local)
    all ranks:  all-reduce of the gradient (waits for the slowest B), the exchange's end
    per rank r: optimizer, apply; then the trainer's loop to the next step and the pass's
                own cost (dispatch, results) per step

so a step takes max_r A_r + exchange + max_r B_r + all-reduce + optimizer/apply, and a pass
adds what lies between steps. `profile` reads each of these from a trace (means over the
recorded steps; a one-off step, such as a kernel's compile, counts between steps):

- compute per span and rank as a + b * (slice events); the slowest rank of each phase over
  the mean (stragglers, twice a step: one barrier after each phase);
- the pure all-reduce and exchange: the last-arriving rank's spans (it waits for nobody);
- the rest of the step, and the period beyond it (the loop, a pass's cost per step).

One recorded run fixes all of this at one W. `calibrate` pools several recorded runs of the
same job (other W, other compression): compute's fixed part needs two slice sizes (one run
has one, but for a pass's last batch), and what a step costs beyond compute and transfers
(optimizer, apply, between steps) is u + v W + c x: x the slice for what a rank's step does
beyond its spans (the loss), the global batch B for what comes between steps (replicated
node state applies all B rows; a pass's own cost is shared by its steps, so its share grows
with B at a pass's events); c needs two sizes at one W, v (per-trainer dispatch) two W.
Runs whose trainers shared cores (`StepProfile.contended`) are left out of that where others
are given: what they add is the wait for a peer on the same core, not the cost of W.
`predict` rebuilds the step for W' trainers (global batch kept, or grown with W' under
`scale_rule: linear`), a link of B Gbit/s and L us latency (a transfer takes the slower of
its recorded time, the work it is pipelined with, and its bytes at B, plus L a message),
compression (bytes per value, and the codec's time: taken from a recorded compressed run,
else measured here) and overlap, and names the span on the critical path that takes
longest. Assumptions (stated in `Prediction.assumptions`): one trainer per core or GPU (no
sharing), stragglers spread as recorded, the shards not a bottleneck.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from tidegraph.timeline import trainer_step_spans

__all__ = ["PHASE_A", "PHASE_B", "Model", "Prediction", "Setting", "StepProfile", "calibrate",
           "codec_seconds", "predict", "profile"]  # fmt: skip

PHASE_A = ("sample", "fetch", "forward", "updates")  # a rank's spans before the exchange
PHASE_B = ("backward",)  # between the exchange's start and the all-reduce
_SIZES_APART = 1.2  # `_costs` reads a slope over x only from sizes this far apart
_ONE_OFF = 5.0  # a recorded step this many times the median is a one-off (see `profile`)
# bits a value costs on the wire: the codes and a chunk's fp32 offset and scale (64 bits a
# chunk of 256 values); adaptive: its narrowest default
_BITS = {"none": 32, "q8": 8.25, "q4": 4.25, "adaptive": 4.25}
_WIDTHS = (2, 4, 8)  # the codec's code widths


def _width(bits: float) -> int:
    """The codec's code width nearest `bits` a value (adaptive runs mix them)."""
    return min(_WIDTHS, key=lambda c: abs(c - bits))


@dataclass
class StepProfile:
    """What a recorded timeline says about a training step (times in milliseconds; means
    over the recorded steps with every rank recorded, one-offs left out)."""

    world: int
    global_batch: float  # events of a step
    slice_events: float  # a rank's mean slice
    span_ms: dict[str, float]  # a rank's mean time per compute span
    fit: dict[str, tuple[float, float]]  # span -> (a, b): ms = a + b * slice events
    spread_a: float  # the slowest rank's phase A over the mean rank's, per step (1: none)
    spread_b: float  # the same for phase B
    allreduce_ms: float  # pure all-reduce (the last arriver's span)
    exchange_ms: float  # pure exchange (the last arriver's spans)
    exchange_bytes: float  # a rank's node-state updates a step (0: not recorded)
    tail_ms: float  # the step after the all-reduce and exchange: optimizer, apply
    beyond_ms: float  # the period beyond the mean step: the loop, the pass's own cost
    period_ms: float  # a step's share of the wall time
    grad_bytes: int  # the gradient in fp32
    bits: float  # bits a value on the wire, bytes sent over fp32's (32: fp32)
    buckets: int
    overlap: bool
    steps: int
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def events_per_s(self) -> float:
        return self.global_batch / self.period_ms * 1e3

    @property
    def step_ms(self) -> float:
        return self.period_ms - self.beyond_ms

    @property
    def contended(self) -> bool:
        """Its trainers (and the driver) had fewer cores than threads: each waited for
        peers that shared its core, so what its steps cost beyond compute is not what W
        trainers with a core each pay (a recording without `cpus` is taken as not). `cpus`
        is the driver host's `os.cpu_count()`: right for one machine; a run over several
        nodes, or in a container with fewer cores than its host, is misjudged."""
        m = self.meta
        if m.get("backend") == "local" or not m.get("cpus"):
            return False
        return m["cpus"] < self.world * int(m.get("threads") or 1) + 1


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares a + b x with a, b >= 0 (a span neither gets cheaper with more events
    nor costs less than nothing); one distinct x: b = 0 (no slope can be read)."""
    xs = [x for x, _ in points]
    my = statistics.fmean(y for _, y in points)
    if len(set(xs)) < 2:
        return my, 0.0
    mx = statistics.fmean(xs)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    if b < 0:
        return my, 0.0
    if my - b * mx < 0:  # through the origin
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x in xs)
    return my - b * mx, b


def _through(fit: tuple[float, float], x: float, y: float) -> tuple[float, float]:
    """`fit`'s slope through the point (x, y) (an intercept >= 0; else through the origin)."""
    a, b = y - fit[1] * x, fit[1]
    return (a, b) if a >= 0 else (0.0, y / x if x else 0.0)


def _share(world: int) -> float:
    """A ring all-reduce's (and an all-gather's) bytes per rank, over the whole tensor."""
    return (world - 1) / world


def _expected_max(world: int) -> float:
    """E[max of `world` standard normal draws] (Blom's approximation): how far the slowest
    of W ranks lies above the mean, in standard deviations."""
    if world < 2:
        return 0.0
    return statistics.NormalDist().inv_cdf((world - 0.375) / (world + 0.25))


def _trainer_steps(doc: dict) -> dict:
    """step -> rank track -> span name -> [events], the training steps of trainer tracks."""
    steps: dict = defaultdict(lambda: defaultdict(dict))
    for _, e in trainer_step_spans(doc):
        steps[e["args"]["step"]][(e["pid"], e["tid"])].setdefault(e["name"], []).append(e)
    return steps


def _ms(spans: dict, name: str) -> float:
    return sum(e["dur"] for e in spans.get(name, ())) / 1e3


def profile(doc: dict) -> StepProfile:
    """The `StepProfile` of a trace document (`timeline.load_trace`), from its training steps
    with every rank recorded. A span without the args it should carry: ValueError."""
    try:
        return _profile(doc)
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"what-if: a training step's spans lack what they should carry "
                         f"({type(e).__name__}: {e})") from None  # fmt: skip


def _profile(doc: dict) -> StepProfile:
    steps = _trainer_steps(doc)
    world = max((len(ranks) for ranks in steps.values()), default=0)
    whole = {s: r for s, r in steps.items() if len(r) == world and all(
        "step" in spans and "forward" in spans for spans in r.values())}  # fmt: skip
    if not whole:
        raise ValueError("what-if: the trace holds no training step recorded on every trainer "
                         "(record with --timeline on the ray backend)")  # fmt: skip
    points: dict = defaultdict(list)
    per_step: dict = defaultdict(list)  # quantity -> one value per step
    sizes: list[float] = []
    bits, sent, wire = [32], [], []  # the exchange's bytes; the all-reduce's over fp32's
    meta = doc.get("otherData", {})
    compressed = meta.get("compression", "none") != "none"
    warm: set[int] = set()  # a compressed run's fp32 steps
    for _, ranks in sorted(whole.items()):
        a_ms, b_ms, step_ms = [], [], []
        for spans in ranks.values():
            n = spans["forward"][0]["args"]["events"]
            sizes.append(n)
            for name in (*PHASE_A, *PHASE_B):
                points[name].append((len(per_step["step"]), n, _ms(spans, name)))
            a_ms.append(sum(_ms(spans, k) for k in PHASE_A))
            b_ms.append(sum(_ms(spans, k) for k in PHASE_B))
            step_ms.append(_ms(spans, "step"))
        any_rank = next(iter(ranks.values()))
        per_step["batch"].append(any_rank["step"][0]["args"]["global_size"])
        for name in (*PHASE_A, *PHASE_B):
            per_step[name].append(statistics.fmean(_ms(spans, name) for spans in ranks.values()))
        per_step["a_max"].append(max(a_ms))
        per_step["a_mean"].append(statistics.fmean(a_ms))
        per_step["b_max"].append(max(b_ms))
        per_step["b_mean"].append(statistics.fmean(b_ms))
        ar = min((_ms(s, "allreduce") for s in ranks.values()), default=0.0) if world > 1 else 0
        ex = min(_ms(s, "exchange") for s in ranks.values()) if world > 1 else 0.0
        per_step["allreduce"].append(ar)
        per_step["exchange"].append(ex)
        per_step["step"].append(statistics.fmean(step_ms))
        per_step["tail"].append(statistics.fmean(step_ms) - max(a_ms) - max(b_ms) - ar - ex)
        if world > 1 and "allreduce" in any_rank:
            a = any_rank["allreduce"][0]["args"]
            if compressed and min(a.get("bits", [32])) >= 32:  # comm.warmup_steps go fp32
                warm.add(len(per_step["step"]) - 1)
            else:
                bits = a.get("bits", bits)
                if a.get("bytes_fp32"):
                    wire.append(a["bytes"] / a["bytes_fp32"])
        gathers = [e for e in any_rank.get("exchange", ()) if "bytes" in e.get("args", {})]
        if gathers:
            sent.append(sum(e["args"]["bytes"] for e in gathers))
    # one-off steps (a pass's first, a kernel's compile, a pause) are not what a step's spans
    # cost: a step over _ONE_OFF x the median counts as a median one in them, and its excess
    # stays in the period (between steps: a pass has such costs, per pass or per run)
    typical = statistics.median(per_step["step"])
    off = {i for i, ms in enumerate(per_step["step"]) if ms > _ONE_OFF * typical}
    med = {}
    for k, v in per_step.items():
        mid = statistics.median(v)
        med[k] = statistics.fmean(mid if i in off else x for i, x in enumerate(v))
    reduced = [x for i, x in enumerate(per_step["allreduce"]) if i not in warm | off]
    if reduced:  # a compressed run's all-reduce: its compressed steps'
        med["allreduce"] = statistics.fmean(reduced)
    period = _period_ms(doc, whole)
    span_ms = {name: med[name] for name in points}
    # fitted over the steps that are not one-offs, through the mean (what was recorded)
    n_mean = statistics.fmean(sizes)
    fit = {name: _through(_fit([(n, ms) for i, n, ms in pts if i not in off]), n_mean,
                          span_ms[name]) for name, pts in points.items()}  # fmt: skip
    return StepProfile(
        world=world, global_batch=statistics.fmean(per_step["batch"]),
        slice_events=statistics.fmean(sizes), span_ms=span_ms, fit=fit,
        spread_a=med["a_max"] / max(med["a_mean"], 1e-9),
        spread_b=med["b_max"] / max(med["b_mean"], 1e-9), allreduce_ms=med["allreduce"],
        exchange_ms=med["exchange"], exchange_bytes=statistics.fmean(sent) if sent else 0.0,
        tail_ms=max(med["tail"], 0.0),
        beyond_ms=max(period - med["step"], 0.0), period_ms=period,
        grad_bytes=4 * int(meta.get("grad_values", 0)), buckets=len(bits),
        bits=round(32 * statistics.fmean(wire), 2) if wire else min(bits),
        overlap=bool(meta.get("overlap", False)), steps=len(whole), meta=meta,
    )  # fmt: skip


def _period_ms(doc: dict, whole: dict) -> float:
    """A step's share of the wall time: the driver's "train pass" spans over their steps, or
    the wall time a benchmark measured (otherData wall_s, steps), else the mean time between
    a rank's consecutive recorded steps."""
    meta = doc.get("otherData", {})
    passes = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["name"] == "train pass"]
    n_steps = sum(e["args"].get("steps", 0) for e in passes)
    if n_steps:
        return sum(e["dur"] for e in passes) / 1e3 / n_steps
    if meta.get("wall_s") and meta.get("steps"):
        return meta["wall_s"] * 1e3 / meta["steps"]
    order = sorted(whole)
    starts = defaultdict(list)
    for s in order:
        for track, spans in whole[s].items():
            starts[track].append(spans["step"][0]["ts"])
    total_us = sum(ts[-1] - ts[0] for ts in starts.values())
    total_steps = (order[-1] - order[0]) * len(starts)
    return total_us / total_steps / 1e3 if total_steps else float("nan")


@dataclass
class Model:
    """Recorded runs of one job pooled into a cost model (`calibrate`); `base` is the run
    whose settings a prediction keeps unless told otherwise."""

    base: StepProfile
    fit: dict[str, tuple[float, float]]  # compute per span: ms = a + b * slice events
    cv_a: float  # a rank's phase-A time: standard deviation over the mean
    cv_b: float
    allreduce_ms: float | None  # the fp32 all-reduce at share 1 (None: compressed runs only)
    visible: bool  # that cost is what backward left of overlapped all-reduces
    exchange_ms: float  # the exchange's at share 1
    exchange_per_event: float  # bytes a rank sends in the exchange, per slice event
    tail: tuple[float, float, float]  # ms = u + v * W + c * slice events (`_costs`)
    beyond: tuple[float, float, float]  # ms = u + v * W + c * global batch
    codec_ms: dict[int, float]  # code width -> a recorded codec's ms, per `_codec_ops(W)`
    compressed: list[StepProfile]  # runs that split into bytes and codec only as needed
    notes: list[str]


def calibrate(profiles: list[StepProfile]) -> Model:
    """The cost model of `profiles` (the first is the base): see the module docstring."""
    base, notes = profiles[0], []
    sizes = {round(p.slice_events, 1) for p in profiles}
    if len(sizes) > 1:
        fit = {k: _fit([(p.slice_events, p.span_ms[k]) for p in profiles if k in p.span_ms])
               for k in base.span_ms}  # fmt: skip
        notes.append(f"compute fitted over {len(sizes)} slice sizes")
    else:
        fit = base.fit
        notes.append("compute fitted within one run (one slice size but a pass's last batch: "
                     "its fixed part is uncertain; add a run at another W)")  # fmt: skip
    multi = [p for p in profiles if p.world > 1]
    cv_a = statistics.fmean([(p.spread_a - 1) / _expected_max(p.world) for p in multi] or [0])
    cv_b = statistics.fmean([(p.spread_b - 1) / _expected_max(p.world) for p in multi] or [0])
    ex = statistics.fmean([p.exchange_ms / _share(p.world) for p in multi] or [0])
    per_event = statistics.fmean([p.exchange_bytes / p.slice_events for p in multi] or [0])
    # the all-reduce at share 1: fp32 bytes' cost, and a codec's beyond its bytes. The
    # overlapped runs' all-reduce is what backward did not hide: used only if nothing else
    whole = [p for p in multi if not p.overlap]
    visible = not whole and bool(multi)
    runs = whole or multi
    plain = [p for p in runs if p.bits >= 32]
    ar = statistics.fmean(p.allreduce_ms / _share(p.world) for p in plain) if plain else None
    ar = 0.0 if not runs else ar  # no run with peers: nothing recorded
    codec = _codec_split(runs, ar) if plain else {}
    # what a step costs beyond compute and transfers: from the runs that had a core a
    # trainer where there are such (a shared core's waits are not W's cost)
    alone = [p for p in profiles if not p.contended]
    pool = alone or profiles
    if alone and len(alone) < len(profiles):
        shared = sorted({p.world for p in profiles if p.contended})
        notes.append(
            f"costs beyond compute and transfers (optimizer, apply, between steps) "
            f"read from the runs with a core a trainer: W = {shared} shared cores"
        )
    if not alone:
        notes.append(
            "every run shared cores: costs beyond compute and transfers (optimizer, apply, "
            "between steps) include waits for a peer on the same core, read as W's cost"
        )
    if len({p.world for p in pool}) < 2:
        notes.append(
            "costs beyond compute and transfers read at one W: taken flat in W "
            "(bench_scaling.py --w-scan measures the optimizer and apply per W)"
        )
    if visible:
        notes.append("the all-reduce read from overlapped runs only: what backward left")
    if not multi:
        notes.append("no run with peers recorded: the all-reduce and the exchange cost only "
                     "what a given link adds")  # fmt: skip
    if base.meta.get("backend") == "local":
        notes.append("recorded on the local backend: gradients summed in the driver, no "
                     "all-reduce or exchange between trainers recorded")  # fmt: skip
    return Model(base=base, fit=fit, cv_a=cv_a, cv_b=cv_b, allreduce_ms=ar, exchange_ms=ex,
                 exchange_per_event=per_event, visible=visible,
                 tail=_costs(pool, "tail_ms", "slice_events"),
                 beyond=_costs(pool, "beyond_ms", "global_batch"), codec_ms=codec,
                 compressed=[] if plain else [p for p in runs if p.bits < 32],
                 notes=notes)  # fmt: skip


def _costs(runs: list[StepProfile], key: str, per: str) -> tuple[float, float, float]:
    """`key`'s (u, v, c) over `runs`: ms = u + v W + c x, x the run's `per` (its slice,
    for what a rank's step does with its own slice's events; the global batch, for what
    comes after the step: replicated node state applies every slice's rows, a pass's own cost
    is shared by its steps). c: the mean slope over x of the runs at each W recorded at
    sizes _SIZES_APART apart or more (0 where none is: runs of one batch differ by a pass's
    last batch, and their noise over so small a difference reads as a slope); then u + v W
    fitted to what is left (v 0 from one W)."""
    slopes = []
    for world in {p.world for p in runs}:
        same = [(getattr(p, per), getattr(p, key)) for p in runs if p.world == world]
        xs = [x for x, _ in same]
        if max(xs) >= _SIZES_APART * min(xs):  # a pass's last batch moves a run's mean
            slopes.append(_fit(same)[1])
    c = statistics.fmean(slopes) if slopes else 0.0
    u, v = _fit([(p.world, max(getattr(p, key) - c * getattr(p, per), 0.0)) for p in runs])
    return u, v, c


def _codec_ops(world: int) -> float:
    """A compressed all-reduce's codec work per rank, in encode-and-decode passes over the
    gradient: it encodes its share and then the reduced chunk (1 + 1/W gradients) and
    decodes twice (2), whatever W."""
    return (3 + 1 / world) / 2


def _codec_split(runs: list[StepProfile], ar: float) -> dict[int, float]:
    """Code width -> the codec's ms per `_codec_ops` unit: what compressed `runs` spent
    beyond their bytes at the fp32 cost `ar` (ms at share 1)."""
    out: dict = defaultdict(list)
    for p in runs:
        if p.bits < 32:
            extra = p.allreduce_ms - ar * _share(p.world) * p.bits / 32
            out[_width(p.bits)].append(max(extra, 0.0) / _codec_ops(p.world))
    return {w: statistics.fmean(v) for w, v in out.items()}


def _resolve(m: Model) -> None:
    """Compressed runs only: split their all-reduce into this machine's codec (measured now,
    when a prediction first needs it) and bytes, into `m`."""
    per_run = [max(p.allreduce_ms - _codec_here(p) * _codec_ops(p.world), 0.0)
               / (_share(p.world) * p.bits / 32) for p in m.compressed]  # fmt: skip
    m.allreduce_ms = statistics.fmean(per_run)
    m.codec_ms = _codec_split(m.compressed, m.allreduce_ms)
    m.notes.append("compressed runs only: their codec as measured here, the rest as bytes")


@dataclass(kw_only=True)
class Setting:
    trainers: int
    link_gbps: float | None = None  # None: the recorded link
    link_latency_us: float | None = None
    compression: str | None = None  # none, q8, q4, adaptive; None: as recorded
    overlap: bool | None = None  # None: as recorded
    scale_rule: str = "keep"  # keep the global batch, or "linear": grow it with W

    def __post_init__(self) -> None:
        if self.trainers < 1:
            raise ValueError(f"trainers must be >= 1, got {self.trainers}")
        if self.compression is not None and self.compression not in _BITS:
            raise ValueError(f"compression must be one of {', '.join(_BITS)}, got "
                             f"{self.compression!r}")  # fmt: skip
        if self.scale_rule not in ("keep", "linear"):
            raise ValueError(f"scale_rule must be keep or linear, got {self.scale_rule!r}")
        if self.link_gbps is not None and not (0 < self.link_gbps < math.inf):
            raise ValueError(f"link_gbps must be a rate > 0, got {self.link_gbps}")
        if self.link_latency_us is not None and not (0 <= self.link_latency_us < math.inf):
            raise ValueError(f"link_latency_us must be >= 0, got {self.link_latency_us}")


@dataclass
class Prediction:
    step_ms: float  # a step's share of the wall time (the period)
    events_per_s: float
    path: list[tuple[str, float]]  # the critical path's spans, in order, ms
    bottleneck: str
    assumptions: list[str]


_codec_cache: dict = {}


def codec_seconds(values: int, bits: int, threads: int | None = None) -> float:
    """Seconds to encode and decode `values` gradient values at `bits` on this machine (the
    stochastic-rounding codec the trainers use: compiled kernels, eager torch where they
    cannot compile) with `threads` torch threads (a trainer's), measured once per size."""
    key = (values, bits, threads)
    if key not in _codec_cache and values:
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            _measure_codec(key)
        finally:
            torch.set_num_threads(before)
    return _codec_cache.get(key, 0.0)


def _codec_here(p: StepProfile, bits: float | None = None) -> float:
    """ms of this machine's codec on `p`'s gradient at `bits` (default: `p`'s), share 1."""
    b = _width(bits if bits is not None else p.bits)
    return codec_seconds(p.grad_bytes // 4, b, p.meta.get("threads")) * 1e3


def _measure_codec(key: tuple) -> None:
    from tidegraph.comm.quantize import dequantize, quantize

    values, bits, _ = key
    x = torch.randn(values)
    gen = torch.Generator().manual_seed(0)
    for codec in ("compiled", "eager"):
        try:  # the first call compiles (or fails to)
            dequantize(quantize(x, bits, generator=gen, codec=codec), codec=codec)
        except RuntimeError:
            continue
        t0 = time.perf_counter()
        for _ in range(3):
            dequantize(quantize(x, bits, generator=gen, codec=codec), codec=codec)
        _codec_cache[key] = (time.perf_counter() - t0) / 3
        return


def _over_link(recorded_ms: float, nbytes: float, messages: int, s: Setting) -> float:
    """A transfer that took `recorded_ms` on the recorded link (copies, sums, the loopback),
    on the setting's: its `nbytes` at the link's rate overlap that work (the transfer is
    pipelined with it: the slower of the two), and each of `messages` adds the latency."""
    if s.link_gbps is None and s.link_latency_us is None:
        return recorded_ms
    gbps = s.link_gbps if s.link_gbps is not None else math.inf
    wire = nbytes * 8 / (gbps * 1e9) * 1e3
    return max(recorded_ms, wire) + messages * (s.link_latency_us or 0.0) / 1e3


def predict(m: Model | StepProfile, s: Setting) -> Prediction:
    """The step of `m` (a `Model`, or one profile) under setting `s`."""
    m = calibrate([m]) if isinstance(m, StepProfile) else m
    p, W = m.base, s.trainers
    batch = p.global_batch * (W / p.world if s.scale_rule == "linear" else 1.0)
    n = batch / W
    span = {k: max(a + b * n, 0.0) for k, (a, b) in m.fit.items()}
    phase_a = sum(span.get(k, 0.0) for k in PHASE_A) * (1 + m.cv_a * _expected_max(W))
    phase_b = sum(span.get(k, 0.0) for k in PHASE_B) * (1 + m.cv_b * _expected_max(W))
    recorded = p.meta.get("compression", "none")
    same = s.compression is None or s.compression == recorded
    bits = p.bits if same else _BITS[s.compression]
    overlap = p.overlap if s.overlap is None else s.overlap
    share = _share(W)
    ar = codec = exchange = 0.0
    as_recorded = same and W == p.world and s.link_gbps is None and not s.link_latency_us
    if W > 1 and m.allreduce_ms is None and as_recorded:  # the recorded all-reduce, codec in
        ar = p.allreduce_ms
    elif W > 1:
        if m.allreduce_ms is None:
            _resolve(m)
        ar = _over_link(m.allreduce_ms * share * bits / 32, 2 * share * p.grad_bytes * bits / 32,
                        2 * (W - 1), s)  # fmt: skip
        if bits < 32:  # a recorded codec's cost, else this machine's at a trainer's threads
            codec = m.codec_ms.get(_width(bits))
            codec = (_codec_here(p, bits) if codec is None else codec) * _codec_ops(W)
    if W > 1:  # an all-gather of every slice's updates: each rank receives (W-1) slices
        exchange = _over_link(m.exchange_ms * share, m.exchange_per_event * n * (W - 1), W - 1, s)
    path = [("compute before backward", phase_a), ("exchange", exchange)]
    if overlap and W > 1 and not m.visible:
        sync = ar + codec
        last = sync / max(p.buckets, 1)  # the last bucket leaves after backward
        path.append(("backward | all-reduce", max(phase_b, sync - last) + last))
    else:  # (read from overlapped runs, the all-reduce is already what backward left)
        path.append(("backward", phase_b))
        if codec:
            path.append(("codec", codec))
        path.append(("all-reduce", ar))
    tail = max(m.tail[0] + m.tail[1] * W + m.tail[2] * n, 0.0)
    beyond = max(m.beyond[0] + m.beyond[1] * W + m.beyond[2] * batch, 0.0)
    path += [("optimizer, apply", tail), ("between steps", beyond)]
    step = sum(ms for _, ms in path)
    link = ("as recorded" if s.link_gbps is None and s.link_latency_us is None else
            f"{s.link_gbps} Gbit/s, {s.link_latency_us or 0} us added")  # fmt: skip
    assumptions = [
        f"base: W = {p.world}, {p.steps} steps, global batch {p.global_batch:.0f}, "
        f"{p.period_ms:.2f} ms a step ({p.events_per_s:.0f} events/s)",
        f"one trainer per core or GPU; a rank's compute spread as recorded (cv {m.cv_a:.3f} "
        f"before the exchange, {m.cv_b:.3f} in backward)",
        f"link: {link}; gradient {p.grad_bytes / 1e6:.2f} MB fp32, {bits:g} bits on the wire"
        + (f", codec {codec:.2f} ms" if codec else ""),
        *m.notes,
    ]
    return Prediction(step_ms=step, events_per_s=batch / step * 1e3, path=path,
                      bottleneck=max(path, key=lambda x: x[1])[0],
                      assumptions=assumptions)  # fmt: skip
