"""`ray job submit` against a real head started with `ray start --head` on loopback, with Ray's
token authentication on and off (slow: a head start, a package upload and a short run)."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_pids(temp_dir: str) -> list[int]:
    """The cluster's processes: those whose command line names `temp_dir` (its session lives
    there), and all their descendants (dashboard modules, agents and workers rename
    themselves)."""
    roots, parent = set(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        if temp_dir.encode() in cmdline:
            roots.add(int(entry))
    mine, pid = set(), os.getpid()  # never this process or its ancestors
    while pid > 1 and pid not in mine:
        mine.add(pid)
        pid = parent.get(pid, 1)
    found = frontier = roots - mine
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found - mine
        found = found | frontier
    return sorted(found)


def stop_cluster(temp_dir: str) -> None:
    """Stop the cluster's processes by their ids: SIGTERM, then SIGKILL after 15 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in cluster_pids(temp_dir):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 15
        while cluster_pids(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("auth", ["token", "disabled"])
def test_ray_job_submit_runs_the_job_to_success(auth, tmp_path):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="tgray", dir="/tmp")  # short: Ray's socket paths
    env = {**os.environ, "RAY_AUTH_MODE": auth, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    port, dash = free_port(), free_port()
    start = [
        RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=4",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
        # the head's agents on free ports: Ray's fixed defaults (52365, ...) may be held by
        # another Ray instance on this machine, and the job agent would never come up
        *(f"--{flag}={free_port()}" for flag in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
            "runtime-env-agent-port", "metrics-export-port", "ray-client-server-port")),
    ]  # fmt: skip
    try:
        subprocess.run(start, env=env, check=True, timeout=120, capture_output=True)
        out_dir = tmp_path / "out"
        submit = [
            RAY, "job", "submit", f"--address=http://127.0.0.1:{dash}",
            f"--working-dir={ROOT}", "--",
            "python", "-m", "tidegraph.jobs.train", "--max-events", "3000", "--increments",
            "2", "--epochs", "1", "--no-progress", "--out", str(out_dir),
        ]  # fmt: skip
        deadline = time.monotonic() + 180  # the head's job agent comes up after `ray start`
        while True:  # (tens of seconds on a loaded box)
            done = subprocess.run(submit, env=env, timeout=600, capture_output=True, text=True)
            log = done.stdout + done.stderr
            if "No available agent to submit job" not in log or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert done.returncode == 0, log[-3000:]
        assert re.search(r"Job '\S+' succeeded", log), log[-3000:]
        rows = re.findall(r"^\s+(\d+)\s+\d+\s+(0\.\d+)\s+0\.\d+", log, re.MULTILINE)
        assert [r[0] for r in rows] == ["1", "2"], log[-3000:]  # per-increment AP lines
        assert (out_dir / "summary.json").exists()
        assert '"trainers": 2' in (out_dir / "summary.json").read_text()
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert cluster_pids(temp_dir) == []
