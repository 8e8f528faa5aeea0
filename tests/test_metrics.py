"""The run's Prometheus endpoint, scraped by a real Prometheus (Debian package) on loopback."""

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tidegraph.orchestrator import Orchestrator, RunState
from tidegraph.orchestrator.metrics import STATES, RunMetrics
from tidegraph.training import RunConfig, load_stream


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_query(port: int, expr: str) -> dict:
    """Prometheus's answer to an instant query: status, and data or error (also on a 400)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expr)}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as err:  # a query Prometheus rejects: 400 with a JSON body
        return json.loads(err.read())


def query(port: int, expr: str) -> list:
    answer = api_query(port, expr)
    assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
    return answer["data"]["result"]


@pytest.fixture
def finished_run(request):
    """A finished 2-trainer local run with its metrics server; an indirect parameter adds
    config sections."""
    cfg = RunConfig.from_dict({
        "model": {"name": "tgn", "dim": 16, "time_dim": 8, "memory_dim": 16},
        "data": {"max_events": 2000},
        "train": {"epochs": 1, "eval_negatives": 3},
        "continual": {"num_increments": 2, "forget_sample": 100},
        "cluster": {"shards": 2, "trainers": 2}, "progress": False, "out_dir": None,
        **getattr(request, "param", {}),
    })  # fmt: skip
    metrics = RunMetrics(0)
    orchestrator = Orchestrator(cfg, load_stream("wikipedia", 2000), metrics=metrics)
    while orchestrator.step() not in (RunState.FINISHED, RunState.ERRORED):
        pass
    assert orchestrator.state is RunState.FINISHED
    yield orchestrator, metrics
    metrics.close()


@pytest.fixture
def prometheus(finished_run, tmp_path):
    """A real Prometheus scraping the run's endpoint every second (job "tidegraph"); yields
    its web port once it holds a sample."""
    _, metrics = finished_run
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
        yield web
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_prometheus_scrapes_the_run_metrics(finished_run, prometheus):
    orchestrator, _ = finished_run
    web = prometheus
    result = query(web, "tidegraph_events_ingested_total")
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


DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "tidegraph.json"
# compressed gradients, so that the bucket bits are exported too (eager codec: no compile)
COMPRESSED = {"comm": {"compression": "q8", "warmup_steps": 0, "min_bucket_bytes": 0,
                       "codec": "eager"}}  # fmt: skip
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows and the panels of collapsed rows included."""
    return [q for p in dashboard["panels"] for q in [p, *p.get("panels", [])]]


def series_names(exposition: str) -> tuple[set, set]:
    """The run's metric families (`# TYPE` names, counters with `_total`) and every series
    name a query may use (a histogram's `_bucket`, `_sum`, `_count`); `_created` left out."""
    families = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE tidegraph_") and not line.split()[2].endswith("_created"):
            families[line.split()[2]] = line.split()[3]
    names = set(families)
    for name, kind in families.items():
        if kind in ("histogram", "summary"):
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return set(families), names


def metric_names(expr: str) -> set:
    """Metric names in a PromQL expression (label matchers and groupings left out: the
    controller state's label is named like its metric)."""
    return set(re.findall(r"\btidegraph_[a-z_]+", GROUPING.sub("", re.sub(r"{[^}]*}", "", expr))))


def to_promql(expr: str, values: dict) -> str:
    """A Grafana query with its variables replaced, as Grafana sends it (KeyError: unknown)."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


@pytest.mark.parametrize("finished_run", [COMPRESSED], indirect=True)
def test_every_dashboard_panel_queries_metrics_the_run_exports(finished_run, prometheus):
    """deploy/grafana/tidegraph.json: a dashboard's shape; every query names only metrics the
    run's endpoint exports, each exported metric has a panel, and the real Prometheus accepts
    every query and answers it once it holds two scrapes; the controller-state code maps to
    the state the run ended in."""
    _, metrics = finished_run
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard_panels(dashboard)
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    for p in panels:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    targets = [(p["title"], t) for p in panels if p["type"] != "row" for t in p["targets"]]
    assert all(t["refId"] and t["expr"] for _, t in targets)
    for p in panels:
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(set(refs)) == len(refs) and (refs or p["type"] == "row"), p["title"]
        assert p["type"] == "row" or p["datasource"]["uid"] == "${datasource}", p["title"]

    values = {"__rate_interval": "1m", "__range": "1h", "job": "tidegraph",
              "instance": f"127.0.0.1:{metrics.port}"}  # fmt: skip
    exprs = [(title, to_promql(t["expr"], values)) for title, t in targets]
    for name in ("job", "instance"):  # label_values(selector, label): that label's series
        selector, label = re.fullmatch(r"label_values\((.*),\s*(\w+)\)",
                                       variables[name]["definition"]).groups()  # fmt: skip
        exprs.append((f"${name}", f"count by ({label}) ({to_promql(selector, values)})"))
    url = f"http://127.0.0.1:{metrics.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        families, names = series_names(r.read().decode())
    used = set()
    for title, expr in exprs:
        assert metric_names(expr), f"{title}: {expr} names no tidegraph metric"
        assert metric_names(expr) <= names, f"{title}: {expr}: not exported"
        used |= metric_names(expr)
    assert families <= used, f"exported without a panel: {sorted(families - used)}"

    web, deadline = prometheus, time.monotonic() + 30  # rate() needs two samples
    while time.monotonic() < deadline:
        scrapes = query(web, "count_over_time(tidegraph_events_ingested_total[1m])")
        if float(scrapes[0]["value"][1]) >= 2:
            break
        time.sleep(1)
    empty = []
    for title, expr in exprs:
        answer = api_query(web, expr)
        assert answer["status"] == "success", f"{title}: {expr}: {answer.get('error')}"
        empty += [] if answer["data"]["result"] else [f"{title}: {expr}"]
    assert not empty, "no data for:\n" + "\n".join(empty)

    (state,) = [p for p in panels if p["type"] == "state-timeline"]
    mapping = state["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {m["text"] for m in mapping.values()} == set(STATES)
    (code,) = query(web, to_promql(state["targets"][0]["expr"], values))
    assert mapping[str(int(float(code["value"][1])))]["text"] == "finished"


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
