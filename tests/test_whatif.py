"""The what-if model (`tidegraph.whatif`) on traces whose step structure is known exactly, and
its command line."""

from __future__ import annotations

import json

import pytest

from tidegraph import whatif
from tidegraph.jobs.whatif import main
from tidegraph.timeline import trace_document
from tidegraph.whatif import Setting, calibrate, predict, profile

# ms = a + b * slice events, per compute span
FIT = {"sample": (1.0, 0.01), "forward": (2.0, 0.05), "backward": (1.5, 0.04)}
A_SPANS = ("sample", "forward")


def synthetic(world: int, batch: int = 200, steps: int = 20, allreduce_ms: float = 1.0,
              exchange_ms: float = 0.8, tail_ms: float = 0.5, gap_ms: float = 2.0,
              slow: float = 0.0, grad_values: int = 250_000, bits: int = 32,
              exchange_bytes: int = 0, overlap: bool = False,
              spike_ms: float = 0.0) -> dict:  # fmt: skip
    """A trace of `steps` training steps of `world` ranks, built as the trainers run them:
    phase A (sample, forward), the exchange's start (an all-gather: waits for the slowest),
    backward, the all-reduce (waits for the slowest), the exchange's end, the optimizer; then
    `gap_ms` to the next step. Every slice is batch/world events (the last step's half);
    rank 0 computes `slow` times longer than the others; step 5's all-reduce takes `spike_ms`
    longer (a one-off, as a kernel's compile). The wall time is in otherData."""
    events, t = [], 0.0
    for rank in range(world):
        events.append({"name": "thread_name", "ph": "M", "pid": 100 + rank, "tid": 0,
                       "args": {"name": f"trainer {rank}"}})  # fmt: skip
    multi = world > 1
    for s in range(steps):
        size = batch if s < steps - 1 else batch // 2
        n = size / world
        scale = [1.0 + (slow if r == 0 else 0.0) for r in range(world)]
        a_ms = [sum(FIT[k][0] + FIT[k][1] * n for k in A_SPANS) * c for c in scale]
        b_ms = [(FIT["backward"][0] + FIT["backward"][1] * n) * c for c in scale]
        ex1 = exchange_ms / 2 * multi
        reduce_ms = allreduce_ms + (spike_ms if s == 5 else 0.0)
        step = max(a_ms) + ex1 + max(b_ms) + (reduce_ms + ex1) * multi + tail_ms
        for r in range(world):
            args = {"step": s, "pass": "train"}
            at = t
            for k in A_SPANS:
                ms = (FIT[k][0] + FIT[k][1] * n) * scale[r]
                events.append(_span(k, r, at, ms, {**args, "events": n}))
                at += ms
            if multi:
                wait = max(a_ms) - a_ms[r] + ex1
                extra = {"bytes": exchange_bytes} if exchange_bytes else {}
                events.append(_span("exchange", r, at, wait, {**args, "start": "gather",
                                                              **extra}))  # fmt: skip
                at += wait
            events.append(_span("backward", r, at, b_ms[r], {**args, "events": n}))
            at += b_ms[r]
            if multi:
                ar = max(b_ms) - b_ms[r] + reduce_ms
                wire = {"bytes": 33 * bits, "bytes_fp32": 32 * 32} if bits < 32 else {}
                events.append(_span("allreduce", r, at, ar, {**args, "bits": [bits], **wire}))
                events.append(_span("exchange", r, at + ar, ex1, {**args, "start": "wait"}))
                at += ar + ex1
            events.append(_span("optimizer", r, at, tail_ms, args))
            events.append(_span("step", r, t, step, {**args, "events": n, "global_size": size}))
        t += step + gap_ms
    compression = {32: "none", 8: "q8", 4: "q4"}[bits]
    return trace_document(events, {"grad_values": grad_values, "wall_s": t / 1e3,
                                   "steps": steps, "compression": compression,
                                   "overlap": overlap})  # fmt: skip


