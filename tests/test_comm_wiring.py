"""Issue 14 in the trainer group: the `comm:` section, compressed gradients on both backends,
the reducer's state in trainer checkpoints, and int8 rows from shards.

The Ray run and the in-process run of the same compressed configuration must agree to the bit
(the local group runs the same reducer code over an in-memory loopback), and every replica of a
compressed run must hold the same parameters (they decode the same bytes).
"""

import copy
import json
import sys
from pathlib import Path

import pytest
import ray
import torch

from tidegraph.actors.shard import GraphShardActor, RemoteShard
from tidegraph.comm.collective import Collective
from tidegraph.comm.config import CommConfig
from tidegraph.comm.gradsync import GradSync
from tidegraph.orchestrator import make_group
from tidegraph.runtime import set_determinism
from tidegraph.storage.events import EventBatch
from tidegraph.storage.partition import build_partitioner
from tidegraph.training import ContinualLearner, RunConfig, load_stream
from tidegraph.training.fetch import ShardedFeatureStore
from tidegraph.training.shard import ShardCore, route_batch

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402

# 8 bits from the first step, every bucket compressed, chunks of 256 values: per rank each
# value's code is sent twice (all-to-all, all-gather) at 1/4 of fp32 plus 8 bytes per chunk;
# eager kernels ("auto", the default, compiles them aside in each trainer: seconds of CPU, and
# no bit changes, tests/test_quantize.py; the q8 replicas test runs the default on Ray)
Q8 = {"compression": "q8", "warmup_steps": 0, "min_bucket_bytes": 0, "chunk_size": 256,
      "codec": "eager"}  # fmt: skip


def config(backend: str = "local", trainers: int = 2, **comm) -> RunConfig:
    raw = reference_run.reference_config("tgn")
    raw["model"].update(dim=32, memory_dim=32)  # ~18k parameters: little padding per chunk
    raw["model"]["slot_precision"] = "fp32"
    raw["cluster"] = {"backend": backend, "shards": 2, "trainers": trainers}
    raw["comm"] = comm
    raw["run_name"] = "tidegraph-comm-test"
    return RunConfig.from_dict(raw)


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", 1500)


def learner_for(cfg: RunConfig, stream) -> ContinualLearner:
    set_determinism(7, threads=1)
    return ContinualLearner(cfg, stream, make_group)


def run(cfg: RunConfig, stream, between=None) -> tuple:
    """(model state, history, summary, every trainer's model state); `between(learner)`
    after phase 1."""
    learner = learner_for(cfg, stream)
    try:
        learner.run_phase1()
        if between is not None:
            between(learner)
        while not learner.done:
            learner.step()
        summary = learner.summary()
        trainers = learner.group.trainers
        if cfg.cluster.backend == "ray":
            replicas = ray.get([t.model_state.remote() for t in trainers])
        else:
            replicas = [t.model_state() for t in trainers]
        return learner.group.model_state(), learner.history, summary, replicas
    finally:
        learner.group.shutdown()


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


METRICS = ("ap", "auc", "mrr", "loss", "val_ap", "old_ap")


def same_history(a: list, b: list) -> bool:
    pick = lambda r: {k: r[k] for k in METRICS if k in r}  # noqa: E731
    return len(a) == len(b) and all(pick(x) == pick(y) for x, y in zip(a, b, strict=True))


# -- configuration ---------------------------------------------------------------------------


def test_comm_section_maps_onto_comm_config_and_names_the_field_to_fix():
    cfg = RunConfig.from_dict({"comm": {"compression": "adaptive", "adaptive_bits": [4, 8]}})
    assert cfg.comm == CommConfig(compression="adaptive", adaptive_bits=(4, 8))
    assert RunConfig.from_dict({}).comm == CommConfig()  # fp32 unless asked
    assert RunConfig.from_dict(cfg.to_dict()).comm == cfg.comm
    with pytest.raises(ValueError, match=r"comm\.compression"):
        RunConfig.from_dict({"comm": {"compression": "q3"}})
    with pytest.raises(ValueError, match=r"comm\.chunk_size"):
        RunConfig.from_dict({"comm": {"chunk_size": 6}})
    with pytest.raises(ValueError, match=r"comm: unknown keys \['bits'\]"):
        RunConfig.from_dict({"comm": {"bits": 8}})


# -- in-process group --------------------------------------------------------------------------


def test_a_single_trainer_sends_nothing_so_compression_changes_nothing(wiki):
    plain = run(config(trainers=1), wiki)
    q8 = run(config(trainers=1, **Q8), wiki)
    assert same_state(plain[0], q8[0]) and same_history(plain[1], q8[1])
    assert q8[2]["comm"]["config"]["compression"] == "q8"
    assert q8[2]["comm"]["bytes_sent"] is None  # no compressed step was ever taken


