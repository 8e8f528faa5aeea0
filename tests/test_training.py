"""Continuous learning on small real data: learning happens, determinism, checkpoint-resume in
a new process, metrics against brute force, replay weights, increments and config errors."""

import io
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegraph.jobs.train import parse_config
from tidegraph.storage.events import EventBatch
from tidegraph.training import (
    ContinualLearner,
    ImportanceReplay,
    RunConfig,
    average_precision,
    increment_bounds,
    load_stream,
    mrr,
    roc_auc,
    run_offline,
)
from tidegraph.training.config import ContinualConfig
from tidegraph.training.offline import eval_pass
from tidegraph.training.sampling import node_degree

SMALL = {
    "model": {"dim": 32, "time_dim": 16, "memory_dim": 32},
    "data": {"max_events": 3000},
    "train": {"batch_size": 200, "epochs": 3, "eval_negatives": 5},
    "continual": {"num_increments": 2, "forget_sample": 200, "train_fraction": 0.6},
    "progress": False,
}


def small_config(tmp_path=None, **over) -> RunConfig:
    raw = json.loads(json.dumps(SMALL))
    for key, value in over.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    raw["out_dir"] = str(tmp_path) if tmp_path is not None else None
    return RunConfig.from_dict(raw)


@pytest.fixture(scope="module")
def wiki():
    return load_stream("wikipedia", 3000)


# ---- learning on real data -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "over"),
    [
        ("tgn", {}),
        ("tgat", {}),
        # JODIE learns from memory alone (no neighbours): it needs more events to get going
        ("jodie", {"data": {"max_events": 10000}, "train": {"lr": 1e-2}}),
        ("apan", {}),
        ("graphmixer", {}),
        ("tpnet", {}),
        ("edgebank", {}),  # what it learns is its memory of pairs (untrained: none)
    ],
)
def test_continual_run_learns(model, over, wiki, tmp_path):
    cfg = small_config(tmp_path, model={"name": model}, **over)
    stream = wiki if cfg.data.max_events == 3000 else load_stream("wikipedia", cfg.data.max_events)
    learner = ContinualLearner(cfg, stream)
    end = learner.phase1_end
    val_start = end - int(end * cfg.continual.val_fraction)
    learner.ingest(0, end)
    untrained = eval_pass(learner, val_start, end, "untrained", observe=False)["ap"]
    learner.run_phase1()
    trained = learner.history[-1]["val_ap"]
    steps = [learner.step() for _ in range(learner.num_increments)]
    assert trained > 0.6 and trained > untrained + 0.1, (untrained, trained)
    assert all(s["ap"] > 0.6 for s in steps), [s["ap"] for s in steps]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["phase"] for x in lines] == ["phase1", "increment", "increment"]
    summary = learner.summary()
    assert {"ap", "auc", "mrr", "forgetting"} <= set(summary)


def test_a_file_with_edge_features_and_a_bad_row_trains_through_the_cache(wiki, tmp_path, device):
    # a JODIE file (items numbered from 0, 4 feature columns) with one bad row, quarantined
    ev = wiki.events.select(slice(0, 1500))
    feat = torch.stack(
        [ev.t.float() / 1e5, (ev.src % 3).float(), ev.dst.float() / 1e4, ev.label.float()], 1
    )
    lines = ["user_id,item_id,timestamp,state_label,f0,f1,f2,f3"]
    for i in range(len(ev)):
        f = ",".join(f"{x:.6g}" for x in feat[i].tolist())
        lines.append(f"{int(ev.src[i])},{int(ev.dst[i]) - 8227},{float(ev.t[i])},0,{f}")
    lines.insert(700, "5,-3,1000.0,0,1,1,1,1")
    path, quarantine = tmp_path / "events.csv", tmp_path / "rejected.csv"
    path.write_text("\n".join(lines) + "\n")
    cfg = small_config(
        data={"dataset": str(path), "format": "jodie", "quarantine": str(quarantine)},
        train={"epochs": 1},
        device=device.type,
    )
    learner = ContinualLearner(cfg)
    assert learner.stream.edge_dim == 4 and len(learner.events) == 1500
    assert "negative id" in quarantine.read_text()
    learner.run_phase1()
    learner.step()
    assert not hasattr(learner.model, "edge_store")  # models read fetched rows, no store
    torch.testing.assert_close(learner.events.edge_feat, feat, rtol=1e-5, atol=1e-6)
    last = learner.ingested - 1
    assert learner.edge_cache.num_rows == last + 1
    assert learner.edge_cache.enabled == (device.type == "cuda")  # a real cache on CUDA
    rows = learner.edge_cache.get(torch.tensor([0, last])).cpu()
    torch.testing.assert_close(rows, learner.events.edge_feat[[0, last]])
    assert learner.edge_cache.stats()["rows"] > 0  # the model read features through the cache
    record = learner.history[-1]
    assert 0 <= record["edge_cache_hit_rate"] <= 1 and record["edge_cache_capacity"] >= 0
    assert learner.model.memory.msg_feat.abs().sum() > 0
    # the feature store travels in the learner's state: a restored learner continues the same
    # (one after the other: both use torch's process-wide generator; the state is saved as a
    # checkpoint is, since state_dict() holds live tensors, as torch's do)
    buffer = io.BytesIO()
    torch.save(learner.state_dict(), buffer)
    a = learner.step()
    resumed = ContinualLearner(cfg)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert resumed.edge_cache.num_rows == learner.edge_cache.num_rows - a["events"]
    b = resumed.step()
    if device.type == "cpu":  # bitwise on the CPU; CUDA's atomics may differ in the last bits
        assert a["ap"] == b["ap"] and a["loss"] == b["loss"]
    else:
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)