@pytest.fixture
def codec_2ms(monkeypatch):
    """This machine's codec, as the model measures it, fixed at 2 ms an encode and decode of
    the gradient (no compile, no timing in the tests)."""
    monkeypatch.setattr(whatif, "codec_seconds", lambda values, bits, threads=None: 0.002)


def _span(name, rank, at_ms, ms, args):
    return {"name": name, "cat": "step", "ph": "X", "ts": at_ms * 1e3, "dur": ms * 1e3,
            "pid": 100 + rank, "tid": 0, "args": dict(args)}  # fmt: skip


def _compute(n: float, world: int = 1) -> tuple[float, float]:
    return (sum(FIT[k][0] + FIT[k][1] * n for k in A_SPANS),
            FIT["backward"][0] + FIT["backward"][1] * n)  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_profile_reads_the_recorded_step_and_predicts_it_back(world):
    doc = synthetic(world)
    p = profile(doc)
    assert p.world == world and p.steps == 20
    for name, (a, b) in FIT.items():  # within one run: the last, half batch gives the slope
        fa, fb = p.fit[name]
        assert fa == pytest.approx(a, abs=1e-6) and fb == pytest.approx(b, abs=1e-8)
    assert p.spread_a == pytest.approx(1.0) and p.spread_b == pytest.approx(1.0)
    assert p.allreduce_ms == pytest.approx(1.0 if world > 1 else 0.0)
    assert p.exchange_ms == pytest.approx(0.8 if world > 1 else 0.0)
    assert p.tail_ms == pytest.approx(0.5)
    meta = doc["otherData"]
    assert p.period_ms == pytest.approx(meta["wall_s"] * 1e3 / meta["steps"])
    assert p.beyond_ms == pytest.approx(2.0)  # the gap between steps
    same = predict(p, Setting(trainers=world))
    # the prediction is of the mean step, the recorded period averages in the half batch
    assert same.step_ms == pytest.approx(p.period_ms, rel=0.02)


def test_a_one_off_step_is_not_a_steps_cost():
    """A one-off (over 5x the median step) does not count in its spans: its time stays in
    the period, between steps (a pass's first step, a compile: per pass or per run)."""
    plain, spiked = profile(synthetic(2)), profile(synthetic(2, spike_ms=5000.0))
    assert spiked.allreduce_ms == pytest.approx(plain.allreduce_ms)
    assert spiked.period_ms == pytest.approx(plain.period_ms + 5000.0 / 20)
    assert spiked.beyond_ms == pytest.approx(plain.beyond_ms + 5000.0 / 20)
    # a slower step that is not a one-off counts in full
    slower = profile(synthetic(2, spike_ms=20.0))
    assert slower.allreduce_ms == pytest.approx(1.0 + 20.0 / 20)


def test_runs_at_two_sizes_fix_compute_and_the_costs_that_grow_with_w():
    """Two recorded runs (W = 2 and 8, slices of 100 and 25 events) pool into one model: its
    compute fit is exact for each span, and costs that grow with W (here the gap between
    steps, 1 + 0.5 W ms) are a line in W; a prediction at W = 4 equals a recorded W = 4."""
    runs = {W: synthetic(W, steps=21, gap_ms=1.0 + 0.5 * W) for W in (2, 4, 8)}
    model = calibrate([profile(runs[2]), profile(runs[8])])
    for name, (a, b) in FIT.items():
        fa, fb = model.fit[name]
        assert fa == pytest.approx(a, rel=0.03) and fb == pytest.approx(b, rel=0.03)
    assert model.beyond[1] == pytest.approx(0.5, rel=0.03)
    # 1 ms recorded at both: at share 1, the mean of 1 / (1/2) and 1 / (7/8)
    assert model.allreduce_ms == pytest.approx((2.0 + 8 / 7) / 2)
    four = profile(runs[4])
    out = predict(model, Setting(trainers=4))
    # the ring's share: the recorded 1 ms per all-reduce at any W is not a ring's, so only
    # the compute, the tail and the gap are compared here
    parts = dict(out.path)
    a, b = _compute(four.global_batch / 4)
    assert parts["compute before backward"] == pytest.approx(a, rel=0.02)
    assert parts["backward"] == pytest.approx(b, rel=0.02)
    assert parts["between steps"] == pytest.approx(four.beyond_ms, rel=0.05)
    assert parts["optimizer, apply"] == pytest.approx(0.5, rel=1e-6)