def test_local_checkpoint_of_adaptive_bits_and_feedback_resumes_bitwise(wiki):
    """The reducer's state (adaptive bits, decision step, error-feedback residuals, totals)
    is in each trainer's state_dict: a learner that loads it continues bitwise."""
    cfg = config(compression="adaptive", error_feedback=True, adaptive_every=3, warmup_steps=2,
                 min_bucket_bytes=0, chunk_size=64, bucket_bytes=16_384)  # fmt: skip
    first = learner_for(cfg, wiki)
    first.run_phase1()
    state = copy.deepcopy(first.state_dict())
    comm = state["group"]["trainers"][1]["comm"]
    assert comm["rank"] == 1 and comm["reducer"]["worker_feedback"]["residual"] is not None
    assert comm["totals"]["compressed_steps"] > 0 and len(comm["reducer"]["bits"]) > 1
    second = learner_for(cfg, wiki)
    second.load_state_dict(state)
    while not first.done:
        first.step()
        second.step()
    assert same_state(first.group.model_state(), second.group.model_state())
    assert same_history(first.history, second.history)
    assert first.summary()["comm"] == second.summary()["comm"]


def test_adaptive_bits_per_bucket_are_written_to_metrics_jsonl_when_they_change(wiki, tmp_path):
    cfg = config(compression="adaptive", adaptive_every=3, warmup_steps=2, min_bucket_bytes=0,
                 chunk_size=64, bucket_bytes=16_384, adaptive_lambda=0.05)  # fmt: skip
    cfg.out_dir = str(tmp_path)
    learner = learner_for(cfg, wiki)
    try:
        learner.run_phase1()
        while not learner.done:
            learner.step()
        summary = learner.summary()
    finally:
        learner.group.shutdown()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["phase"] == "comm_bits"]
    assert records and records[-1]["bits"] == summary["comm"]["last_bits"]
    assert len(records[-1]["bits"]) > 1 and {8, 32} & set(records[-1]["bits"])
    changes = zip(records, records[1:], strict=False)
    assert all(a["bits"] != b["bits"] for a, b in changes)  # written when they change only
    assert [r["steps"] for r in records] == sorted(r["steps"] for r in records)


def test_another_ranks_state_keeps_the_shared_part_and_drops_the_residuals():
    cfg = CommConfig(compression="q4", error_feedback=True, min_bucket_bytes=0, chunk_size=64)
    owner = GradSync(cfg, seed=0, rank=1)
    owner.reducer._worker_fb.residual = torch.ones(8)
    owner.bytes_sent, owner.last_bits = 123, (4, 32)
    other = GradSync.restore(cfg, 0, 0, owner.state_dict())
    assert other.reducer._worker_fb.residual is None and other.bytes_sent == 123
    same = GradSync.restore(cfg, 0, 1, owner.state_dict())
    assert torch.equal(same.reducer._worker_fb.residual, torch.ones(8))
    assert same.last_bits == (4, 32)


def test_tensors_other_than_gradients_are_summed_exactly_by_a_group_of_one():
    group = Collective(("127.0.0.1", 0), generation=0, rank=0, world=1, comm=CommConfig(**Q8))
    x = torch.randn(1000)
    step = group.allreduce_sum_(group.gradient(x.clone(), 0, [1000]))
    assert torch.equal(step.flat, x) and step.sync is None


# -- int8 rows ---------------------------------------------------------------------------------


def _features_batch(n: int = 300, dim: int = 12) -> EventBatch:
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 50, (n,), generator=g)
    dst = torch.randint(50, 90, (n,), generator=g)
    t = torch.arange(n, dtype=torch.float64)
    feat = torch.randn(n, dim, generator=g) * torch.rand(n, 1, generator=g) * 10
    feat[5] = 0.0  # a row of zeros stays exact
    return EventBatch(src, dst, t, torch.arange(n), feat)


def test_int8_rows_from_in_process_and_actor_shards_are_the_same_and_within_half_a_step(
    ray_session,
):
    ev = _features_batch()
    parts = 2
    routed = route_batch(build_partitioner("hash", parts), ev, "fp32", None)
    kw = dict(edge_dim=ev.edge_feat.shape[1])
    local = [ShardCore(p, parts, **kw) for p in range(parts)]
    actors = [GraphShardActor.remote({"seed": 0}, p, parts, **kw) for p in range(parts)]
    for p in range(parts):
        local[p].ingest(routed[p])
    ray.get([a.ingest.remote(routed[p]) for p, a in enumerate(actors)])
    try:
        here = ShardedFeatureStore(local, kw["edge_dim"], rows_int8=True)
        there = ShardedFeatureStore([RemoteShard(a) for a in actors], kw["edge_dim"],
                                    gather=ray.get, rows_int8=True)  # fmt: skip
        exact = ShardedFeatureStore(local, kw["edge_dim"])
        ids = torch.randperm(len(ev))
        rows = here.fetch(ids)
        assert rows.data.dtype == torch.int8 and rows.scale.shape == (len(ev),)
        a, b, x = here.get(ids), there.get(ids), exact.get(ids)
        assert torch.equal(a, b)
        assert torch.equal(x, ev.edge_feat[ids])
        half_step = x.abs().amax(dim=1, keepdim=True) / 254
        assert ((a - x).abs() <= half_step * (1 + 1e-6)).all()
        assert torch.equal(a[ids == 5], torch.zeros(1, kw["edge_dim"]))
        assert here.get(torch.zeros(0, dtype=torch.int64)).shape == (0, kw["edge_dim"])
    finally:
        for actor in actors:
            ray.kill(actor)


