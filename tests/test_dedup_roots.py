"""Each distinct (node, time) root of a batch is sampled and embedded once (`root_dedup`).

What is exact: the blocks of the distinct roots, gathered through `root_index`, are the blocks
of every root, and the models' logits are bitwise those of embedding every root (each row's
arithmetic is the same; on this CPU build the matrix products give each row the same bits
whatever the number of rows). What is not: the gradient of the gather sums the duplicates' rows
before the layers' backward, so gradients agree within float tolerance, and so do the runs.
"""

from __future__ import annotations

import pytest
import torch

from tidegraph.models.base import link_roots
from tidegraph.models.config import ModelConfig, build_model
from tidegraph.runtime import set_determinism
from tidegraph.sampling import TemporalSampler
from tidegraph.storage import DynamicGraph
from tidegraph.storage.events import EventBatch
from tidegraph.training import ContinualLearner, RunConfig
from tidegraph.training.config import SamplerConfig
from tidegraph.training.data import stream_of
from tidegraph.training.sampling import sample_options

METRICS = ("ap", "auc", "mrr", "loss", "val_ap")
NAMES = ("dst_ids", "dst_ts", "nbr_ids", "nbr_ts", "nbr_eids", "dt", "mask")


def _hub_events(n: int = 3000, seed: int = 1) -> EventBatch:
    """A hub-heavy stream: 8 senders, 32 receivers, 7 events per timestamp."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 8, (n,), generator=gen)
    dst = torch.randint(8, 40, (n,), generator=gen)
    t = (torch.arange(n) // 7).double()
    return EventBatch(src, dst, t, torch.arange(n), None, None)


@pytest.fixture(scope="module")
def hub():
    ev = _hub_events()
    graph = DynamicGraph()
    for lo in range(0, 3000, 1000):
        b = ev.select(slice(lo, lo + 1000))
        graph.add_edges(b.src, b.dst, b.t, b.eid)
    return ev, graph


def _batch(ev, lo=2000, b=200, q=1, seed=2):
    gen = torch.Generator().manual_seed(seed)
    part = ev.select(slice(lo, lo + b))
    neg = torch.randint(8, 40, (b, q), generator=gen)
    return part, neg


@pytest.mark.parametrize("snaps", [1, 3])
def test_distinct_roots_blocks_gathered_back_are_every_roots_blocks(hub, snaps):
    ev, graph = hub
    part, neg = _batch(ev)
    roots, ts = link_roots(part.src, part.dst, neg, part.t)
    sampler = TemporalSampler(graph, [5], num_snapshots=snaps,
                              snapshot_window=40.0 if snaps > 1 else 0.0)  # fmt: skip
    full, dedup = sampler.sample(roots, ts), sampler.sample(roots, ts, dedup_roots=1.0)
    windows = (full, dedup) if snaps > 1 else ([full], [dedup])
    for a_w, b_w in zip(*windows, strict=True):
        a, b = a_w[0], b_w[0]
        assert a.root_index is None and b.root_index is not None
        assert b.num_roots < 0.8 * a.num_roots  # the hub stream repeats roots
        for name in NAMES:
            assert torch.equal(getattr(a, name), getattr(b, name)[b.root_index]), name


def test_the_ratio_decides_whether_roots_are_deduplicated(hub):
    ev, graph = hub
    part, neg = _batch(ev)
    roots, ts = link_roots(part.src, part.dst, neg, part.t)
    sampler = TemporalSampler(graph, [5])
    distinct = sampler.sample(roots, ts, dedup_roots=1.0)[0].num_roots
    share = distinct / roots.shape[0]
    assert sampler.sample(roots, ts, dedup_roots=share)[0].root_index is not None
    assert sampler.sample(roots, ts, dedup_roots=share * 0.99)[0].root_index is None


def _model(name: str):
    torch.manual_seed(0)
    raw = {"name": name, "dim": 16, "slot_precision": "fp32"}
    if name != "sage":
        raw |= {"time_dim": 8}
    if name == "tgn":
        raw |= {"memory_dim": 16}
    snaps = 3 if name == "dysat" else 1
    return build_model(ModelConfig(**raw), 40, 0, num_snapshots=snaps), snaps


@pytest.mark.parametrize("name", ["tgn", "tgat", "sage", "dysat"])
def test_logits_are_bitwise_and_gradients_within_float_tolerance(hub, name):
    ev, graph = hub
    model, snaps = _model(name)
    assert model.root_dedup
    part, neg = _batch(ev, q=3)
    roots, ts = link_roots(part.src, part.dst, neg, part.t)
    sampler = TemporalSampler(graph, [5] * model.num_layers, num_snapshots=snaps,
                              snapshot_window=40.0 if snaps > 1 else 0.0, dedup=True)  # fmt: skip
    out = []
    for ratio in (None, 1.0):
        blocks = sampler.sample(roots, ts, dedup_roots=ratio)
        model.zero_grad()
        pos, negl = model.score(part.src, part.dst, neg, part.t, blocks)
        (pos.sum() + negl.square().sum()).backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        out.append((pos.detach(), negl.detach(), grads))
        model.discard()
    (pos_a, neg_a, g_a), (pos_b, neg_b, g_b) = out
    assert torch.equal(pos_a, pos_b) and torch.equal(neg_a, neg_b)
    assert g_a.keys() == g_b.keys()
    for k in g_a:  # relative to each tensor's scale (mathematically zero ones: key biases)
        scale = max(float(g_a[k].abs().max()), 0.1)
        torch.testing.assert_close(g_a[k], g_b[k], rtol=0, atol=1e-5 * scale, msg=k)


def test_options_follow_the_config_and_the_model():
    tgn, _ = _model("tgn")
    apan = build_model(ModelConfig(name="apan", dim=16, time_dim=8, memory_dim=16), 40, 0)
    t = 3.0  # the batch's start
    assert sample_options(SamplerConfig(), tgn, t) == {"t_cap": None, "dedup_roots": 0.9}
    assert sample_options(SamplerConfig(), apan, t)["dedup_roots"] is None  # z[:2b] is rows
    assert sample_options(SamplerConfig(strategy="uniform"), tgn, t)["dedup_roots"] is None
    uniform_always = SamplerConfig(strategy="uniform", root_dedup="always")
    assert sample_options(uniform_always, tgn, t)["dedup_roots"] == 1.0
    assert sample_options(SamplerConfig(root_dedup="never"), tgn, t)["dedup_roots"] is None
    batch = SamplerConfig(history="batch")
    assert sample_options(batch, tgn, t)["t_cap"] == 3.0
    assert sample_options(batch, tgn, None)["t_cap"] is None  # replayed events alone
    with pytest.raises(ValueError, match="sampler.root_dedup"):
        SamplerConfig(root_dedup="on")


def _run(dedup: str, model: str) -> tuple[dict, list]:
    set_determinism(7, threads=1)
    raw = {
        "model": {"name": model, "dim": 16, "time_dim": 8, "memory_dim": 16,
                  "slot_precision": "fp32"},
        "sampler": {"root_dedup": dedup},
        "train": {"batch_size": 200, "epochs": 2, "eval_negatives": 3},
        "continual": {"num_increments": 1, "train_fraction": 0.7},
        "progress": False,
        "out_dir": None,
        "seed": 7,
    }  # fmt: skip
    learner = ContinualLearner(RunConfig.from_dict(raw), stream_of(_hub_events(2000), "hub"))
    learner.run()
    return learner.model.state_dict(), learner.history


@pytest.mark.parametrize("model", ["tgn", "tgat"])
def test_a_run_with_distinct_roots_matches_one_without_within_float_tolerance(model):
    state_a, hist_a = _run("never", model)
    state_b, hist_b = _run("always", model)
    for k in state_a:
        torch.testing.assert_close(state_a[k], state_b[k], rtol=1e-3, atol=1e-4, msg=k)
    for a, b in zip(hist_a, hist_b, strict=True):
        for key in ("ap", "auc", "val_ap"):
            if key in a:
                assert abs(a[key] - b[key]) < 2e-3, (key, a[key], b[key])


@pytest.mark.parametrize("model", ["tgn", "tgat"])
def test_auto_on_a_stream_that_repeats_roots_is_always_bitwise(model):
    """Every hub batch repeats roots: `auto` deduplicates each of them, as `always` does."""
    state_a, hist_a = _run("always", model)
    state_b, hist_b = _run("auto", model)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    for a, b in zip(hist_a, hist_b, strict=True):
        assert {k: a.get(k) for k in METRICS} == {k: b.get(k) for k in METRICS}