def test_apply_grows_with_the_global_batch_and_a_shared_core_is_not_a_cost_of_w():
    """What a step costs beyond compute and transfers is u + v W + c x: c read from two
    batches at one W, x the slice inside the step and the global batch between steps
    (replicated state applies every slice's rows, so the linear rule pays it per global
    event); a W = 2 run whose trainers shared the box's cores (its `cpus`
    below trainers + driver) adds its waits, not W's cost, and is left out of u and v."""

    def run(world, batch, tail_ms, gap_ms, cpus):
        doc = synthetic(world, batch=batch, steps=21, tail_ms=tail_ms, gap_ms=gap_ms)
        doc["otherData"].update(backend="ray", cpus=cpus, threads=1)
        return profile(doc)

    small, large = run(1, 200, 0.5, 1.0, 2), run(1, 400, 0.7, 1.4, 2)
    shared = run(2, 200, 3.0, 4.0, 2)  # 2 trainers and the driver on 2 cores
    assert not small.contended and shared.contended
    assert not run(2, 200, 0.5, 1.0, 16).contended
    model = calibrate([small, shared, large])
    assert model.tail == pytest.approx((0.5 - 0.2, 0.0, 0.001), rel=0.03, abs=1e-6)
    assert model.beyond == pytest.approx((1.0 - 0.4, 0.0, 0.002), rel=0.03, abs=1e-6)
    assert any("shared cores" in note for note in model.notes)
    keep = dict(predict(model, Setting(trainers=8)).path)
    # the step's own part is of the slice, what comes after it of the whole batch
    assert keep["optimizer, apply"] == pytest.approx(0.3 + 0.001 * small.global_batch / 8,
                                                     rel=0.03)  # fmt: skip
    assert keep["between steps"] == pytest.approx(small.beyond_ms, rel=0.03)
    linear = dict(predict(model, Setting(trainers=8, scale_rule="linear")).path)
    assert linear["optimizer, apply"] == pytest.approx(0.3 + 0.001 * small.global_batch,
                                                       rel=0.03)  # fmt: skip
    assert linear["between steps"] == pytest.approx(0.6 + 0.002 * 8 * small.global_batch,
                                                    rel=0.03)  # fmt: skip
    # with no run that had a core a trainer, the shared one is all there is, and said
    alone = calibrate([shared])
    assert alone.tail[0] == pytest.approx(shared.tail_ms)
    assert any("every run shared cores" in note for note in alone.notes)
    # two runs of one batch (a compressed one's tail a little longer) fix no slope: their
    # mean slices differ by a pass's last batch only
    twin = run(1, 210, 0.6, 1.0, 2)
    near = calibrate([small, twin])
    assert near.tail[2] == 0.0 and near.beyond[2] == 0.0
    assert near.tail[0] == pytest.approx((small.tail_ms + twin.tail_ms) / 2)


def test_the_ring_scales_with_its_bytes_per_rank_and_stragglers_with_w():
    p = profile(synthetic(2, slow=0.2))
    assert p.spread_a == pytest.approx(1.2 / 1.1) and p.spread_b == pytest.approx(1.2 / 1.1)
    for W in (4, 8):
        parts = dict(predict(p, Setting(trainers=W)).path)
        share = (W - 1) / W / 0.5
        assert parts["all-reduce"] == pytest.approx(1.0 * share)
        assert parts["exchange"] == pytest.approx(0.8 * share)
    # more ranks, a slower slowest: the expected maximum of W draws grows with W
    a4 = dict(predict(p, Setting(trainers=4)).path)["compute before backward"]
    a4_even = _compute(p.global_batch / 4)[0]
    a8 = dict(predict(p, Setting(trainers=8)).path)["compute before backward"]
    a8_even = _compute(p.global_batch / 8)[0]
    assert a8 / a8_even > a4 / a4_even > 1.0


