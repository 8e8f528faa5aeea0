"""Pre-flight checks of a job: what can be checked before any work starts fails at once, in one
line naming the flag or field; flags the YAML would silently overrule are conflicts."""

import errno
import tempfile

import pytest
import torch

from tidegraph.jobs.preflight import conflicts, preflight
from tidegraph.training.config import RunConfig

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _config(tmp_path, **top):
    raw = {"storage": str(tmp_path / "runs"), "cluster": {"backend": "local"}, **top}
    return RunConfig.from_dict(raw)


def _blocker(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return blocker


CASES = [
    # (config fields, preflight keywords (callables of tmp_path), words of the message)
    pytest.param(
        {"device": "cuda"},
        {},
        ["--device", "cuda", "needs CUDA"],
        marks=no_cuda,
        id="device cuda",
    ),  # fmt: skip
    pytest.param(
        {"device": "cuda:0", "cluster": {"backend": "ray"}},
        {},
        ["cuda:0", "CUDA"],
        marks=no_cuda,
        id="device cuda, local ray",
    ),  # fmt: skip
    pytest.param(
        {"graph_device": "pinned"},
        {},
        ["graph_device", "pinned", "CUDA"],
        marks=no_cuda,
        id="graph_device pinned",
    ),  # fmt: skip
    pytest.param(
        {},
        {"out": lambda p: str(_blocker(p) / "run")},
        ["--out: cannot write to", "is a file"],
        id="out under a file",
    ),  # fmt: skip
    pytest.param(
        {"storage": None}, {}, ["storage: cannot write to", "is a file"], id="storage under a file"
    ),
    pytest.param(
        {},
        {"quarantine": lambda p: str(p)},
        ["--quarantine", "is a directory"],
        id="quarantine a directory",
    ),  # fmt: skip
    pytest.param(
        {},
        {"quarantine": lambda p: str(_blocker(p) / "q.csv")},
        ["--quarantine", "is a file, not a directory"],
        id="quarantine under a file",
    ),  # fmt: skip
    pytest.param(
        {"data": {"quarantine": "QUARANTINE_DIR"}},
        {},
        ["data.quarantine"],
        id="data.quarantine a directory",
    ),  # fmt: skip
    pytest.param(
        {"data": {"dataset": "no/such/events.csv"}},
        {},
        ["--dataset", "no/such/events.csv", "no such file", "wikipedia"],
        id="dataset missing",
    ),  # fmt: skip
    pytest.param(
        {},
        {"follow": lambda p: str(p / "incoming")},
        ["--follow", "does not exist"],
        id="follow missing",
    ),  # fmt: skip
]


@pytest.mark.parametrize("fields, flags, words", CASES)
def test_a_problem_found_before_any_work_names_its_flag(tmp_path, fields, flags, words):
    fields = dict(fields)
    if fields.get("storage", "") is None:
        fields["storage"] = str(_blocker(tmp_path) / "runs")
    if fields.get("data", {}).get("quarantine") == "QUARANTINE_DIR":
        fields["data"] = {"quarantine": str(tmp_path)}
    config = _config(tmp_path, **fields)
    with pytest.raises(ValueError) as info:
        preflight(config, **{k: make(tmp_path) for k, make in flags.items()})
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_an_unwritable_directory_is_found_by_writing(tmp_path, monkeypatch):
    """Permission bits do not stop root, so the check writes; a refusal names the flag."""

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    config = _config(tmp_path)
    with pytest.raises(ValueError, match=r"--out: cannot write to .*Permission denied"):
        preflight(config, out=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"^storage: cannot write to .*Permission denied"):
        preflight(config)
    with pytest.raises(ValueError, match=r"--quarantine: cannot write to .*Permission denied"):
        preflight(_config(tmp_path, storage="s3://bucket/runs"), quarantine=str(tmp_path / "q"))


def test_a_sound_setup_passes_and_creates_nothing(tmp_path, monkeypatch):
    events = tmp_path / "events.csv"
    events.write_text("src,dst,time\n1,2,0.0\n")
    config = _config(tmp_path, data={"dataset": str(events)})
    preflight(config, out=str(tmp_path / "deep" / "run"), quarantine=str(tmp_path / "q.csv"))
    preflight(_config(tmp_path), follow=str(tmp_path))  # a bundled dataset; a followed dir
    preflight(_config(tmp_path, storage="gs://bucket/runs"))  # URIs: RunDir probes them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.csv"]
    # on a Ray cluster the trainers' devices are the cluster's, not this machine's
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    preflight(_config(tmp_path, device="cuda", cluster={"backend": "ray"}))


CONFLICTS = [
    # (YAML, flags given: field -> flag, words of each conflict; [] when none)
    (
        {"continual": {"increment_window": 86400.0}},
        {"continual.num_increments": "--increments"},
        [["--increments", "continual.increment_window", "86400.0"]],
    ),  # fmt: skip
    (
        {"continual": {"increment_events": 500}},
        {"continual.num_increments": "--increments"},
        [["--increments", "continual.increment_events"]],
    ),  # fmt: skip
    (
        {"run_name": "a", "storage": "s3://x"},
        {"out_dir": "--out"},
        [["--out", "run_name"], ["--out", "storage"]],
    ),  # fmt: skip
    ({"continual": {"num_increments": 4}}, {"continual.num_increments": "--increments"}, []),
    ({"continual": {"increment_window": 60.0}}, {"train.epochs": "--epochs"}, []),
    ({"continual": 5}, {"continual.num_increments": "--increments"}, []),  # from_dict says so
    ({}, {"out_dir": "--out", "continual.num_increments": "--increments"}, []),
]


@pytest.mark.parametrize("raw, flags, want", CONFLICTS)
def test_a_flag_the_yaml_would_overrule_is_a_conflict(raw, flags, want):
    found = conflicts(raw, flags)
    assert len(found) == len(want)
    for message, words in zip(found, want, strict=True):
        assert "\n" not in message
        for word in words:
            assert word in message
