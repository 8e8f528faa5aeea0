"""The run's Prometheus endpoint, scraped by a real Prometheus (Debian package) on loopback."""

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from tidegraph.orchestrator import Orchestrator, RunState
from tidegraph.orchestrator.metrics import RunMetrics
from tidegraph.training import RunConfig, load_stream


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expr)}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["data"]["result"]


@pytest.fixture
def finished_run():
    cfg = RunConfig.from_dict({
        "model": {"name": "tgn", "dim": 16, "time_dim": 8, "memory_dim": 16},
        "data": {"max_events": 2000},
        "train": {"epochs": 1, "eval_negatives": 3},
        "continual": {"num_increments": 2, "forget_sample": 100},
        "cluster": {"shards": 2, "trainers": 2}, "progress": False, "out_dir": None,
    })  # fmt: skip
    metrics = RunMetrics(0)
    orchestrator = Orchestrator(cfg, load_stream("wikipedia", 2000), metrics=metrics)
    while orchestrator.step() not in (RunState.FINISHED, RunState.ERRORED):
        pass
    assert orchestrator.state is RunState.FINISHED
    yield orchestrator, metrics
    metrics.close()


def test_prometheus_scrapes_the_run_metrics(finished_run, tmp_path):
    orchestrator, metrics = finished_run
    binary = shutil.which("prometheus")
    assert binary, "the Debian package prometheus must be installed (tests/system/install.sh)"
    web = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tidegraph\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{metrics.port}']\n"
    )
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        result, deadline = [], time.monotonic() + 60
        while not result and time.monotonic() < deadline:
            time.sleep(1)
            try:
                result = query(web, "tidegraph_events_ingested_total")
            except OSError:  # not listening yet
                result = []
        assert result, "Prometheus never scraped the endpoint"
        learner = orchestrator.learner
        assert float(result[0]["value"][1]) == learner.ingested
        ap = float(query(web, "tidegraph_increment_ap")[0]["value"][1])
        assert ap == pytest.approx(learner.history[-1]["ap"], rel=1e-9)
        assert float(query(web, "tidegraph_trainers_alive")[0]["value"][1]) == 2
        assert float(query(web, "tidegraph_increments_total")[0]["value"][1]) == 2
        state = query(web, "tidegraph_controller_state == 1")  # the run is done
        assert [r["metric"]["tidegraph_controller_state"] for r in state] == ["finished"]
        phases = query(web, "tidegraph_step_seconds_total")
        assert {r["metric"]["phase"] for r in phases} >= {"sample", "compute", "allreduce"}
        sent = float(query(web, "tidegraph_allreduce_bytes_total")[0]["value"][1])
        assert sent > 0
        assert float(query(web, "tidegraph_trainers")[0]["value"][1]) == 2
        assert float(query(web, "tidegraph_recoveries_total")[0]["value"][1]) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_resizes_and_recoveries_are_counted_once_each():
    """A scripted group whose membership changes between two records: each resize is
    counted once, by direction, and so is each recovery (from the groups' event lists)."""
    from types import SimpleNamespace

    group = SimpleNamespace(num_trainers=2, resizes=[], recoveries=[], shard_resizes=[],
                            shard_actors=1, alive=lambda: (2, 1))  # fmt: skip
    learner = SimpleNamespace(group=group, ingested=0, cursor=SimpleNamespace(step=0))
    metrics = RunMetrics(0)
    try:
        group.resizes.append({"from": 2, "to": 1})
        metrics.observe(learner, {}, [], 0)
        group.resizes += [{"from": 1, "to": 3}, {"from": 3, "to": 2}]
        group.recoveries.append({"lost": [1]})
        group.num_trainers = 2
        metrics.observe(learner, {}, [], 0)
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    finally:
        metrics.close()
    assert 'tidegraph_resizes_total{direction="grow"} 1.0' in text
    assert 'tidegraph_resizes_total{direction="shrink"} 2.0' in text
    assert "tidegraph_recoveries_total 1.0" in text
    assert "tidegraph_trainers 2.0" in text


def test_closing_the_metrics_server_frees_its_port():
    metrics = RunMetrics(0)
    port = metrics.port
    metrics.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # would raise EADDRINUSE if still listening
    again = RunMetrics(port)
    assert again.port == port
    again.close()


def test_store_host_listens_on_its_host_and_serves_the_group():
    import datetime
    import socket

    import torch.distributed as dist

    from tidegraph.comm.collective import StoreHost

    host = StoreHost("127.0.0.1")
    addr, port = host.address()
    assert addr == "127.0.0.1"
    # its host's address only: 127.0.0.2 reaches this machine too, but nothing listens there
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    client = dist.TCPStore(addr, port, is_master=False,
                           timeout=datetime.timedelta(seconds=10))  # fmt: skip
    client.set("k", "v")
    assert host.store.get("k") == b"v"
