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
from pathlib import Path

from tidegraph.training.config import RunConfig
from tidegraph.training.continual import ContinualLearner
from tidegraph.training.data import Stream

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
    train_end = int(n * config.offline_split[0])
    val_end = train_end + int(n * config.offline_split[1])
    learner.ingest(0, n)
    epochs = []
    for epoch in range(config.train.epochs):
        learner.group.reset_state()
        t0 = time.perf_counter()
        _, loss = learner.train_pass(0, train_end, f"offline epoch {epoch + 1}")
        train_s = time.perf_counter() - t0
        val = learner.eval_pass(train_end, val_end, f"offline val {epoch + 1}", observe=True)
        epochs.append({"epoch": epoch + 1, "loss": loss, "train_s": train_s, **val})
        log.info("offline epoch %d: %.1f s, loss %.4f, val %s", epoch + 1, train_s, loss, val)
    test = learner.eval_pass(val_end, n, "offline test", observe=True)
    out = {
        "model": config.model.name,
        "dataset": learner.stream.name,
        "events": n,
        "epochs": epochs,
        "epoch_s": sum(e["train_s"] for e in epochs) / len(epochs),
        "val": {k: epochs[-1][k] for k in ("ap", "auc", "mrr")},
        "test": test,
    }
    if config.out_dir:
        path = Path(config.out_dir) / "offline.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))
    return out
