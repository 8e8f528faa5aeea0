"""Configuration errors are one-line ValueErrors naming the field to fix: wrong types (a bool is
no integer), unknown keys (with the close match), sections that are no mapping, YAML files that
are missing, broken or not a mapping."""

import pytest

from tidegraph.comm.config import CommConfig
from tidegraph.config_check import read_yaml
from tidegraph.models.config import ModelConfig
from tidegraph.training.config import RunConfig, TrainConfig, read_config

BAD = [
    # (raw config, words the message must hold)
    ({"train": {"batch_size": "big"}}, ["train.batch_size", "an integer", "'big'"]),
    ({"train": {"batch_size": True}}, ["train.batch_size", "an integer", "True"]),
    ({"train": {"epochs": 2.5}}, ["train.epochs", "an integer"]),
    ({"train": {"lr": "fast"}}, ["train.lr", "a number"]),
    ({"train": {"lr": False}}, ["train.lr", "a number"]),
    ({"sampler": {"fanouts": 10}}, ["sampler.fanouts", "a list of integers"]),
    ({"sampler": {"fanouts": [10, "x"]}}, ["sampler.fanouts[1]", "an integer"]),
    ({"sampler": {"fanouts": [True]}}, ["sampler.fanouts[0]", "an integer"]),
    ({"sampler": {"dedup": "yes please"}}, ["sampler.dedup", "true or false"]),
    ({"model": {"dim": "100"}}, ["model.dim", "an integer"]),
    ({"model": {"name": 3}}, ["model.name", "a string"]),
    ({"model": {"time_trainable": 1}}, ["model.time_trainable", "true or false"]),
    ({"model": {"name": "edgebank", "edgebank_window": -1}}, ["model.edgebank_window", ">= 0"]),
    (
        {"model": {"name": "edgebank", "edgebank_window": float("inf")}},
        ["model.edgebank_window", "finite"],
    ),
    ({"model": {"edgebank_window": 5.0}}, ["model.edgebank_window", "EdgeBank option", "'tgn'"]),
    ({"model": {"name": "edgebank", "num_layers": 1}}, ["model.num_layers must be 0", "edgebank"]),
    ({"data": {"max_events": True}}, ["data.max_events", "an integer or null"]),
    ({"data": {"dataset": None}}, ["data.dataset", "got null"]),
    ({"continual": {"increment_window": "day"}}, ["continual.increment_window", "a number"]),
    ({"continual": {"num_increments": True}}, ["continual.num_increments"]),
    ({"cluster": {"trainers": "2"}}, ["cluster.trainers", "an integer"]),
    ({"cluster": {"faults": 3}}, ["cluster.faults", "a list"]),
    ({"cluster": {"trainer_gpus": 2}}, ["cluster.trainer_gpus", "(0, 1]", "2"]),
    ({"cluster": {"trainer_gpus": 0}}, ["cluster.trainer_gpus", "(0, 1]"]),
    ({"cluster": {"trainer_resources": ["tg"]}}, ["cluster.trainer_resources", "a mapping"]),
    ({"cluster": {"trainer_resources": {"tg": 0}}}, ["cluster.trainer_resources['tg']", "> 0"]),
    ({"cluster": {"shard_resources": {"tg": "1"}}}, ["cluster.shard_resources['tg']", "'1'"]),
    ({"cluster": {"shard_resources": {"tg": True}}}, ["cluster.shard_resources['tg']"]),
    ({"cluster": {"shard_resources": {1: 1}}}, ["cluster.shard_resources", "names", "1"]),
    ({"cluster": {"trainer_resources": {"CPU": 2}}}, ["cluster.trainer_resources", "trainer_cpus"]),
    ({"comm": {"adaptive_bits": [8, "x"]}}, ["comm.adaptive_bits[1]"]),
    ({"comm": {"error_feedback": "no"}}, ["comm.error_feedback"]),
    ({"seed": "zero"}, ["seed", "an integer"]),
    ({"threads": True}, ["threads", "an integer or null"]),
    ({"offline_split": [0.5]}, ["offline_split", "a list of 2 numbers"]),
    ({"device": "tpu"}, ["device", "'cpu', 'cuda' or 'cuda:N'", "'tpu'"]),
    ({"device": "cuda:x"}, ["device", "'cuda:x'"]),
    ({"graph_device": "disk"}, ["graph_device", "'disk'"]),
    ({"train": 5}, ["train must be a mapping", "5"]),
    ({"model": ["tgn"]}, ["model must be a mapping"]),
    ({"train": {"batchsize": 3}}, ["train: unknown keys ['batchsize']", "'batch_size'"]),
    ({"sampler": {"fanout": [1]}}, ["sampler: unknown keys", "'fanouts'"]),
    ({"modle": {"name": "tgn"}}, ["top level: unknown keys ['modle']", "'model'"]),
    ({"comm": {"bits": 8}}, ["comm: unknown keys ['bits']", "known:"]),
    ([{"model": "tgn"}], ["maps section names", "list"]),
    ("model: tgn", ["maps section names", "str"]),
]


@pytest.mark.parametrize("raw, words", BAD, ids=[str(r)[:40] for r, _ in BAD])
def test_a_bad_config_is_one_line_naming_the_field(raw, words):
    with pytest.raises(ValueError) as info:
        RunConfig.from_dict(raw)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


