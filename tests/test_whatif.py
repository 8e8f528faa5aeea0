"""The what-if model (`tidegraph.whatif`) on traces whose step structure is known exactly, and
its command line."""

from __future__ import annotations

import json

import pytest

from tidegraph.jobs.whatif import main
from tidegraph.timeline import trace_document
from tidegraph.whatif import Setting, predict, profile

# ms = a + b * slice events, per compute span
FIT = {"sample": (1.0, 0.01), "forward": (2.0, 0.05), "backward": (1.5, 0.04)}


def synthetic(world: int, batch: int = 200, steps: int = 20, allreduce_ms: float = 1.0,
              post_ms: float = 2.0, grad_values: int = 250_000) -> dict:  # fmt: skip
    """A trace of `steps` training steps of `world` equal ranks: every slice is batch/world
    events (the last step's half), compute as FIT, an all-reduce of `allreduce_ms` once
    every rank is there, then `post_ms` (exchange half of it) to the next step."""
    events, t = [], 0.0
    for rank in range(world):
        events.append({"name": "thread_name", "ph": "M", "pid": 100 + rank, "tid": 0,
                       "args": {"name": f"trainer {rank}"}})  # fmt: skip
    for s in range(steps):
        size = batch if s < steps - 1 else batch // 2
        n = size / world
        compute = sum(a + b * n for a, b in FIT.values())
        for rank in range(world):
            args = {"step": s, "pass": "train"}
            at = t
            for name, (a, b) in FIT.items():
                ms = a + b * n
                events.append(_span(name, rank, at, ms, {**args, "events": n}))
                at += ms
            if world > 1:
                events.append(_span("allreduce", rank, at, allreduce_ms, {**args, "bits": [32]}))
                events.append(_span("exchange", rank, at + allreduce_ms, post_ms / 2, args))
            events.append(_span("step", rank, t, compute + allreduce_ms * (world > 1),
                                {**args, "events": n, "global_size": size}))  # fmt: skip
        t += compute + (allreduce_ms if world > 1 else 0.0) + post_ms
    return trace_document(events, {"grad_values": grad_values})


def _span(name, rank, at_ms, ms, args):
    return {"name": name, "cat": "step", "ph": "X", "ts": at_ms * 1e3, "dur": ms * 1e3,
            "pid": 100 + rank, "tid": 0, "args": dict(args)}  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_profile_reads_the_recorded_step_and_predicts_it_back(world):
    p = profile(synthetic(world))
    assert p.world == world and p.steps == 20
    for name, (a, b) in FIT.items():
        fa, fb = p.fit[name]
        assert fa == pytest.approx(a, abs=1e-6) and fb == pytest.approx(b, abs=1e-8)
    assert p.straggle == pytest.approx(1.0)
    assert p.allreduce_ms == pytest.approx(1.0 if world > 1 else 0.0)
    same = predict(p, Setting(trainers=world))
    assert same.step_ms == pytest.approx(p.period_ms, rel=1e-9)


def test_compute_scales_with_the_slice_and_the_ring_with_its_bytes_per_rank():
    p = profile(synthetic(2))
    n_at = {W: p.global_batch / W for W in (1, 2, 4, 8)}  # the mean step: 195 events
    compute = {W: sum(a + b * n_at[W] for a, b in FIT.values()) for W in n_at}
    post = p.post_ms  # the same after the all-reduce at any W, but the exchange
    for W in (1, 4, 8):
        out = predict(p, Setting(trainers=W))
        parts = dict(out.path)
        assert parts["compute before backward"] + parts["backward"] == pytest.approx(compute[W])
        ring = 0.0 if W == 1 else 1.0 * ((W - 1) / W) / 0.5
        assert parts["all-reduce"] == pytest.approx(ring)
        assert parts["exchange"] == pytest.approx(p.exchange_ms * ring)
        assert out.step_ms == pytest.approx(compute[W] + ring + post - p.exchange_ms
                                            + p.exchange_ms * ring)  # fmt: skip
    # linear scaling keeps each slice at the recorded size (a mean step's 97.5 events)
    lin = predict(p, Setting(trainers=8, scale_rule="linear"))
    assert dict(lin.path)["backward"] == pytest.approx(FIT["backward"][0] + FIT["backward"][1]
                                                       * p.global_batch / 2)  # fmt: skip


def test_a_slow_link_puts_the_all_reduce_on_the_critical_path_and_overlap_hides_it():
    p = profile(synthetic(2, grad_values=2_500_000))  # 10 MB of fp32 gradient
    slow = predict(p, Setting(trainers=2, link_gbps=1.0, link_latency_us=100))
    wire = 10e6 * 8 / 1e9 * 1e3 + 2 * 0.1  # ms: (2(W-1)/W = 1) x bytes / bandwidth + latency
    assert dict(slow.path)["all-reduce"] == pytest.approx(1.0 + wire)
    assert slow.bottleneck == "all-reduce"
    q8 = predict(p, Setting(trainers=2, link_gbps=1.0, link_latency_us=100, compression="q8"))
    assert dict(q8.path)["all-reduce"] == pytest.approx(0.25 + wire / 4 + 0.15, rel=1e-6)
    assert "codec" in dict(q8.path)
    over = predict(p, Setting(trainers=2, link_gbps=1.0, link_latency_us=100, overlap=True))
    assert over.step_ms <= slow.step_ms


def test_the_command_line_prints_a_prediction_and_refuses_bad_input(tmp_path, capsys):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(synthetic(2)))
    assert main([str(trace), "--trainers", "2", "8"]) == 0
    out = capsys.readouterr().out
    assert "recorded: W = 2" in out and "W = 8:" in out and "bottleneck" in out
    assert main([str(tmp_path / "none"), "--trainers", "2"]) == 2
    assert "no such run directory" in capsys.readouterr().err
    trace.write_text(json.dumps(trace_document([])))
    assert main([str(trace), "--trainers", "2"]) == 2
    assert "no training step" in capsys.readouterr().err
    assert main([str(tmp_path / "t.json"), "--trainers", "2", "--compression", "zip"]) == 2
