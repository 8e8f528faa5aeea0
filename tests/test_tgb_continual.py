"""TGB's protocol in continual runs (`eval.protocol: tgb` without `--mode offline`): phase 1's
validation and every increment scored one positive against its block's hist_rnd negatives,
the history every event learned before the block, MRR and Hits@k by TGB's rank rule; checked
against `HistRndNegatives` and `tgb_metrics` computed here from the events themselves, and a
run resumed from the middle of an increment's evaluation against the uninterrupted one. (On
both backends through the job: test_backends' flags job.)"""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch.nn.functional import pad

from tidegraph.rng import seed_for
from tidegraph.training import ContinualLearner, RunConfig, load_stream
from tidegraph.training.metrics import link_metrics
from tidegraph.training.tgb import HistRndNegatives, tgb_metrics

K, PREFIX = 40, 250  # negatives a positive; scored positives a block (250: not a batch edge)
RAW = {
    "model": {"name": "tgn", "dim": 32, "time_dim": 16, "memory_dim": 32},
    "data": {"max_events": 2400},
    "train": {"batch_size": 200, "epochs": 1},
    "continual": {
        "num_increments": 2,
        "forget_sample": 100,
        "train_fraction": 0.5,
        "val_fraction": 0.3,
    },
    "eval": {"protocol": "tgb", "negatives": K, "hist_ratio": 0.4, "hits_k": 5, "prefix": PREFIX},
    "progress": False,
}


def config(**cluster) -> RunConfig:
    raw = json.loads(json.dumps(RAW))
    raw["cluster"] = cluster
    return RunConfig.from_dict(raw)


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", RAW["data"]["max_events"])


def spied(learner: ContinualLearner) -> list[tuple]:
    """The group's evaluation calls that record their events (not the forgetting probes), as
    (first eid, negatives, positive and negative scores)."""
    calls = []
    step = learner.group.eval_step

    def eval_step(ev, neg, observe):
        p, n = step(ev, neg, observe)
        if observe:
            calls.append((int(ev.eid[0]), neg.clone(), p.clone(), n.clone()))
        return p, n

    learner.group.eval_step = eval_step
    return calls


@pytest.mark.parametrize("cluster", [{}, {"shards": 2, "trainers": 2, "memory": "sharded"}])
def test_each_block_is_scored_against_the_events_before_it(wiki, cluster):
    cfg = config(**cluster)
    learner = ContinualLearner(cfg, wiki)
    calls = spied(learner)
    learner.run()
    ev = learner.events
    blocks = [(-1, learner.val_start, learner.phase1_end, 0),
              *((k, lo, hi, lo) for k, (lo, hi) in enumerate(learner.bounds))]  # fmt: skip
    records = [r for r in learner.history if r["phase"] == "increment"]
    phase1 = learner.history[0]
    for k, lo, hi, history_end in blocks:
        # phase 1's validation: its history is phase 1's training part
        hist_end = learner.val_start if k < 0 else history_end
        sampler = HistRndNegatives(ev.src[:hist_end], ev.dst[:hist_end], int(ev.dst[:hi].min()),
                                   int(ev.dst[:hi].max()), K, 0.4,
                                   seed_for(cfg.seed, "tgb negatives", k + 1))  # fmt: skip
        want, valid = sampler.sample(ev.src[lo:hi], ev.dst[lo:hi], ev.t[lo:hi])
        mine = [c for c in calls if lo <= c[0] < hi]
        if k < 0:  # one validation pass
            assert len(mine) == -(-(hi - lo) // 200)
        # each row: K hist_rnd negatives (a positive past the prefix: its own destination),
        # then one uniform negative, which AP and AUC are measured against
        width = [c[1].shape[1] for c in mine]
        assert width == [K + 1 if c[0] < lo + PREFIX else 2 for c in mine]
        neg = torch.cat([pad(c[1][:, :-1], (0, K + 1 - c[1].shape[1])) for c in mine])
        assert torch.equal(neg[:PREFIX], want[:PREFIX])
        assert torch.equal(neg[PREFIX:, 0], ev.dst[lo + PREFIX : hi])
        pos = torch.cat([c[2] for c in mine])
        uniform = torch.cat([c[3][:, -1:] for c in mine])
        scores = torch.cat([pad(c[3][:, :-1], (0, K + 1 - c[3].shape[1])) for c in mine])
        got = phase1 if k < 0 else records[k]
        prefix = "val_" if k < 0 else ""
        ref = tgb_metrics(pos[:PREFIX], scores[:PREFIX], valid[:PREFIX], 5)
        assert got[f"{prefix}mrr"] == ref["mrr"] and got[f"{prefix}hits@5"] == ref["hits@5"]
        assert got[f"{prefix}positives"] == PREFIX and 0 < ref["mrr"] < 1
        sampled = link_metrics(pos, uniform)  # every event of the block, as forgetting's AP
        assert got[f"{prefix}ap"] == sampled["ap"] and got[f"{prefix}auc"] == sampled["auc"]
    # the learner's history after the run: every pair learned, not only a window's
    keys = torch.unique((ev.src.long() << 32) | ev.dst.long())
    assert torch.equal(learner.evaluation.seen.keys, keys)
    summary = learner.summary()
    assert summary["mrr"] == sum(r["mrr"] for r in records) / len(records)
    assert summary["hits@5"] == sum(r["hits@5"] for r in records) / len(records)
    assert summary["protocol"] == {"name": "tgb", "negatives": K, "hist_ratio": 0.4,
                                   "prefix": PREFIX}  # fmt: skip


def untimed(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in history]


def test_a_run_resumed_inside_an_increments_evaluation_ends_the_same(wiki):
    """A checkpoint between two evaluation batches of increment 2 (past its prefix: the
    draw is made again from the saved history), loaded into a new learner."""
    cfg = config()
    full = ContinualLearner(cfg, wiki)
    full.run()
    part = ContinualLearner(cfg, wiki)
    part.run_phase1()
    part.step()
    lo = part.bounds[1][0]
    while True:  # up to the eval batch that holds the prefix's last positive
        unit = part.schedule.unit(part.cursor.unit)
        if unit.kind == "eval" and unit.lo >= lo + PREFIX - 200:
            break
        part.run_unit(unit)
    buffer = io.BytesIO()
    torch.save(part.state_dict(), buffer)
    resumed = ContinualLearner(cfg, wiki)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert resumed.evaluation.draw is None and torch.equal(
        resumed.evaluation.seen.keys, part.evaluation.seen.keys
    )
    while not resumed.done:
        resumed.step()
    assert untimed(resumed.history) == untimed(full.history)