GOOD = [
    ({"train": {"lr": "1e-3"}}, lambda c: c.train.lr == 1e-3),  # PyYAML reads 1e-3 as text
    ({"train": {"lr": 1}}, lambda c: c.train.lr == 1),
    ({"sampler": {"snapshot_window": 60}}, lambda c: c.sampler.snapshot_window == 60),
    ({"offline_split": [0.6, 0.2]}, lambda c: c.offline_split == (0.6, 0.2)),
    ({"comm": {"adaptive_bits": [8, 4]}}, lambda c: c.comm.adaptive_bits == (8, 4)),
    ({"train": None, "model": None}, lambda c: c.train == TrainConfig()),
    ({"device": "cuda:1"}, lambda c: c.graph_device == "cuda:1"),
    ({"graph_device": "pinned"}, lambda c: c.graph_device == "pinned"),
    ({}, lambda c: c.data.max_events is None),
    (None, lambda c: c.model.name == "tgn"),
]


@pytest.mark.parametrize("raw, ok", GOOD, ids=[str(r)[:40] for r, _ in GOOD])
def test_well_typed_values_pass_and_are_normalised(raw, ok):
    assert ok(RunConfig.from_dict(raw))


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: ModelConfig(heads=True), "model.heads"),
        (lambda: TrainConfig(batch_size=None), "train.batch_size"),
        (lambda: CommConfig(chunk_size="256"), "comm.chunk_size"),
        (lambda: CommConfig.from_dict({"chunksize": 256}), "'chunk_size'"),
        (lambda: RunConfig(model={"name": "tgn"}), "model must be a ModelConfig"),
    ],
)
def test_sections_built_directly_check_types_too(build, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("(", r"\(")):
        build()


YAML = [
    # (file text or None for a missing file, words the message must hold)
    (None, ["--config", "missing.yaml", "cannot read"]),
    ("- a\n- b\n", ["a mapping of sections expected", "list"]),
    ("just text\n", ["a mapping of sections expected", "string"]),
    ("model: [unclosed\n", ["invalid YAML", "line 2"]),
    ("model:\n  name: tgn\n   dim: 3\n", ["invalid YAML", "line 3"]),
    ("a: 1\n\tb: 2\n", ["invalid YAML", "line 2"]),
    ("train: true\n", ["train must be a mapping", "True"]),
    ("model: tgn\n", ["model must be a mapping", "'tgn'"]),
]


@pytest.mark.parametrize("text, words", YAML)
def test_bad_yaml_files_are_one_line_naming_the_file(tmp_path, text, words):
    path = tmp_path / ("missing.yaml" if text is None else "bad.yaml")
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_config(str(path))
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    for word in words:
        assert word in message


def test_a_good_yaml_file_maps_onto_run_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: tgat\ntrain:\n  lr: 1e-3\n  batch_size: 100\n")
    config = RunConfig.from_yaml(str(path))
    assert (config.model.name, config.train.lr, config.train.batch_size) == ("tgat", 1e-3, 100)
    (tmp_path / "empty.yaml").write_text("")
    assert read_yaml(str(tmp_path / "empty.yaml")) == {}


def test_batch_history_with_several_trainers_is_accepted_everywhere():
    """Every slice carries its global batch's start on every backend and mode (the exact
    results are tests/test_fair_history.py's)."""
    from tidegraph.training.config import RunConfig

    batch = {"sampler": {"history": "batch"}}
    for cluster in ({}, {"whole_passes": False}, {"memory": "sharded"}):
        for trainers in (2, {"min": 1, "max": 2}):
            raw = batch | {"cluster": {"backend": "ray", "trainers": trainers, **cluster}}
            assert RunConfig.from_dict(raw).sampler.history == "batch"


@pytest.mark.parametrize(
    "cluster, gpus, share",
    [
        ({"trainers": 2}, 1, 0.5),  # two trainers on a one-GPU machine share it
        ({"trainers": 2}, 2, 1.0),
        ({"trainers": 2}, 8, 1.0),
        ({"trainers": 4}, 3, 0.5),  # 2 a GPU: 0.75 each would fit only 3 trainers
        ({"trainers": 3}, 1, 1 / 3),
        ({"trainers": {"min": 1, "max": 4}}, 2, 0.5),  # slots for the most trainers
        ({"trainers": 2, "spare_trainers": 1}, 2, 0.5),  # and the spares
        ({"trainers": 2}, 0, 1.0),  # none yet: whole GPUs, the placement wait says so
        ({"trainers": 2, "trainer_gpus": 0.25}, 8, 0.25),  # set: as set
    ],
)
def test_trainers_share_the_gpus_there_are(cluster, gpus, share):
    from tidegraph.orchestrator.placement import trainer_gpu_share

    config = RunConfig.from_dict({"cluster": cluster})
    assert trainer_gpu_share(config.cluster, gpus) == pytest.approx(share)


def test_bundles_carry_the_custom_resources():
    """`cluster.trainer_resources` / `shard_resources` join each trainer's and shard actor's
    bundle (spares, replacements, successors and resizes ask for the same bundles)."""
    from tidegraph.orchestrator.placement import shard_bundle, trainer_bundle

    raw = {"trainer_cpus": 0.5, "shard_cpus": 0.25, "trainer_resources": {"tg_trainer": 1},
           "shard_resources": {"tg_shard": 0.5, "ssd": 1}}  # fmt: skip
    c = RunConfig.from_dict({"cluster": {"backend": "ray", **raw}}).cluster
    assert trainer_bundle(c) == {"CPU": 0.5, "tg_trainer": 1}
    assert trainer_bundle(c, 0.5) == {"CPU": 0.5, "GPU": 0.5, "tg_trainer": 1}  # on CUDA
    assert shard_bundle(c) == {"CPU": 0.25, "tg_shard": 0.5, "ssd": 1}
    plain = RunConfig.from_dict({}).cluster
    assert (trainer_bundle(plain), shard_bundle(plain)) == ({"CPU": 1.0}, {"CPU": 0.5})
