"""`uniform` sampling keeps the distributed semantics: its draws are keyed by (step, root,
hop) (`tidegraph.sampling.keyed`), so P shards and W trainers draw what one process draws, and
the run is what one trainer gives at the same global batch (float64: summation order only).
The Ray backend's equality with the local one is in test_ray.py."""

import sys
from pathlib import Path

import pytest
import torch

from tidegraph.runtime import set_determinism
from tidegraph.training import ContinualLearner, RunConfig, load_stream
from tidegraph.training.group import LocalGroup
from tidegraph.training.sampling import NegativeSampler

sys.path.insert(0, str(Path(__file__).parent))
from numerics import rel  # noqa: E402


@pytest.fixture(autouse=True)
def _float64_one_thread():
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    set_determinism(7, threads=1)
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", 3000)


def config(model: str, shards: int, trainers: int) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"name": model, "dim": 16, "time_dim": 8, "memory_dim": 16,
                  "slot_precision": "fp32"},
        "sampler": {"strategy": "uniform", "fanouts": [4, 3] if model == "tgat" else [4]},
        "data": {"max_events": 3000},
        "train": {"batch_size": 150, "epochs": 1, "eval_negatives": 3},
        "continual": {"num_increments": 1, "forget_sample": 100, "train_fraction": 0.6},
        "cluster": {"shards": shards, "trainers": trainers},
        "progress": False, "out_dir": None, "seed": 7,
    })  # fmt: skip


def float64_learner(model: str, shards: int, trainers: int, stream) -> ContinualLearner:
    learner = ContinualLearner(config(model, shards, trainers), stream)
    for trainer in learner.group.trainers:
        trainer.model.to(torch.float64)
        trainer.new_optimizer()
    return learner


def sampled(group: LocalGroup, ev, neg) -> list[torch.Tensor]:
    """Each trainer's blocks for its slice of the batch, put together in batch order."""
    from tidegraph.models.base import link_roots

    roots, ts = link_roots(ev.src, ev.dst, neg, ev.t)
    out = []
    for block in group.trainers[0].sampler.sample(roots, ts, key=123):
        out.append(block.nbr_eids)
    return out


@pytest.mark.parametrize("model", ["tgat", "tgn"])
def test_phase1_and_an_increment_match_across_shards_and_trainers(model, wiki):
    """Parameters, node state and AP after phase 1 and one increment; a draw that depended
    on the slice or the shard (per-process generators) differs by far more than 1e-9
    (checked: drawing with each shard's own generator gives 3e-3 on a parameter)."""
    ref = float64_learner(model, 1, 1, wiki)
    ref.run()
    for shards, trainers in ((2, 2), (3, 4)):
        run = float64_learner(model, shards, trainers, wiki)
        run.run()
        a, b = ref.model.state_dict(), run.model.state_dict()
        assert a.keys() == b.keys()
        for key in a:
            if a[key].is_floating_point():
                assert rel(a[key], b[key]) < 1e-9, (shards, trainers, key, rel(a[key], b[key]))
            else:
                assert torch.equal(a[key], b[key]), (shards, trainers, key)
        for ra, rb in zip(ref.history, run.history, strict=True):
            for key in ("ap", "val_ap"):
                if key in ra:
                    assert abs(ra[key] - rb[key]) < 1e-9, (shards, trainers, key)


def test_the_blocks_of_a_key_do_not_depend_on_the_shards(wiki):
    """The same roots sampled over 1 and 3 shards under one key: the same neighbours."""
    ev = wiki.events
    groups = [LocalGroup(config("tgat", p, 1), wiki.num_nodes, 0) for p in (1, 3)]
    for group in groups:
        group.ingest(ev.select(slice(0, 2500)), wiki.num_nodes)
    negatives = NegativeSampler(3)
    negatives.add(ev.dst[:2500])
    batch = ev.select(slice(2500, 2700))
    neg = negatives.sample(len(batch), 2)
    one, three = (sampled(g, batch, neg) for g in groups)
    assert all(torch.equal(a, b) for a, b in zip(one, three, strict=True))
    assert one[0].ge(0).sum() > 0
