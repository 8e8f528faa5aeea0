"""The local Ray a ray-backend job starts for itself (`orchestrator.cluster.connect`, no
RAY_ADDRESS): the custom resources of `cluster.trainer_resources` / `shard_resources` choose no
node there, so it offers plenty of them, and a bundle asked while an old one is still held (a
moved partition's successor) is placed."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import yaml

from tidegraph.orchestrator.cluster import _local_resources
from tidegraph.orchestrator.placement import shard_bundle, trainer_bundle
from tidegraph.training import RunConfig

sys.path.insert(0, str(Path(__file__).parent))
import reference_run  # noqa: E402


@pytest.mark.parametrize(
    "cluster",
    [
        {"trainers": 1, "shards": 2, "shard_resources": {"tg_shard": 1}},
        {"trainers": {"min": 1, "max": 3}, "spare_trainers": 1, "shards": 2,
         "shard_replicas": 2, "trainer_resources": {"tg_trainer": 1, "mem": 700},
         "shard_resources": {"tg_shard": 0.5, "mem": 300}},
        {"trainers": 2, "shards": {"min": 1, "max": 4}, "shard_resources": {"tg_shard": 400}},
    ],
)  # fmt: skip
def test_a_local_ray_offers_room_beyond_what_the_actors_ask(cluster):
    """Every custom resource: what the most trainers (spares too) and shard actors (replicas
    too) ask at once, and a successor of each kind besides."""
    c = RunConfig.from_dict({"cluster": {"backend": "ray", **cluster}}).cluster
    offered = _local_resources(c)
    trainers, shards = c.max_trainers + c.spare_trainers, c.max_shards * c.shard_replicas
    for name in {**c.trainer_resources, **c.shard_resources}:
        one_t, one_s = trainer_bundle(c).get(name, 0), shard_bundle(c).get(name, 0)
        assert offered[name] >= (trainers + 1) * one_t + (shards + 1) * one_s, name
        assert offered[name] == int(offered[name])  # a node's resources are whole numbers


def _config() -> dict:
    """The reference run's TGN over 3 increments, on the ray backend: 1 trainer, 2 shard
    actors, each asking for a custom resource; CPUs to spare on 2 cores (1 asked), so that
    the custom resource is what decides."""
    raw = reference_run.reference_config("tgn")
    del raw["out_dir"]  # --out names the run directory
    raw["continual"]["num_increments"] = 3
    raw["cluster"] = {"backend": "ray", "trainers": 1, "shards": 2, "trainer_cpus": 0.5,
                      "shard_cpus": 0.25, "elastic_poll_s": 0.05,
                      "trainer_resources": {"tg_trainer": 1},
                      "shard_resources": {"tg_shard": 1}}  # fmt: skip
    return raw


def _move(name: str, out: Path, seen: dict, errors: list) -> None:
    """The operator: once the run's first increment is recorded, partition 1 to a new shard
    actor; what the local Ray offers, as seen from this process."""
    from tidegraph.jobs import resize

    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # bounded: the run's first increment
            if metrics.exists() and '"increment"' in metrics.read_text():
                break
            time.sleep(0.05)
        seen.update(ray.cluster_resources())
        assert resize.main(["--run-name", name, "--move-shard", "1"]) == 0
    except BaseException as e:  # noqa: BLE001 - the test reports it
        errors.append(e)


@pytest.mark.slow  # 20 s: a job's own Ray start and a partition move
def test_a_partition_moves_on_the_local_ray_a_job_starts(
    tmp_path, monkeypatch, quick_polls, members_first
):
    """`cluster.shard_resources` on the local Ray the job starts: partition 1's successor
    asks for a shard bundle while the old shard actor still holds its own, is placed, and
    the run ends with the move recorded (15 s on 2 cores, Ray's start included; with exactly
    the resources the first actors ask, the successor never placed and the run did not end
    within 300 s)."""
    from tidegraph.jobs import train

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():  # a cluster or job of another test, left connected
        ray.shutdown()
    out = tmp_path / "local-ray-move"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_config()))
    seen: dict = {}
    errors: list = []
    operator = threading.Thread(target=_move, args=(out.name, out, seen, errors), daemon=True)
    operator.start()
    argv = ["--config", str(path), "--out", str(out), "--run-name", out.name, "--no-progress"]
    assert train.main(argv) == 0
    operator.join(60)
    assert not errors, errors
    assert not ray.is_initialized()  # the job stopped the Ray it started
    assert seen.get("tg_shard", 0) > 2 and seen.get("tg_trainer", 0) > 1, seen
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    moves = [r for r in rows if r["phase"] == "shard_move"]
    assert [m["part"] for m in moves] == [1], moves
    assert sum(r["phase"] == "increment" for r in rows) == 3