def test_a_file_without_valid_events_is_a_config_error(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("src,dst,time\n")
    with pytest.raises(ValueError, match="holds no valid events"):
        load_stream(str(path))


def test_optimizer_steps_the_live_parameters_also_when_rebuilt(wiki):
    """FlatAdam re-homes the parameters into its buffer; a fresh optimizer per increment and a
    checkpoint load must leave the model's own parameters the ones that train."""
    cfg = small_config(continual={"fresh_optimizer": True, "num_increments": 2})
    learner = ContinualLearner(cfg, wiki)
    learner.run_phase1()
    for _ in range(2):
        before = [p.detach().clone() for p in learner.model.parameters() if p.requires_grad]
        learner.step()
        opt = learner.optimizer
        assert opt is learner.group.trainers[0].optimizer
        live = [p for p in learner.model.parameters() if p.requires_grad]
        flat = opt.flat.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == flat for p in live)
        assert any(not torch.equal(a, b) for a, b in zip(before, live, strict=True))
    other = ContinualLearner(cfg, wiki)
    other.load_state_dict(learner.state_dict())
    flat = other.optimizer.flat.untyped_storage().data_ptr()
    assert all(
        p.untyped_storage().data_ptr() == flat for p in other.model.parameters() if p.requires_grad
    )
    for a, b in zip(learner.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_offline_split_learns(wiki):
    out = run_offline(small_config(mode="offline", train={"epochs": 2}), wiki)
    assert out["test"]["ap"] > 0.6 and 0 < out["test"]["mrr"] <= 1


@pytest.mark.parametrize("model", ["dysat", "sage"])
def test_other_models_run_a_step(model, wiki):
    cfg = small_config(model={"name": model}, train={"epochs": 1}, data={"max_events": 1500})
    learner = ContinualLearner(cfg, load_stream("wikipedia", 1500))
    learner.run_phase1()
    record = learner.step()
    assert 0 <= record["ap"] <= 1


@pytest.mark.gpu
def test_continual_run_on_cuda(wiki):
    cfg = small_config(device="cuda", train={"epochs": 1}, data={"max_events": 1500})
    learner = ContinualLearner(cfg, load_stream("wikipedia", 1500))
    learner.run()
    assert learner.model.memory.memory.is_cuda and learner.done


def test_job_entry_point_runs_and_writes_json_lines(tmp_path, capsys):
    from tidegraph.jobs.train import main

    args = ["--max-events", "1500", "--increments", "2", "--epochs", "1", "--no-progress"]
    args += ["--backend", "local", "--shards", "1", "--trainers", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(args + ["--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)  # the job sets its own thread count
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    out = capsys.readouterr().out
    assert len(lines) == 3
    screen = out[out.index(f"run {tmp_path.name} ({tmp_path})") :].splitlines()
    assert len(screen) <= 25, screen
    last = json.loads(lines[-1])
    final = (f"  final (increment 2): AP {last['ap']:.4f}  AUC {last['auc']:.4f}  MRR "
             f"{last['mrr']:.4f}  old AP ")  # fmt: skip
    assert any(line.startswith(final) for line in screen), screen
    assert "local backend; 2 increments" in screen[1]
    assert screen[-2:] == [f"  summary: {tmp_path}/summary.json",
                           f"  report: python -m tidegraph.jobs.report {tmp_path} "
                           f"(writes {tmp_path}/report.html)"]  # fmt: skip
    assert main(["--model", "nope"]) == 2


# ---- determinism and checkpoints -----------------------------------------------------------


def _metrics(history):
    """The history without wall-clock rates, which differ between runs."""
    return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in history]


def _params(learner):
    return {k: v.clone() for k, v in learner.model.state_dict().items()}


def test_same_seed_gives_bitwise_identical_runs(wiki):
    cfg = dict(continual={"replay": "importance"}, sampler={"strategy": "uniform"})
    runs = []
    for _ in range(2):
        learner = ContinualLearner(small_config(**cfg), wiki)
        learner.run()
        runs.append((_params(learner), learner.history))
    (p1, h1), (p2, h2) = runs
    assert p1.keys() == p2.keys()
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    assert _metrics(h1) == _metrics(h2)


_RESUME = textwrap.dedent(
    """
    import sys, torch
    from tidegraph.training import ContinualLearner, RunConfig
    torch.set_num_threads(int(sys.argv[3]))  # float sums in matmuls depend on the thread count
    cfg = RunConfig.from_dict(torch.load(sys.argv[1], weights_only=False)["config"])
    learner = ContinualLearner(cfg)
    learner.load_state_dict(torch.load(sys.argv[1], weights_only=False)["state"])
    while not learner.done:
        learner.step()
    torch.save({"model": learner.group.trainers[0].state_dict()["model"],
                "history": learner.history,
                "state": learner.group.node_state()}, sys.argv[2])
    """
)


@pytest.mark.parametrize(
    "cluster",
    [{}, {"shards": 2, "trainers": 2}, {"shards": 3, "trainers": 2, "memory": "sharded"}],
)
def test_checkpoint_resumes_in_a_new_process_to_the_same_result(tmp_path, cluster):
    over = dict(
        continual={"num_increments": 3}, train={"epochs": 1}, sampler={"strategy": "uniform"}
    )
    cfg = small_config(**over, cluster=cluster)
    full = ContinualLearner(cfg)
    full.run()
    part = ContinualLearner(cfg)
    part.run_phase1()
    part.step()
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"config": cfg.to_dict(), "state": part.state_dict()}, ckpt)
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    out = tmp_path / "out.pt"
    threads = str(torch.get_num_threads())
    cmd = [sys.executable, str(script), str(ckpt), str(out), threads]
    subprocess.run(cmd, check=True, timeout=300)
    resumed = torch.load(out, weights_only=False)
    ref = full.group.trainers[0].state_dict()["model"]
    assert [k for k in ref if not torch.equal(resumed["model"][k], ref[k])] == []
    assert _metrics(resumed["history"]) == _metrics(full.history)

    def flat(x) -> list[torch.Tensor]:
        if isinstance(x, dict | list):
            return [t for v in (x.values() if isinstance(x, dict) else x) for t in flat(v)]
        return [torch.as_tensor(x)]

    want, got = flat(full.group.node_state()), flat(resumed["state"])
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_checkpoint_records_slot_precision_and_a_different_one_warns(caplog):
    learner = ContinualLearner(small_config(model={"name": "tgn", "slot_precision": "fp32"}))
    state = learner.state_dict()
    assert state["orchestrator"]["slot_precision"] == "fp32"
    learner.load_state_dict(state)
    assert "slot projections" not in caplog.text
    state["orchestrator"]["slot_precision"] = "bf16"
    with caplog.at_level("WARNING", logger="tidegraph.training.continual"):
        learner.load_state_dict(state)
    assert "checkpoint was trained with bf16 slot projections, this process uses fp32" in (
        caplog.text
    )


# ---- metrics, replay, increments -----------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=12),
    st.lists(st.integers(0, 5), min_size=1, max_size=12),
)
def test_auc_and_mrr_match_pairwise_counting(pos, neg):
    p, n = torch.tensor(pos, dtype=torch.float64), torch.tensor(neg, dtype=torch.float64)
    pairs = [(a > b) + 0.5 * (a == b) for a in pos for b in neg]
    assert roc_auc(p, n) == pytest.approx(sum(pairs) / len(pairs))
    ranks = [1 + sum(b > a for b in neg) + 0.5 * sum(b == a for b in neg) for a in pos]
    assert mrr(p, n.expand(len(pos), -1)) == pytest.approx(sum(1 / r for r in ranks) / len(pos))