def test_a_slow_link_puts_the_all_reduce_on_the_critical_path_and_overlap_hides_it(codec_2ms):
    """Over a given link, a transfer takes the slower of its recorded time (copies, sums: the
    work the transfer is pipelined with) and its bytes at the link's rate, plus a latency per
    message."""
    p = profile(synthetic(2, grad_values=2_500_000, exchange_bytes=100_000))  # 10 MB fp32
    slow = predict(p, Setting(trainers=2, link_gbps=1.0, link_latency_us=100))
    wire = 10e6 * 8 / 1e9 * 1e3  # ms: 2(W-1)/W = 1 gradient's bytes at 1 Gbit/s
    assert dict(slow.path)["all-reduce"] == pytest.approx(max(1.0, wire) + 2 * 0.1)
    # the exchange: the peer's updates (100 kB for a mean slice; 0.8 ms recorded) and a message
    peer = 100_000 * (p.global_batch / 2) / p.slice_events * 8 / 1e9 * 1e3
    assert dict(slow.path)["exchange"] == pytest.approx(max(0.8, peer) + 0.1)
    assert slow.bottleneck == "all-reduce"
    fast = predict(p, Setting(trainers=2, link_gbps=100.0))  # the recorded work is slower
    assert dict(fast.path)["all-reduce"] == pytest.approx(1.0)
    q8 = predict(p, Setting(trainers=2, link_gbps=1.0, link_latency_us=100, compression="q8"))
    q8_bits = 8.25 / 32  # the codes and a chunk's offset and scale
    assert dict(q8.path)["all-reduce"] == pytest.approx(wire * q8_bits + 0.2)
    # measured here: encode its share and the reduced chunk, decode twice (1.75 at W = 2)
    assert dict(q8.path)["codec"] == pytest.approx(2.0 * (3 + 1 / 2) / 2)
    over = predict(p, Setting(trainers=2, link_gbps=1.0, link_latency_us=100, overlap=True))
    assert over.step_ms <= slow.step_ms


def test_a_recorded_compressed_run_gives_the_codec_its_cost():
    """A q8 run's all-reduce, beyond its bytes' share of the fp32 one, is the codec's time:
    predicting q8 from the fp32 run then uses it (not a measurement on this machine)."""
    plain, q8 = profile(synthetic(4)), profile(synthetic(4, allreduce_ms=4.0, bits=8))
    model = calibrate([plain, q8])
    assert model.allreduce_ms == pytest.approx(1.0 / 0.75)
    assert plain.bits == 32 and q8.bits == 8.25  # codes, and a chunk's offset and scale
    ops = {W: (3 + 1 / W) / 2 for W in (4, 8)}  # encode-and-decode passes a rank makes
    assert model.codec_ms[8] == pytest.approx((4.0 - 8.25 / 32) / ops[4])
    parts = dict(predict(model, Setting(trainers=4, compression="q8")).path)
    assert parts["all-reduce"] + parts["codec"] == pytest.approx(4.0)
    parts = dict(predict(model, Setting(trainers=8, compression="q8")).path)
    assert parts["all-reduce"] == pytest.approx(1.0 / 0.75 * 7 / 8 * 8.25 / 32)
    assert parts["codec"] == pytest.approx(model.codec_ms[8] * ops[8])


def test_the_command_line_prints_a_prediction_and_refuses_bad_input(tmp_path, capsys):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(synthetic(2)))
    other = tmp_path / "t8.json"
    other.write_text(json.dumps(synthetic(8)))
    assert main([str(trace), "--trainers", "2", "8"]) == 0
    out = capsys.readouterr().out
    assert "W = 2, 20 steps" in out and "W = 8:" in out and "bottleneck" in out
    assert "one slice size" in out  # the single run's caveat
    assert main([str(trace), "--trainers", "4", "--calibrate", str(other)]) == 0
    out = capsys.readouterr().out
    assert "W = 8, 20 steps" in out and "compute fitted over 2 slice sizes" in out
    assert main([str(tmp_path / "none"), "--trainers", "2"]) == 2
    assert "no such run directory" in capsys.readouterr().err
    trace.write_text(json.dumps(trace_document([])))
    assert main([str(trace), "--trainers", "2"]) == 2
    assert "no training step" in capsys.readouterr().err
    assert main([str(tmp_path / "t8.json"), "--trainers", "2", "--compression", "zip"]) == 2


