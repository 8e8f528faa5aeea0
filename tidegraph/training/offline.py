"""The plain offline protocol: split the stream by time (70/15/15 by default), train for
`train.epochs` epochs on the first part (node state reset each epoch, as TGN does), validate,
then test on the last part with node state carried through validation.

All events are in the graph from the start; sampling at each event's own time (strictly
earlier edges only) keeps this free of leakage, and lets an event see earlier events of its
own batch, which PyG's LastNeighborLoader (updated once per batch) does not.
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from pathlib import Path

import torch

from tidegraph.rng import seed_for
from tidegraph.training.config import RunConfig
from tidegraph.training.continual import ContinualLearner, _value
from tidegraph.training.data import Stream
from tidegraph.training.metrics import link_metrics
from tidegraph.training.progress import Progress, steps_shown
from tidegraph.training.schedule import batch_bounds
from tidegraph.training.tgb import HistRndNegatives, tgb_bounds, tgb_metrics

__all__ = ["run_offline"]

log = logging.getLogger(__name__)


def run_offline(config: RunConfig, stream: Stream | None = None, group=None) -> dict:
    """Train, validate and test; returns per-epoch times, validation and test metrics.
    `group`: the group factory, as `ContinualLearner` takes it (None: `LocalGroup`); the group
    (on Ray: its actors and placement groups) is released at the end."""
    learner = ContinualLearner(config, stream, group)
    try:
        return _run(config, learner)
    finally:
        learner.group.shutdown()


def _run(config: RunConfig, learner: ContinualLearner) -> dict:
    n = len(learner.events)
    tgb = config.eval.protocol == "tgb"
    if tgb:
        train_end, val_end = tgb_bounds(learner.events.t)
        evaluate = _tgb_evaluation(config, learner, train_end, val_end)
    else:
        train_end = int(n * config.offline_split[0])
        val_end = train_end + int(n * config.offline_split[1])
        evaluate = partial(eval_pass, learner)
    learner.ingest(0, n)
    epochs = []
    for epoch in range(config.train.epochs):
        learner.group.reset_state()
        t0 = time.perf_counter()
        _, loss = train_pass(learner, 0, train_end, f"offline epoch {epoch + 1}")
        train_s = time.perf_counter() - t0
        last = epoch + 1 == config.train.epochs
        if tgb and not (last or config.eval.every_epoch):
            # the next epoch starts from a reset state: an unscored validation changes nothing
            epochs.append({"epoch": epoch + 1, "loss": loss, "train_s": train_s})
            log.info("offline epoch %d: %.1f s, loss %.4f", epoch + 1, train_s, loss)
            continue
        val = evaluate(train_end, val_end, f"offline val {epoch + 1}", observe=True)
        epochs.append({"epoch": epoch + 1, "loss": loss, "train_s": train_s, **val})
        log.info("offline epoch %d: %.1f s, loss %.4f, val %s", epoch + 1, train_s, loss, val)
    test = evaluate(val_end, n, "offline test", observe=True)
    out = {
        "model": config.model.name,
        "dataset": learner.stream.name,
        "events": n,
        "epochs": epochs,
        "epoch_s": sum(e["train_s"] for e in epochs) / len(epochs),
        "val": {k: v for k, v in epochs[-1].items() if k not in ("epoch", "loss", "train_s")},
        "test": test,
        "split": {"train": train_end, "val": val_end - train_end, "test": n - val_end},
    }
    if tgb:
        out["protocol"] = config.eval.tgb_record()
    if config.out_dir:
        path = Path(config.out_dir) / "offline.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))
    return out


def _batches(learner: ContinualLearner, start: int, end: int):
    for lo, hi in batch_bounds(start, end, learner.config.train.batch_size):
        yield learner._events(lo, hi)


def train_pass(learner: ContinualLearner, start: int, end: int, desc: str) -> tuple[float, float]:
    """Train on events [start, end) outside the schedule; returns (events/s, mean loss)."""
    bar = Progress(end - start, desc, learner.config.progress)
    batches = [(ev, None, learner.negatives.sample(len(ev), learner.train_negatives), len(ev))
               for ev in _batches(learner, start, end)]  # fmt: skip
    progress = steps_shown(lambda i: bar.update(len(batches[i][0])))
    group = learner.group
    if group.runs_passes:
        results = group.train_pass(batches, progress)
    else:
        results = [group.train_step(*b) for b in batches]
    progress(len(batches))
    learner.cursor.step += len(batches)
    total = sum(_value(loss) * len(ev) for (ev, *_), loss in zip(batches, results, strict=True))
    return bar.close(), total / max(end - start, 1)  # (total waited for pending steps)


def eval_pass(learner: ContinualLearner, start: int, end: int, desc: str, observe: bool) -> dict:
    bar = Progress(end - start, desc, learner.config.progress)
    pos, neg = [], []
    for ev in _batches(learner, start, end):
        p, n = learner._eval_batch(ev, observe)
        pos.append(p)
        neg.append(n)
        bar.update(len(ev))
    bar.close()
    return link_metrics(torch.cat(pos), torch.cat(neg))


def _tgb_evaluation(config: RunConfig, learner: ContinualLearner, train_end: int, val_end: int):
    """`evaluate(start, end, desc, observe)` for TGB's protocol: each split's hist_rnd
    negatives drawn once (history: the train split), scored one positive against its
    negatives; `eval.prefix` positives of a split scored, the rest of validation recorded."""
    e, ev = config.eval, learner.events
    sampler = HistRndNegatives(ev.src[:train_end], ev.dst[:train_end], int(ev.dst.min()),
                               int(ev.dst.max()), e.negatives, e.hist_ratio,
                               seed_for(config.seed, "tgb negatives"))  # fmt: skip
    drawn = {}
    for lo, hi in ((train_end, val_end), (val_end, len(ev))):
        drawn[lo] = sampler.sample(ev.src[lo:hi], ev.dst[lo:hi], ev.t[lo:hi])

    def evaluate(start: int, end: int, desc: str, observe: bool) -> dict:
        neg_all, valid_all = drawn[start]
        scored = end if e.prefix == 0 else min(end, start + e.prefix)
        bar = Progress(scored - start, desc, learner.config.progress)
        t0 = time.perf_counter()
        pos, neg = [], []
        for lo, hi in batch_bounds(start, scored, config.train.batch_size):
            p, q = learner.group.eval_step(learner._events(lo, hi),
                                           neg_all[lo - start : hi - start], observe)  # fmt: skip
            pos.append(p)
            neg.append(q)
            bar.update(hi - lo)
        bar.close()
        seconds = time.perf_counter() - t0
        if observe and scored < end and end < len(ev):  # the rest of validation, recorded
            rest = learner.negatives  # one uniform negative each: scores unused
            for lo, hi in batch_bounds(scored, end, config.train.batch_size):
                learner.group.eval_step(learner._events(lo, hi), rest.sample(hi - lo, 1), True)
        pos, neg = torch.cat(pos), torch.cat(neg)
        valid = valid_all[: scored - start]
        out = link_metrics(pos, neg[:, :1])  # AP and AUC against each first negative
        out.update(tgb_metrics(pos, neg, valid, e.hits_k), positives=scored - start, eval_s=seconds)
        return out

    return evaluate