# -- Ray trainers --------------------------------------------------------------------------------


def test_ray_q8_replicas_agree_match_the_local_group_and_send_a_quarter(ray_session, wiki):
    """Two trainer actors with 8-bit gradients and int8 rows: phase 1 and two increments.
    Both replicas hold the same parameters; the in-process group computes the same bits;
    a new membership generation mid-run (what recovery does) changes nothing, since the
    reducer's state is the trainer's; bytes are ~0.26 of fp32's."""
    comm = {**Q8, "codec": "auto", "rows_int8": True}  # the default: compiled aside, on Ray too
    remote = run(config("ray", **comm), wiki, between=lambda learner: learner.group._connect())
    assert same_state(remote[3][0], remote[3][1])
    local = run(config("local", **comm), wiki)
    assert same_state(local[0], remote[0]) and same_history(local[1], remote[1])
    assert local[2]["comm"] == remote[2]["comm"]
    record = remote[2]["comm"]
    assert record["config"]["compression"] == "q8" and record["config"]["rows_int8"]
    assert record["compressed_steps"] == record["steps"] > 0
    assert 0.25 < record["ratio"] < 0.28, record
    assert set(record["last_bits"]) == {8}
    plain = run(config("local"), wiki)
    assert not same_state(plain[0], local[0])  # compression did change the arithmetic
    increments = lambda h: [r["ap"] for r in h if r["phase"] == "increment"]  # noqa: E731
    for a, b in zip(increments(plain[1]), increments(local[1]), strict=True):
        assert abs(a - b) < 0.02


OVERLAP_CASES = {
    "adaptive": dict(compression="adaptive", warmup_steps=3, adaptive_every=7,
                     min_bucket_bytes=4096, chunk_size=64, bucket_bytes=16_384, codec="eager"),
    "none": dict(compression="none", bucket_bytes=16_384),
}  # fmt: skip


# the default suite sends compressed buckets (q4 and exact ones mixed); fp32 ones: slow
@pytest.mark.parametrize("name", ["adaptive", pytest.param("none", marks=pytest.mark.slow)])
def test_ray_overlapped_buckets_match_the_local_group_bitwise(ray_session, wiki, name):
    """`comm.overlap`: buckets leave during backward (from the parameters' gradient hooks);
    two trainer actors end bitwise as the in-process group, which sends nothing early, for
    compressed buckets (q4 and exact ones mixed, adaptive bits re-decided) and for fp32."""
    for comm in [OVERLAP_CASES[name]]:
        remote = run(config("ray", overlap=True, **comm), wiki)
        local = run(config("local", **comm), wiki)
        assert same_state(remote[3][0], remote[3][1]), name
        assert same_state(local[0], remote[0]) and same_history(local[1], remote[1]), name
        record = remote[2]["comm"]
        assert record["buckets_sent_in_backward"] > record["steps"] > 0, (name, record)
        assert len(record["last_bits"]) > 2, record  # several buckets
        if name == "adaptive":
            assert local[2]["comm"]["last_bits"] == record["last_bits"]
            assert record["compressed_steps"] > 0


def test_prometheus_allreduce_bytes_count_what_compression_sent(wiki):
    """`tidegraph_allreduce_bytes_total` is trainer 0's bytes on the wire when gradients are
    compressed (not the fp32 estimate), and the fp32 ring estimate without compression."""
    from tidegraph.orchestrator import Orchestrator, RunState
    from tidegraph.orchestrator.metrics import RunMetrics

    sent = {}
    for name, comm in (("q8", Q8), ("none", {})):
        metrics = RunMetrics(0)
        try:
            set_determinism(7, threads=1)
            orchestrator = Orchestrator(config(**comm), wiki, metrics=metrics)
            while orchestrator.step() not in (RunState.FINISHED, RunState.ERRORED):
                pass
            assert orchestrator.state is RunState.FINISHED, orchestrator.error
            group = orchestrator.learner.group
            sent[name] = metrics.registry.get_sample_value("tidegraph_allreduce_bytes_total")
            totals = group.comm_totals()
            bits = metrics.registry.get_sample_value("tidegraph_allreduce_bucket_bits",
                                                     {"bucket": "0"})  # fmt: skip
            if name == "q8":
                assert totals is not None and sent[name] == totals["bytes_sent"]
                assert bits == 8 and totals["last_bits"] == [8]
            else:
                assert totals is None and bits is None
                steps = orchestrator.learner.cursor.step
                assert sent[name] == steps * group.grad_values() * 4 * 2 * (2 - 1) / 2
        finally:
            metrics.close()
    assert 0 < sent["q8"] < 0.3 * sent["none"]