def test_a_compressed_or_overlapped_run_alone_predicts_itself_back(codec_2ms):
    """Settings default to the recorded ones; a q8 run alone is its recorded all-reduce,
    codec included, until a prediction needs the split: then its codec as measured here and
    the rest bytes. An overlapped run's all-reduce is what backward left of it."""
    for doc in (synthetic(4, allreduce_ms=40.0, bits=8), synthetic(4, overlap=True)):
        p = profile(doc)
        assert predict(p, Setting(trainers=4)).step_ms == pytest.approx(p.period_ms, rel=0.02)
    q8 = calibrate([profile(synthetic(4, allreduce_ms=40.0, bits=8))])
    parts = dict(predict(q8, Setting(trainers=4)).path)
    assert parts["all-reduce"] == 40.0 and "codec" not in parts
    assert q8.allreduce_ms is None  # nothing measured yet
    fp32 = dict(predict(q8, Setting(trainers=4, compression="none")).path)
    bytes_ms = (40.0 - 2.0 * (3 + 1 / 4) / 2) / (0.75 * 8.25 / 32)  # fp32 at share 1
    assert "codec" not in fp32 and fp32["all-reduce"] == pytest.approx(bytes_ms * 0.75)
    eight = dict(predict(q8, Setting(trainers=8)).path)
    assert eight["codec"] == pytest.approx(2.0 * (3 + 1 / 8) / 2)
    assert eight["all-reduce"] == pytest.approx(bytes_ms * 7 / 8 * 8.25 / 32)


def test_a_compressed_runs_fp32_warm_up_steps_are_not_its_all_reduce():
    doc = synthetic(4, allreduce_ms=4.0, bits=8)
    for e in doc["traceEvents"]:  # the first 3 steps went fp32 (comm.warmup_steps), slower
        if e.get("name") == "allreduce" and e["args"]["step"] < 3:
            e["args"].update(bits=[32], bytes=1024, bytes_fp32=1024)
            e["dur"] += 3000.0
    p = profile(doc)
    assert p.bits == 8.25 and p.allreduce_ms == pytest.approx(4.0)


def test_exchange_bytes_and_a_run_without_peers():
    """The exchange's bytes per slice event come from every run with peers (not only the
    first); a W = 1 run alone says that no all-reduce or exchange was recorded."""
    one, four = synthetic(1), synthetic(4, exchange_bytes=50_000)
    model = calibrate([profile(one), profile(four)])
    assert model.exchange_per_event == pytest.approx(50_000 / profile(four).slice_events)
    alone = predict(profile(one), Setting(trainers=4))
    assert any("no run with peers" in a for a in alone.assumptions)
    assert dict(alone.path)["all-reduce"] == 0.0


def test_bad_settings_and_traces_are_refused(tmp_path, capsys):
    for bad in ({"link_gbps": 0}, {"link_gbps": -1.0}, {"link_latency_us": -5.0},
                {"link_gbps": float("inf")}):  # fmt: skip
        with pytest.raises(ValueError, match="link_"):
            Setting(trainers=2, **bad)
    doc = synthetic(2)
    for e in doc["traceEvents"]:
        if e.get("name") == "forward":
            del e["args"]["events"]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(doc))
    assert main([str(trace), "--trainers", "2"]) == 2
    assert "lack what they should carry" in capsys.readouterr().err
    trace.write_text(json.dumps(synthetic(2)))
    assert main([str(trace), "--trainers", "2", "--link-gbps", "0"]) == 2
    assert "link_gbps" in capsys.readouterr().err
    run = tmp_path / "run" / "timeline"
    run.mkdir(parents=True)
    (run / "00000.json").write_text("[]")
    assert main([str(tmp_path / "run"), "--trainers", "2"]) == 2
    assert "00000.json: not a trace file" in capsys.readouterr().err
