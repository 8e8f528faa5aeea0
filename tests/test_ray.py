"""The Ray backend: shard and trainer actors give exactly what the in-process group gives."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from tidegraph.orchestrator import Orchestrator, RunState, make_group
from tidegraph.orchestrator.ray_group import PlacementTimeout, RayGroup
from tidegraph.runtime import set_determinism
from tidegraph.training import ContinualLearner, RunConfig, load_stream
from tidegraph.training.protocol import Group

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402


def config(model="tgn", backend="ray", strategy="recent", **cluster) -> RunConfig:
    raw = reference_run.reference_config(model)
    raw["model"]["slot_precision"] = "fp32"
    raw.setdefault("sampler", {})["strategy"] = strategy
    raw["cluster"] = {"backend": backend, **cluster}
    raw["run_name"] = "tidegraph-test-run"
    return RunConfig.from_dict(raw)


def run(cfg: RunConfig, stream):
    set_determinism(7, threads=1)
    learner = ContinualLearner(cfg, stream, make_group)
    if cfg.cluster.backend == "ray":  # one node: every shard is the trainers' own, or none
        want = [0, 1] if cfg.cluster.local_sampling else []
        assert ray.get([t.local_shards.remote() for t in learner.group.trainers]) == [want] * 2
    try:
        learner.run_phase1()
        while not learner.done:
            learner.step()
        return learner.group.model_state(), learner.history, learner.group.node_state()
    finally:
        learner.group.shutdown()


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", 1500)


# slow: TGN by request with a task per step (its parts are in the default suite: sampling by
# request and a task per step, bitwise, in the tgat case; TGN's replicated memory with a task
# per step, bitwise, in test_recovery's pipelined run)
@pytest.mark.parametrize(
    ("model", "memory", "in_place", "strategy"),
    [
        ("tgn", "replicated", True, "recent"),
        pytest.param("tgn", "replicated", False, "recent", marks=pytest.mark.slow),
        ("apan", "sharded", True, "recent"),
        ("tgat", "replicated", False, "uniform"),
        ("graphmixer", "replicated", True, "recent"),
        ("dygformer", "replicated", True, "recent"),
        ("tpnet", "sharded", True, "recent"),
        ("edgebank", "replicated", True, "recent"),
    ],
)
def test_ray_actors_give_bitwise_what_the_local_group_gives(
    ray_session, wiki, model, memory, in_place, strategy
):
    """Two trainers: gloo's all-reduce adds the two slice gradients once, as the local sum
    does, so the runs agree to the bit (with more trainers, to the summation order). Trainers
    sample same-node shards in place (zero-copy segments) or by request: the same blocks; and
    run a whole pass per task, exchanging node-state updates among themselves, or a task per
    step (the second case). `uniform` draws are keyed by step and root, so whichever process
    samples a root draws the same neighbours."""
    local = run(config(model, "local", strategy, shards=2, trainers=2, memory=memory), wiki)
    cfg = config(model, "ray", strategy, shards=2, trainers=2, memory=memory,
                 local_sampling=in_place, whole_passes=in_place)  # fmt: skip
    remote = run(cfg, wiki)
    assert local[0].keys() == remote[0].keys()
    for key, x in local[0].items():  # parameters, and node state where replicas hold it
        assert torch.equal(x, remote[0][key]), key
    keys = ("ap", "auc", "mrr", "loss", "val_ap", "old_ap")
    for a, b in zip(local[1], remote[1], strict=True):
        assert {k: a[k] for k in keys if k in a} == {k: b[k] for k in keys if k in b}
    want, got = _flat(local[2]), _flat(remote[2])  # node state: replica 0's or the shards'
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def _flat(x) -> list[torch.Tensor]:
    if isinstance(x, dict | list):
        return [t for v in (x.values() if isinstance(x, dict) else x) for t in _flat(v)]
    return [torch.as_tensor(x)]


def test_actors_are_named_report_a_pass_while_it_runs_and_are_released(ray_session, wiki):
    """Actors are named in the run's namespace; a whole pass per task reports its steps to
    the driver while it runs (trainers report every 20 ms here); a lost actor's name outlives
    it until the GCS marks it dead; shutdown releases every name."""
    default, RayGroup.progress_s = RayGroup.progress_s, 0.02
    try:
        learner = ContinualLearner(config(shards=2, trainers=2), wiki, make_group)
    finally:
        RayGroup.progress_s = default
    group = learner.group
    group.progress_s = 0.02
    names = ["tidegraph-shard-0", "tidegraph-shard-1", "tidegraph-trainer-0",
             "tidegraph-trainer-1", "tidegraph-coordinator"]  # fmt: skip
    for name in names:
        assert ray.get_actor(name, namespace="tidegraph-test-run") is not None
    assert set(group.placement()) == set(names[:4])
    assert group.alive() == (2, 2)
    assert isinstance(group, Group)  # the interface the learner and controller use
    assert group.shard_actors == 2 and group.supports_update_log
    assert group.runs_passes
    learner.ingest(0, len(wiki.events))
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(40):  # many small steps: the pass runs for a while
        ev = wiki.events.select(slice(0, 20))
        neg = torch.randint(0, learner.num_nodes, (20, 1), generator=gen)
        batches.append((ev, None, neg, 0))
    seen = []
    assert len(group.train_pass(batches, seen.append)) == 40
    assert seen == sorted(seen) and any(0 < s < 40 for s in seen), seen
    os.kill(ray.get(group.trainers[1].pid.remote()), signal.SIGKILL)  # the name outlives it
    ray.kill(group.shards[0].actor)
    for _ in range(100):  # the GCS learns of the deaths asynchronously: bounded wait
        if group.alive() == (1, 1):
            break
        time.sleep(0.05)
    assert group.alive() == (1, 1)
    group.shutdown()
    with pytest.raises(ValueError):
        ray.get_actor("tidegraph-trainer-0", namespace="tidegraph-test-run")


def test_a_group_the_cluster_cannot_place_fails_naming_the_missing_resources(ray_session, wiki):
    free = ray.cluster_resources()["CPU"]  # all of it, once every actor so far is gone
    RayGroup.placement_wait_s = 1.0
    try:
        orchestrator = Orchestrator(config(trainers=40), wiki)
        assert orchestrator.step() is RunState.ERRORED
    finally:
        RayGroup.placement_wait_s = 120.0
    err = orchestrator.error
    assert isinstance(err, PlacementTimeout)
    assert "could not place 40 trainers x {'CPU': 1.0}" in str(err)
    for _ in range(100):  # its placement groups are released (asynchronously): bounded wait
        if ray.available_resources().get("CPU") == free:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == free


def test_job_runs_on_ray(ray_session, tmp_path, capsys):
    from tidegraph.jobs.train import main

    args = ["--max-events", "1500", "--increments", "2", "--epochs", "1", "--no-progress",
            "--backend", "ray", "--shards", "2", "--trainers", "2",
            "--out", str(tmp_path)]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    # the last screen: the report's summary lines and where summary.json and the report are
    screen = out[out.index(f"run {tmp_path.name} ({tmp_path})") :].splitlines()
    assert len(screen) <= 25, screen
    assert "trainers W = 2, shards P = 2 (at the end), ray backend; 2 increments" in screen[1]
    assert screen[-2:] == [f"  summary: {tmp_path}/summary.json",
                           f"  report: python -m tidegraph.jobs.report {tmp_path} "
                           f"(writes {tmp_path}/report.html)"]  # fmt: skip
    assert not any(line.lstrip().startswith(("{", '"')) for line in screen)  # no JSON dump
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_actor_failing_in_its_constructor_names_the_cause_and_frees_the_group(ray_session, wiki):
    total = ray.cluster_resources()["CPU"]
    cfg = config(shards=2, trainers=2)
    cfg.graph_device = "cuda"  # shards build their graph there: absent on this machine
    orchestrator = Orchestrator(cfg, wiki)
    assert orchestrator.step() is RunState.ERRORED
    assert isinstance(orchestrator.error, ValueError)
    assert "needs CUDA, which is absent" in str(orchestrator.error)
    for _ in range(100):  # placement groups and actors released (asynchronously)
        if ray.available_resources().get("CPU") == total:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == total
    with pytest.raises(ValueError):
        ray.get_actor("tidegraph-coordinator", namespace="tidegraph-test-run")


def test_a_published_segment_is_held_once_as_the_object_stores_copy(ray_session):
    """A shard's segments, once published for same-node trainers, are the object store's
    copies (the very memory a same-node trainer maps), bitwise the segments they replace, so
    the node holds each once; the graph answers every query as before, merges go on over
    them, and merged segments are published in their turn."""
    from tidegraph.actors.segments import SegmentPublisher
    from tidegraph.sampling.sampler import TemporalSampler
    from tidegraph.storage.graph import DynamicGraph

    g = torch.Generator().manual_seed(3)
    graph = DynamicGraph(add_reverse=True)

    def add(lo: int, n: int) -> None:
        src, dst = (torch.randint(0, 300, (n,), generator=g) for _ in range(2))
        graph.add_edges(src, dst, torch.arange(lo, lo + n, dtype=torch.float64))

    for i in range(3):
        add(i * 500, 500)
    before = [tuple(getattr(s, k).clone() for k in ("nodes", "offsets", "nbr", "t", "eid"))
              for s in graph.segments]  # fmt: skip
    roots, t_hi = torch.arange(300), torch.full((300,), 1e9, dtype=torch.float64)
    want = TemporalSampler(graph, (5,), "recent").sample_hop(roots, t_hi, 5)
    publisher = SegmentPublisher()
    refs = publisher.refs(graph)
    assert len(refs) == len(graph.segments) == len(before)
    for ref, seg, old in zip(refs, graph.segments, before, strict=True):
        arrays, _ = ray.get(ref)
        for k, x in zip(("nodes", "offsets", "nbr", "t", "eid"), old, strict=True):
            assert getattr(seg, k).data_ptr() == arrays[k].ctypes.data  # the store's copy
            assert torch.equal(getattr(seg, k), x)
    got = TemporalSampler(graph, (5,), "recent").sample_hop(roots, t_hi, 5)
    for name in ("nbr_ids", "nbr_ts", "nbr_eids", "mask"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name
    assert want.mask.any()
    assert publisher.refs(graph) == refs  # published once
    add(1500, 2000)  # merges over the store's copies
    again = publisher.refs(graph)
    assert len(again) == len(graph.segments) and again[-1] not in refs
    arrays, _ = ray.get(again[-1])
    assert graph.segments[-1].nbr.data_ptr() == arrays["nbr"].ctypes.data
    assert graph.num_edges == 3500