def test_average_precision_on_a_hand_computed_case():
    pos = torch.tensor([0.9, 0.5, 0.5, 0.2])
    neg = torch.tensor([0.5, 0.1, 0.3, 0.95])
    assert average_precision(pos, neg) == pytest.approx((0.5 + 2 * 0.6 + 4 / 7) / 4)
    assert average_precision(torch.tensor([1.0, 2.0]), torch.tensor([0.0])) == 1.0


def test_importance_replay_is_unbiased_and_prefers_changed_nodes(wiki):
    ev = wiki.events
    replay = ImportanceReplay(seed=0, floor=0.1)
    pool, new = ev.select(slice(0, 2000)), ev.select(slice(2000, 2500))
    degree = node_degree(torch.zeros(0, dtype=torch.int64), ev.select(slice(0, 2500)), 0)
    new = node_degree(torch.zeros(0, dtype=torch.int64), new, degree.numel())
    s = replay.scores(pool, new, degree)
    f = (pool.src % 7).double()  # any per-event quantity
    pos, w = replay.select(pool, new, degree, 200_000)
    assert float((f[pos] * w).mean()) == pytest.approx(float(f.mean()), rel=0.02)
    assert float(s[pos].mean()) > float(s.mean())


def test_importance_replay_beyond_two_to_the_24_old_events():
    # torch.multinomial refuses more than 2^24 categories; the replay must not
    n = 2**24 + 1000
    src = torch.arange(n) % 1000
    ev = EventBatch(src, src + 1000, torch.arange(n, dtype=torch.float64), torch.arange(n))
    degree = node_degree(torch.zeros(0, dtype=torch.int64), ev, 0)
    pool, new = ev.select(slice(0, n - 500)), ev.select(slice(n - 500, n))
    new = node_degree(torch.zeros(0, dtype=torch.int64), new, degree.numel())
    pos, w = ImportanceReplay(seed=0).select(pool, new, degree, 100)
    assert pos.shape == w.shape == (100,) and int(pos.max()) < n - 500 and (w > 0).all()


