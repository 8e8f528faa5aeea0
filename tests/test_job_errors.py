"""The job's own error paths, through `jobs.train.main`: a flag that contradicts the YAML, an
output that cannot be written, and a resume that asks for another model each end with one
line and exit code 2, before any work (or, for the resume, before any training)."""

from __future__ import annotations

import pytest

from tidegraph.jobs.train import main

SMALL = ["--backend", "local", "--max-events", "400", "--increments", "2", "--no-progress",
         "--metrics-port", "-1", "--trainers", "1", "--shards", "1"]  # fmt: skip


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ")
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_a_flag_the_yaml_contradicts_is_refused(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("continual:\n  increment_window: 3600\n")
    assert main(["--config", str(cfg), "--increments", "3", "--backend", "local"]) == 2
    line = _error(capsys)
    assert "--increments" in line and "increment_window" in line


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main([*SMALL, "--out", str(blocker / "run")]) == 2
    assert str(blocker) in _error(capsys)


def test_resuming_with_another_model_is_refused_naming_the_field(tmp_path, capsys):
    args = [*SMALL, "--storage", str(tmp_path), "--run-name", "r1"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--resume", "--model", "tgat"]) == 2
    assert "model.name" in _error(capsys)


@pytest.mark.parametrize("value", ["x", "3:", "1:2:3"])
def test_trainers_flag_takes_w_or_min_max(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--trainers", value])
    assert exit_.value.code == 2
    assert "W or MIN:MAX" in capsys.readouterr().err


def test_debug_shows_the_traceback_before_the_one_line(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("continual:\n  increment_window: 3600\n")
    argv = ["--config", str(cfg), "--increments", "3", "--backend", "local"]
    assert main([*argv, "--debug"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback (most recent call last):" in err
    assert err[-1].startswith("error: ") and "--increments" in err[-1]
