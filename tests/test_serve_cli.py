"""`python -m tidegraph.jobs.serve` as a user runs it: a missing run or one without a checkpoint
ends with one line and exit code 2 before Ray starts; a run is served on loopback by a local Ray
of the job's own (started and stopped by it), answering /status and /score, and Ctrl-C stops
it with exit code 0 and leaves no Ray process behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serving import free_port, http, make_run, run_config  # noqa: E402
from test_job_submit import cluster_pids  # noqa: E402

SERVE = [sys.executable, "-m", "tidegraph.jobs.serve"]


def _env(ray_tmp: str | None = None) -> dict:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    if ray_tmp is not None:  # the job's local Ray under a directory of its own
        env["RAY_TMPDIR"] = ray_tmp
    return env


BAD_STARTS = [
    (["--run-name", "nope"], "error: serve: no run 'nope' under"),
    (["--run-name", "empty"], "error: serve: run 'empty' has no checkpoint yet"),
    (["--run-name", "empty", "--replicas", "0"], "error: --replicas: N >= 1 or MIN:MAX"),
    (["--run-name", "empty", "--replicas", "3:2"], "error: --replicas: N >= 1 or MIN:MAX"),
    (["--run-name", "empty", "--resources", "[1]"], "error: --resources: a JSON object"),
    (["--run-name", "empty", "--port", "70000"], "error: --port: a port number"),
    (["--run-name", "empty", "--poll-s", "0"], "error: --poll-s: a positive number"),
    (["--run-name", "empty", "--device", "tpu"], "error: --device: cpu or cuda"),
    (["--run-name", "empty", "--device", "cuda"], "error: --device cuda: give each replica"),
    (["--run-name", "empty", "--detach"], "error: --detach: leaves the application on a"),
    (["--run-name", "empty", "--route-prefix", "x"], "error: --route-prefix: must start"),
]


def _empty_run(storage: Path) -> None:
    """A run directory that holds a run but no checkpoint yet."""
    (storage / "empty").mkdir()
    (storage / "empty" / "config.yaml").write_text("seed: 1\n")


@pytest.mark.parametrize("args, message", BAD_STARTS)
def test_bad_starts_end_with_one_line_and_exit_code_2(tmp_path, capsys, monkeypatch, args, message):
    from tidegraph.jobs.serve import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    _empty_run(tmp_path)
    assert main(["--storage", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err, err


def test_a_missing_run_ends_the_command_before_ray_starts(tmp_path):
    """As a user types it: one line on stderr, exit code 2, and no Ray started."""
    _empty_run(tmp_path)
    for args, message in BAD_STARTS[:2]:
        done = subprocess.run([*SERVE, "--storage", str(tmp_path), *args], capture_output=True,
                              text=True, timeout=120, env=_env())  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr == message + done.stderr[len(message) :].split("\n")[0] + "\n"
        assert "Ray" not in done.stderr


# the command as a machine without the `serve` extra runs it: its web framework not importable
WITHOUT = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # an import of it fails as a module not installed does
sys.argv = ["tidegraph.jobs.serve", *sys.argv[2:]]
runpy.run_module("tidegraph.jobs.serve", run_name="__main__")
"""


@pytest.mark.parametrize("missing", ["starlette", "fastapi", "starlette,fastapi"])
def test_serving_without_the_serve_extra_says_how_to_install_it(tmp_path, missing):
    """One line naming the missing module and the extra, exit code 2, no traceback, no Ray."""
    make_run(tmp_path, "r", run_config("tgn"))
    done = subprocess.run([sys.executable, "-c", WITHOUT, missing, "--storage", str(tmp_path),
                           "--run-name", "r"], capture_output=True, text=True, timeout=120,
                          env=_env())  # fmt: skip
    assert done.returncode == 2, done.stderr
    first = missing.split(",")[0]
    assert done.stderr == (
        f"error: serving needs Ray Serve and its web framework (no module "
        f"named '{first}'): pip install 'tidegraph[serve]'\n"
    ), done.stderr
    assert "serving run" not in done.stdout


def test_the_job_serves_a_run_on_loopback_until_interrupted(tmp_path):
    make_run(tmp_path, "r", run_config("tgn"))
    port = free_port()
    log = tmp_path / "serve.log"
    ray_tmp = tempfile.mkdtemp(prefix="tgserve", dir="/tmp")  # short: Ray's socket paths
    pids: list[int] = []
    with log.open("w") as out:
        job = subprocess.Popen([*SERVE, "--run-name", "r", "--storage", str(tmp_path), "--port",
                                str(port), "--num-cpus", "0.5"], stdout=out,
                               stderr=subprocess.STDOUT, env=_env(ray_tmp))  # fmt: skip
    try:
        for _ in range(1200):  # bounded: until it says it serves
            if "serving run r on http://127.0.0.1:" in log.read_text() or job.poll() is not None:
                break
            time.sleep(0.1)
        assert job.poll() is None, log.read_text()[-3000:]
        pids = cluster_pids(ray_tmp)
        assert pids, "no Ray process under the job's RAY_TMPDIR"
        status, answer = http(f"http://127.0.0.1:{port}/status")
        assert status == 200 and answer["run"] == "r" and answer["lag_events"] == 0
        body = {"src": [1, 2], "dst": [8300, 8301], "t": answer["last_event_time"] + 1}
        status, answer = http(f"http://127.0.0.1:{port}/score", body)
        assert status == 200 and len(answer["scores"]) == 2
        assert all(0.0 <= p <= 1.0 for p in answer["scores"])
        job.send_signal(signal.SIGINT)
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=60)
        left = cluster_pids(ray_tmp)
        for pid in left if job.returncode != 0 else ():  # a failed job's Ray: ours, by id
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    for _ in range(300):  # bounded: Ray's processes leave after the job
        if not any(_alive(p) for p in pids):
            break
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "Ray processes of the job are left"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
