"""TGB's link-prediction protocol (`tidegraph.training.tgb`) against py-tgb's own code: the
split equals its `generate_splits`, the hist_rnd negatives follow its `NegativeEdgeGenerator`
(the same counts for every positive, the same negatives wherever the rule leaves no choice),
MRR and Hits@10 equal its `Evaluator`'s; EdgeBank against TGB's rules written out plainly.
(An offline run with `eval.protocol: tgb` on both backends: test_backends.)"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tgb.linkproppred import dataset as tgb_dataset  # py-tgb: the test extra's reference
from tgb.linkproppred.evaluate import Evaluator
from tgb.linkproppred.negative_generator import NegativeEdgeGenerator
from torch_geometric.data import TemporalData

from tidegraph.models.edgebank import EdgeBank
from tidegraph.training import tgb
from tidegraph.training.tgb import (
    HistRndNegatives,
    SeenPairs,
    edgebank_tgb,
    tgb_bounds,
    tgb_metrics,
)

sys.path.insert(0, str(Path(__file__).parent))


def stream(n: int, sources: int, first_dst: int, n_dst: int, seed: int, dup_times: bool = True):
    """A time-ordered stream of `n` events with no repeated (src, dst, t) (TGB keys its
    negatives by them); times repeat, so some positives share their source and time."""
    g = torch.Generator().manual_seed(seed)
    t = torch.sort(torch.randint(0, n // 3 if dup_times else 10 * n, (n,), generator=g)).values
    src = torch.randint(0, sources, (n,), generator=g)
    # a few heavy sources, so that some have more history than hist_ratio * k
    heavy = torch.rand(n, generator=g) < 0.4
    src[heavy] = src[heavy] % 3
    dst = first_dst + torch.randint(0, n_dst, (n,), generator=g)
    keys = (src * 10_000 + (dst - first_dst)) * 100_000 + t
    _, first = np.unique(keys.numpy(), return_index=True)
    keep = torch.from_numpy(np.sort(first))
    return src[keep], dst[keep], t[keep]


@pytest.mark.parametrize("ts_seed", [0, 1, 2])
def test_the_split_is_tgbs(ts_seed):
    g = torch.Generator().manual_seed(ts_seed)
    t = torch.sort(torch.randint(0, 50 + 200 * ts_seed, (1001,), generator=g)).values.double()
    train_end, val_end = tgb_bounds(t)
    train, val, test = tgb_dataset.LinkPropPredDataset.generate_splits(
        None, {"timestamps": t.numpy()}, val_ratio=0.15, test_ratio=0.15
    )
    assert (train_end, val_end - train_end, len(t) - val_end) == (
        int(train.sum()), int(val.sum()), int(test.sum()))  # fmt: skip
    assert train[:train_end].all() and val[train_end:val_end].all() and test[val_end:].all()


def tgb_negatives(tmp_path, hist, pos, first, last, k, hist_ratio):
    """py-tgb's hist_rnd negatives for `pos` with history `hist`: {(s, d, t): array}."""
    as_data = lambda s, d, t: TemporalData(src=s, dst=d, t=t, msg=torch.zeros(len(s), 1))  # noqa: E731
    gen = NegativeEdgeGenerator("toy", first, last, num_neg_e=k, strategy="hist_rnd",
                                rnd_seed=5, hist_ratio=hist_ratio,
                                historical_data=as_data(*hist))  # fmt: skip
    gen.generate_negative_samples(as_data(*pos), "test", str(tmp_path))
    with open(tmp_path / "toy_test_ns.pkl", "rb") as f:
        return pickle.load(f)


# (destinations, k, whether rows with no choice occur, whether rows with a choice occur)
NEGATIVE_CASES = [(12, 20, True, True), (40, 20, False, True), (300, 20, False, True),
                  (300, 60, False, True), (1000, 999, True, False)]  # fmt: skip