def test_increments_by_count_and_by_time_window():
    t = torch.tensor([0.0, 1, 2, 3, 10, 11, 25, 26, 27, 28], dtype=torch.float64)
    by_count = increment_bounds(t, 2, ContinualConfig(increment_events=3))
    assert by_count == [(2, 5), (5, 8), (8, 10)]
    by_window = increment_bounds(t, 2, ContinualConfig(increment_window=10.0))
    assert by_window == [(2, 6), (6, 10)]  # windows [2, 12), [22, 32): anchored at t=2
    assert increment_bounds(t, 0, ContinualConfig(num_increments=3)) == [(0, 4), (4, 8), (8, 10)]


# ---- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"model": {"name": "gat9"}}, "model.name"),
        ({"model": {"name": "tgat"}, "sampler": {"fanouts": [10]}}, "sampler.fanouts"),
        ({"model": {"name": "tgn", "num_layers": 1}, "sampler": {"fanouts": [5, 5]}}, "fanouts"),
        ({"continual": {"replay_ratio": 1.5}}, "continual.replay_ratio"),
        ({"continual": {"replay_ratio": -0.1}}, "continual.replay_ratio"),
        ({"continual": {"replay": "fifo"}}, "continual.replay"),
        ({"train": {"batch_size": 0}}, "train.batch_size"),
        ({"sampler": {"strategy": "latest"}}, "sampler.strategy"),
        ({"trian": {}}, "trian"),
    ],
)
def test_bad_config_names_the_field(raw, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        RunConfig.from_dict(raw)


def test_yaml_and_flags_map_onto_run_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: tgat\n  dim: 32\ncontinual:\n  replay: importance\nseed: 7\n")
    cfg = parse_config(["--config", str(path), "--max-events", "500", "--seed", "3"])
    assert cfg.model.name == "tgat" and cfg.model.dim == 32 and cfg.sampler.fanouts == [10, 10]
    assert cfg.continual.replay == "importance" and cfg.data.max_events == 500 and cfg.seed == 3
    c = cfg.cluster  # the job's default: 2 shards and 2 trainers on Ray
    assert (c.backend, c.shards, c.trainers) == ("ray", 2, 2)
    path.write_text("cluster:\n  backend: local\n  trainers: 3\n")
    c = parse_config(["--config", str(path), "--shards", "4"]).cluster
    assert (c.backend, c.shards, c.trainers) == ("local", 4, 3)


def test_the_last_screen_of_a_run_on_remote_storage_names_its_figures_and_summary():
    """A run directory on s3:// or gs:// cannot be read by the report: the screen gives the
    mean figures and where summary.json went, and how to make the report."""
    from types import SimpleNamespace

    from tidegraph.jobs.train import final_lines

    where = SimpleNamespace(local=False, uri="s3://bucket/runs?region=x", run_name="r", path="b/r")
    result = {"model": "tgn", "dataset": "wiki", "trainers": 2, "shards": 3, "ap": 0.91,
              "auc": 0.92, "mrr": 0.7, "old_ap": 0.9}  # fmt: skip
    lines = final_lines(result, where, "runs/r/summary.json")
    assert lines == [
        "run r (s3://bucket/runs?region=x): tgn on wiki; trainers W = 2, shards P = 3",
        "  mean over increments: AP 0.9100  AUC 0.9200  MRR 0.7000  old AP 0.9000",
        "  summary: runs/r/summary.json",
        "  report: copy the run directory to a local disk, then python -m "
        "tidegraph.jobs.report DIR",
    ]