@pytest.mark.parametrize("n_dst, k, some_forced, some_free", NEGATIVE_CASES)
def test_hist_rnd_negatives_follow_tgbs_generator(tmp_path, n_dst, k, some_forced, some_free):
    first = 30
    src, dst, t = stream(900, 30, first, n_dst, seed=n_dst + k)
    cut = 600
    hist, pos = (src[:cut], dst[:cut], t[:cut]), (src[cut:], dst[cut:], t[cut:])
    last = first + n_dst - 1
    theirs = tgb_negatives(tmp_path, hist, pos, first, last, k, 0.5)
    neg, valid = HistRndNegatives(*hist[:2], first, last, k, 0.5, seed=3).sample(*pos)
    again = HistRndNegatives(*hist[:2], first, last, k, 0.5, seed=3).sample(*pos)
    assert torch.equal(neg, again[0]) and torch.equal(valid, again[1])  # seeded
    seen = {}
    for s, d in zip(hist[0].tolist(), hist[1].tolist(), strict=True):
        seen.setdefault(s, set()).add(d)
    same = {}
    for s, d, tt in zip(*(x.tolist() for x in pos), strict=True):
        same.setdefault((s, tt), set()).add(d)
    forced = free = 0
    for i, (s, d, tt) in enumerate(zip(*(x.tolist() for x in pos), strict=True)):
        ours = neg[i][valid[i]].tolist()
        tgb = [int(x) for x in theirs[(s, d, tt)]]
        assert len(ours) == len(set(ours)) == len(tgb), i
        assert not set(ours) & same[(s, tt)] and all(first <= x <= last for x in ours)
        hist_s = seen.get(s, set())
        assert len(set(ours) & hist_s) == len(set(tgb) & hist_s), i
        n_hist = min(int(k * 0.5), len(hist_s - same[(s, tt)]))
        n_rand = k - n_hist
        room = n_dst - len(hist_s | same[(s, tt)])
        if n_hist == len(hist_s - same[(s, tt)]) and n_rand >= room:  # no choice left
            forced += 1
            assert set(ours) == set(tgb), i
        else:
            free += 1
        assert valid[i, len(ours) :].sum() == 0 and valid[i, : len(ours)].all()  # padded at the end
    assert forced + free == len(pos[0])
    assert (forced > 0, free > 0) == (some_forced, some_free)


def test_a_draws_first_rows_are_the_whole_draws(monkeypatch):
    """`sample(..., rows=m)` (a continual increment's scored prefix) gives the first m rows
    of the whole draw, whatever the chunk they fall in."""
    src, dst, t = stream(700, 30, 5, 40, seed=4)
    monkeypatch.setattr(tgb, "_CHUNK_ELEMENTS", 40 * 64)  # chunks of 64 positives
    sampler = HistRndNegatives(src[:400], dst[:400], 5, 44, 20, 0.5, seed=9)
    whole = sampler.sample(src[400:], dst[400:], t[400:])
    for m in (0, 1, 63, 64, 65, 200, 300, 1000):
        part = sampler.sample(src[400:], dst[400:], t[400:], rows=m)
        assert torch.equal(part[0], whole[0][:m]) and torch.equal(part[1], whole[1][:m]), m


def test_seen_pairs_give_the_sampler_of_their_events():
    """A history kept as distinct pairs, added block by block, draws what the history's
    events draw; its range takes in the block's destinations; its state round-trips."""
    src, dst, t = stream(900, 30, 5, 60, seed=6)
    seen = SeenPairs()
    for lo in range(0, 600, 150):
        seen.add(src[lo : lo + 150], dst[lo : lo + 150])
    block = slice(600, 900)
    first, last = int(dst.min()), int(dst.max())
    want = HistRndNegatives(src[:600], dst[:600], first, last, 25, 0.5, seed=2)
    got = seen.negatives(dst[block], 25, 0.5, seed=2)
    assert (got.first, got.range) == (want.first, want.range)
    for a, b in zip(got.sample(src[block], dst[block], t[block]),
                    want.sample(src[block], dst[block], t[block]), strict=True):  # fmt: skip
        assert torch.equal(a, b)
    other = SeenPairs()
    other.load_state_dict(seen.state_dict())
    assert torch.equal(other.keys, seen.keys) and other.last_dst == seen.last_dst
    empty = SeenPairs().negatives(dst[block], 25, 0.5, seed=2)  # no history: all random
    assert empty.seen_src.numel() == 0 and empty.first == int(dst[block].min())


def test_mrr_and_hits_equal_tgbs_evaluator():
    g = torch.Generator().manual_seed(0)
    pos = (torch.rand(300, generator=g) * 10).round() / 10  # ties between scores
    neg = (torch.rand(300, 50, generator=g) * 10).round() / 10
    valid = torch.rand(300, 50, generator=g) < 0.8
    evaluator = Evaluator(name="tgbl-wiki")
    for mask in (None, valid):
        rows = []
        for i in range(300):
            negs = neg[i] if mask is None else neg[i][mask[i]]
            rows.append(evaluator.eval({"y_pred_pos": pos[i : i + 1].numpy(),
                                        "y_pred_neg": negs.numpy()[None],
                                        "eval_metric": ["mrr"]}))  # fmt: skip
        ours = tgb_metrics(pos, neg, mask)
        assert ours["mrr"] == pytest.approx(np.mean([r["mrr"] for r in rows]), abs=1e-6)
        assert ours["hits@10"] == pytest.approx(np.mean([r["hits@10"] for r in rows]), abs=1e-6)


class PlainEdgeBank:
    """TGB's EdgeBank rules written out one pair at a time (the test's reference)."""

    def __init__(self, src, dst, t, mode, ratio=0.15):
        self.mode, self.memory = mode, {}
        lo, hi = float(t.min()), float(t.max())
        self.start, self.end = lo + (hi - lo) * (1 - ratio), hi
        self.length = self.end - self.start
        self.record(src, dst, t)

    def record(self, src, dst, t):
        for s, d, tt in zip(src.tolist(), dst.tolist(), t.tolist(), strict=True):
            self.memory[(s, d)] = tt

    def update(self, src, dst, t):
        if self.mode == "window" and float(t.max()) > self.end:
            self.end = float(t.max())
            self.start = self.end - self.length
        self.record(src, dst, t)

    def score(self, s, d):
        if (s, d) not in self.memory:
            return 0.0
        return 1.0 if self.mode == "unlimited" or self.memory[(s, d)] >= self.start else 0.0


@pytest.mark.parametrize("mode", ["unlimited", "window"])
def test_edgebank_scores_as_tgbs_rules_say(mode):
    src, dst, t = stream(3000, 40, 40, 60, seed=7, dup_times=False)
    ours = EdgeBank(100, src[:1000], dst[:1000], t[:1000], mode)
    plain = PlainEdgeBank(src[:1000], dst[:1000], t[:1000], mode)
    g = torch.Generator().manual_seed(1)
    for lo in range(1000, 3000, 200):
        qs = torch.randint(0, 40, (200, 1), generator=g)
        qd = torch.randint(40, 100, (200, 7), generator=g)
        got = ours.score(qs, qd)
        want = torch.tensor([[plain.score(s, d) for d in row] for s, row in
                             zip(qs.squeeze(1).tolist(), qd.tolist(), strict=True)])  # fmt: skip
        assert torch.equal(got, want.double())
        assert 0 < got.sum() < got.numel()
        ours.update(src[lo : lo + 200], dst[lo : lo + 200], t[lo : lo + 200])
        plain.update(src[lo : lo + 200], dst[lo : lo + 200], t[lo : lo + 200])


def test_edgebank_on_the_protocol_scores_each_batch_before_recording_it():
    """`edgebank_tgb`'s MRR equals scoring each positive with the plain EdgeBank, a batch of
    200 at a time, against the same negatives."""
    from tidegraph.storage.events import EventBatch

    src, dst, t = stream(2400, 30, 30, 50, seed=11)
    events = EventBatch(src, dst, t.double(), torch.arange(len(src)))
    got = edgebank_tgb(events, 80, "window", k=20, seed=4)
    train_end, val_end = tgb_bounds(t)
    plain = PlainEdgeBank(src[:train_end], dst[:train_end], t[:train_end].double(), "window")
    sampler = HistRndNegatives(src[:train_end], dst[:train_end], int(dst.min()), int(dst.max()),
                               20, 0.5, 4)  # fmt: skip
    for split, (a, b) in (("val", (train_end, val_end)), ("test", (val_end, len(t)))):
        neg, valid = sampler.sample(src[a:b], dst[a:b], t[a:b])
        pos_s, neg_s = [], []
        for lo in range(a, b, 200):
            hi = min(b, lo + 200)
            for i in range(lo, hi):
                s = int(src[i])
                pos_s.append(plain.score(s, int(dst[i])))
                neg_s.append([plain.score(s, d) for d in neg[i - a].tolist()])
            plain.update(src[lo:hi], dst[lo:hi], t[lo:hi].double())
        want = tgb_metrics(torch.tensor(pos_s), torch.tensor(neg_s), valid)
        assert got[split]["mrr"] == pytest.approx(want["mrr"], abs=1e-12)
        assert got[split]["hits@10"] == pytest.approx(want["hits@10"], abs=1e-12)
