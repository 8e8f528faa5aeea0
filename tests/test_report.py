"""The run report (`python -m tidegraph.jobs.report`) of real runs: its one-screen summary
says what metrics.jsonl and summary.json hold, its page embeds every figure (a headless
Chromium loads each image), the markers of recoveries, resizes and partition moves carry
their reasons, and bad input or a missing matplotlib ends it with a message and exit code 2.

The default suite reports a small run of the local backend (with a timeline), and the same
run with the membership records the Ray group writes (their shapes as `training.records`
writes them) put into its metrics.jsonl; the slow one reports a Ray run with a trainer
killed, an operator's resize and a partition move, and the bottleneck the what-if model
names from its timeline."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tidegraph.jobs import report, train

SMALL = {
    "model": {"dim": 16, "time_dim": 8, "memory_dim": 16, "slot_precision": "fp32"},
    "data": {"dataset": "wikipedia", "max_events": 1000},
    "train": {"batch_size": 100, "eval_negatives": 3},
    "continual": {"num_increments": 2, "forget_sample": 100, "train_fraction": 0.6},
    "seed": 7,
}
# what the Ray group writes before a record when its membership changed (recovering.py,
# roster.py, shard_hosts.py, shard_table.py), put before the first and second increments
MEMBERSHIP = {
    0: [{"phase": "recovery", "lost": [1], "lost_shards": [], "source": 0, "steps_done": 3,
         "lost_replicas": [], "copied_to": [1], "spares_used": [], "dropped": [],
         "generation": 1, "seconds": 2.5, "cause": "RayActorError"},
        {"phase": "resize", "from": 2, "to": 1, "left": [{"rank": 1, "member": 1, "node": "n"}],
         "joined": [], "reason": "trainers: target 1 < 2 trainers", "at": "step 9",
         "generation": 2, "seconds": 0.4, "time": 1.0}],
    1: [{"phase": "shard_resize", "from": 2, "to": 1, "moves": 1, "reason": "operator",
         "at": "step 12", "seconds": 1.2, "time": 2.0},
        {"phase": "shard_move", "part": 1, "from_node": "a", "to_node": "b", "events": 640,
         "at": "step 12", "reason": "operator", "time": 2.0}],
}  # fmt: skip


def _job(out: Path, config: dict, *flags: str) -> None:
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["--config", str(path), "--out", str(out), "--no-progress", *flags]
    assert train.main(argv) == 0


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Path:
    """Phase 1 and 2 increments of 1000 wikipedia events on the local backend, every 2nd
    step recorded."""
    out = tmp_path_factory.mktemp("report") / "local"
    _job(out, SMALL, "--backend", "local", "--timeline", "2")
    return out


@pytest.fixture(scope="module")
def marked_run(local_run, tmp_path_factory) -> Path:
    """`local_run` with the membership records of `MEMBERSHIP` in its metrics.jsonl, and the
    feature cache's figures a CUDA run's increment records hold (a CPU run's cache is a
    pass-through)."""
    out = tmp_path_factory.mktemp("report") / "marked"
    shutil.copytree(local_run, out)
    lines = []
    for line in (local_run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        lines += [json.dumps(m) for m in MEMBERSHIP.get(r.get("increment"), [])]
        if r["phase"] == "increment":
            r.update(edge_cache_hit_rate=0.5 + 0.1 * r["increment"], edge_cache_capacity=64)
        lines.append(json.dumps(r))
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return out


def records(run: Path) -> tuple[dict, list[dict]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["phase"] == "phase1"), [
        r for r in rows if r["phase"] == "increment"
    ]


def _report(capsys, *argv: str) -> tuple[int, str, str]:
    code = report.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def expected_lines(run: Path) -> list[str]:
    """What the summary must say, computed here from the run's files."""
    _, inc = records(run)
    last = inc[-1]
    summary = json.loads((run / "summary.json").read_text())

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in inc)

    # each increment but the last, evaluated again at the end: its drop, their mean
    per = summary["forgetting_per_increment"]
    assert [(f["increment"], f["ap"]) for f in per] == [(r["increment"], r["ap"]) for r in inc[:-1]]
    assert all(f["drop"] == f["ap"] - f["ap_at_end"] for f in per)
    assert statistics.fmean(f["drop"] for f in per) == pytest.approx(summary["forgetting"])
    worst = max(per, key=lambda f: f["drop"])
    return [
        f"most: increment {worst['increment'] + 1}, {worst['drop']:+.4f}",
        f"final (increment {len(inc)}): AP {last['ap']:.4f}  AUC {last['auc']:.4f}  MRR "
        f"{last['mrr']:.4f}  old AP {last['old_ap']:.4f}",
        f"mean over increments: AP {mean('ap'):.4f}  AUC {mean('auc'):.4f}  MRR {mean('mrr'):.4f}",
        f"forgetting: {summary['forgetting']:.4f} ",
        f"events/s: train {mean('train_events_per_s'):,.0f}, eval "
        f"{mean('eval_events_per_s'):,.0f} (mean over increments)",
        f"{summary['model']} on {summary['dataset']}; trainers W = {summary['trainers']}, "
        f"shards P = {summary['shards']} (at the end)",
    ]


def test_the_summary_says_what_the_run_recorded(local_run, tmp_path, capsys):
    html = tmp_path / "page.html"
    code, out, err = _report(capsys, local_run, "--out", html)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) <= 25, out
    for want in expected_lines(local_run):
        assert any(want in line for line in lines), (want, out)
    assert "events: 0 recoveries, 0 resizes, 0 shard resizes, 0 partition moves" in out
    assert f"report: {html}" in out
    # the step split's top 3 are the phases of the trainers' recorded steps
    assert re.search(r"step \([\d.]+ ms, mean of 2 trainers\): \w+ [\d.]+ ms \(\d+%\)", out), out
    # the what-if model reads the ray backend's trainer steps only, and says so
    assert "bottleneck: not known: the what-if model reads trainers' steps of the ray" in out
    page = html.read_text()
    assert page.count("<img ") == 4, "quality, throughput, step split, all-reduce bits"
    assert "Not drawn: this run kept no feature cache" in page  # wikipedia has no features
    assert "comm.compression none: every bucket goes fp32" in page
    _self_contained(page)


def _self_contained(page: str) -> None:
    """No external URL: images are data: URIs, and nothing links out."""
    assert not re.search(r'(src|href)="(?!data:image/png;base64,)', page)
    assert "http:" not in page and "https:" not in page  # (":" is not in base64's alphabet)


def test_markers_carry_their_reasons(marked_run, capsys):
    code, out, err = _report(capsys, marked_run)
    assert code == 0, err
    assert "events: 1 recovery, 1 resize, 1 shard resize, 1 partition move" in out
    assert "feature cache: hit rate 0.600 (cumulative, end of run)" in out
    page = (marked_run / "report.html").read_text()
    rows = re.findall(r"<tr><td>(\w\d)</td><td[^>]*>([^<]+)</td><td[^>]*>([^<]+)</td>", page)
    assert rows == [("R1", "recovery", "increment 1"), ("Z1", "resize", "increment 1"),
                    ("S1", "shard resize", "increment 2"),
                    ("M1", "partition move", "increment 2")]  # fmt: skip
    assert "trainer [1] lost (RayActorError); trainer 0 copied to [1]" in page
    assert "trainers: target 1 &lt; 2 trainers (step 9); left: ranks [1]" in page
    assert "operator (1 partitions moved, step 12)" in page
    assert "partition 1 (640 events) from node a to b (step 12)" in page


def test_without_a_timeline_the_timeline_figures_say_why(local_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(local_run, run, ignore=shutil.ignore_patterns("timeline"))
    code, out, err = _report(capsys, run)
    assert code == 0, err
    page = (run / "report.html").read_text()
    assert page.count("<img ") == 3  # quality, throughput, bits (compression none: 32)
    assert page.count("Not drawn: no timeline/ in the run directory (record one with") == 1
    assert "step split: no timeline/ in the run directory" in out
    assert "bottleneck: not known: no timeline/ in the run directory" in out


def _damaged(run: Path, what: str) -> str:
    """Damage `run` in one way; the text the error must contain."""
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    trace = run / "timeline" / "00001.json"
    if what == "no metrics":
        metrics.unlink()
        return f"{metrics}: missing"
    if what == "bad line":
        metrics.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
        return f"{metrics}: line 2 is not JSON"
    if what == "no ap":
        r = json.loads(lines[1])
        del r["ap"]
        metrics.write_text("\n".join([lines[0], json.dumps(r), *lines[2:]]) + "\n")
        return f"{metrics}: line 2: increment record has no number 'ap'"
    if what == "metrics not UTF-8":
        metrics.write_bytes(metrics.read_bytes().replace(b"phase1", b"ph\xe4se1", 1))
        return f"{metrics}: not UTF-8 text"
    if what == "summary":
        (run / "summary.json").write_text("{")
        return f"{run / 'summary.json'}: not JSON"
    if what == "timeline a list":  # the first file: its otherData is read (an AttributeError)
        first = run / "timeline" / "00000.json"
        first.write_text("[]")
        return f"{first}: no traceEvents list"
    if what == "timeline not UTF-8":
        trace.write_bytes(b'{"traceEvents": [], "otherData": {"host": "\xff"}}')
        return f"{trace}: not UTF-8 text"
    trace.write_text('{"traceEvents": [')
    return f"{trace}: not JSON"


@pytest.mark.parametrize("what", ["no metrics", "bad line", "no ap", "metrics not UTF-8",
                                  "summary", "timeline", "timeline a list",
                                  "timeline not UTF-8"])  # fmt: skip
def test_a_damaged_run_directory_is_named(local_run, tmp_path, capsys, what):
    run = tmp_path / "run"
    shutil.copytree(local_run, run)
    want = _damaged(run, what)
    code, out, err = _report(capsys, run)
    assert code == 2
    assert want in err and "Traceback" not in err, err
    assert not (run / "report.html").exists()


def test_a_trace_the_what_if_model_cannot_read_names_no_bottleneck(local_run, tmp_path, capsys):
    """A ray timeline whose forward spans lack args.events: the report is written, and its
    bottleneck line says why none is named."""
    run = tmp_path / "run"
    _ray_like(local_run, run, world=2)
    for path in (run / "timeline").glob("*.json"):
        doc = json.loads(path.read_text())
        for e in doc["traceEvents"]:
            if e["name"] == "forward":
                e["args"].pop("events", None)
        path.write_text(json.dumps(doc))
    code, out, err = _report(capsys, run)
    assert code == 0, err
    assert re.search(r"bottleneck: not known: .*'events'", out), out
    assert "bottleneck: not known" in (run / "report.html").read_text()


def test_unknown_compression_is_not_called_fp32(local_run, tmp_path, capsys):
    """Without a timeline, config.yaml and summary.json, the bits per bucket are not known."""
    run = tmp_path / "run"
    shutil.copytree(local_run, run, ignore=shutil.ignore_patterns("timeline", "*.yaml",
                                                                   "summary.json"))  # fmt: skip
    code, _, err = _report(capsys, run)
    assert code == 0, err
    page = (run / "report.html").read_text()
    assert "Not drawn: no all-reduce was recorded; the compression is not known" in page
    assert "every bucket goes fp32" not in page


# ---- the ray backend's all-reduce spans, put into the local run's timeline -------------------


def _ray_like(src: Path, out: Path, world: int, alone_from: int | None = None) -> None:
    """`src` copied to `out` as the ray backend records it with `world` trainers: each
    recorded training step of trainers 0..world-1 gets the "allreduce" and "step" spans a Ray
    trainer adds (`Trainer._trace_allreduce`, fp32: bits [32], bytes of a ring all-reduce;
    a lone trainer sends 0 bytes); the other trainers' spans are dropped. `alone_from`: from
    that step on, trainer 0 alone (a resize to 1)."""
    from tidegraph.comm.buckets import ring_bytes

    shutil.copytree(src, out)
    for path in sorted((out / "timeline").glob("*.json")):
        doc = json.loads(path.read_text())
        meta = doc["otherData"]
        meta.update(backend="ray", trainers=world)
        names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
        steps: dict = {}
        kept = []
        for e in doc["traceEvents"]:
            name, a = names.get((e["pid"], e["tid"]), ""), e.get("args", {})
            if name.startswith("trainer") and e["ph"] == "X" and a.get("pass") == "train":
                rank = int(name.split()[1])
                lone = alone_from is not None and a["step"] >= alone_from
                if rank >= (1 if lone else world):
                    continue
                steps.setdefault((e["pid"], e["tid"], a["step"]), []).append(e)
            kept.append(e)
        for (pid, tid, step), spans in steps.items():
            w = 1 if alone_from is not None and step >= alone_from else world
            nbytes = ring_bytes(meta["grad_values"] * 4, w)
            t0 = min(e["ts"] for e in spans)
            t1 = max(e["ts"] + e["dur"] for e in spans)
            back = max(e["ts"] + e["dur"] for e in spans if e["name"] == "backward")
            events = sum(e["args"]["events"] for e in spans if e["name"] == "forward")
            label = {"step": step, "pass": "train"}
            kept.append({"name": "allreduce", "cat": "step", "ph": "X", "ts": back, "dur": 0.0,
                         "pid": pid, "tid": tid, "args": {**label, "bytes": nbytes,
                         "bytes_fp32": nbytes, "bits": [32], "world": w}})  # fmt: skip
            kept.append({"name": "step", "cat": "step", "ph": "X", "ts": t0, "dur": t1 - t0,
                         "pid": pid, "tid": tid, "args": {**label, "world": w,
                         "events": events, "global_size": events * w}})  # fmt: skip
        doc["traceEvents"] = kept
        path.write_text(json.dumps(doc))
    if world == 1:  # the records say so too
        for name in ("metrics.jsonl", "summary.json"):
            text = (out / name).read_text().replace('"trainers": 2', '"trainers": 1')
            (out / name).write_text(text)


def test_a_lone_trainer_sends_nothing(local_run, tmp_path, capsys):
    """W = 1 on the ray backend: its all-reduce spans carry no peers, so the summary says
    there was no all-reduce (no NaN bytes, no empty bits) and the traffic figure is not
    drawn; the same run with 2 trainers has its bytes and bits."""
    lone, pair = tmp_path / "lone", tmp_path / "pair"
    _ray_like(local_run, lone, world=1)
    _ray_like(local_run, pair, world=2)
    code, out, err = _report(capsys, lone)
    assert code == 0, err
    assert "all-reduce: none (a lone trainer)" in out
    assert "nan" not in out.lower() and "[]" not in out, out
    page = (lone / "report.html").read_text()
    assert "Not drawn: a lone trainer (W = 1) all run" in page
    assert page.count("<img ") == 3  # quality, throughput, step split
    code, out, err = _report(capsys, pair)
    assert code == 0, err
    values = json.loads((pair / "timeline" / "00000.json").read_text())["otherData"]["grad_values"]
    mb = values * 4 / 1e6  # a ring all-reduce, W = 2: each rank sends 2 (W - 1) / W of fp32
    want = f"all-reduce: {mb:.3f} MB sent a step per trainer (fp32 {mb:.3f} MB), bits per bucket"
    assert f"{want} at the end [32]" in out, out
    assert (pair / "report.html").read_text().count("<img ") == 4


def test_bits_at_the_end_are_those_of_the_last_step_with_peers(local_run, tmp_path, capsys):
    """2 trainers, then trainer 0 alone (a resize to 1): the summary's bits are the last
    step's with peers, and the figure counts the lone steps."""
    run = tmp_path / "run"
    _ray_like(local_run, run, world=2, alone_from=18)
    code, out, err = _report(capsys, run)
    assert code == 0, err
    assert re.search(r"all-reduce: [\d.]+ MB sent .* bits per bucket at the end \[32\]", out), out
    assert re.search(r"blank: \d+ steps of a lone trainer", (run / "report.html").read_text())


def test_no_such_directory(tmp_path, capsys):
    code, _, err = _report(capsys, tmp_path / "nowhere")
    assert code == 2 and f"{tmp_path / 'nowhere'}: no such run directory" in err


def test_without_matplotlib_the_summary_still_prints(local_run, tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    code, out, err = _report(capsys, local_run, "--out", tmp_path / "page.html")
    assert code == 2
    assert "pip install 'tidegraph[report]'" in err and "matplotlib" in err
    for want in expected_lines(local_run):
        assert want in out
    assert "report: no HTML written" in out
    assert not (tmp_path / "page.html").exists()


# ---- the page in a browser ---------------------------------------------------------------------

# appended to a copy of the page: once it has loaded, the body says how many images it has
# and how many of them decoded (a broken image has naturalWidth 0)
PROBE = """<script>
window.addEventListener("load", () => {
  const all = Array.from(document.images);
  document.body.dataset.images = all.length;
  document.body.dataset.loaded = all.filter(i => i.complete && i.naturalWidth > 0).length;
});
</script>"""


def chromium(*args: str) -> str:
    binary = shutil.which("chromium")
    assert binary, "the Debian package chromium must be installed (tests/system/install.sh)"
    argv = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--virtual-time-budget=10000", *args]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def loaded_images(page: Path, tmp: Path) -> tuple[int, int]:
    """(images on `page`, images that loaded) in a headless Chromium."""
    probe = tmp / f"probe-{page.name}"
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = chromium("--dump-dom", probe.as_uri())
    found = re.search(r'<body data-images="(\d+)" data-loaded="(\d+)"', dom)
    assert found, dom[:500]
    return int(found[1]), int(found[2])


def test_every_figure_loads_in_a_browser(marked_run, tmp_path, capsys):
    code, _, err = _report(capsys, marked_run)
    assert code == 0, err
    page = marked_run / "report.html"
    images, loaded = loaded_images(page, tmp_path)
    assert images == page.read_text().count("<img ") == 5  # every figure, the cache's too
    assert loaded == images
    shot = tmp_path / "report.png"
    chromium("--window-size=1100,2600", f"--screenshot={shot}", page.as_uri())
    assert shot.stat().st_size > 10_000
    # a page whose image data is damaged is caught
    broken = tmp_path / "broken.html"
    text = page.read_text()
    start = text.index("base64,") + len("base64,")
    broken.write_text(text[:start] + "AAAA" + text[start + 4 :])
    assert loaded_images(broken, tmp_path) == (5, 4)


# ---- a Ray run with a fault, a resize and a partition move ------------------------------------

RAY = {
    **SMALL,
    "data": {"dataset": "wikipedia", "max_events": 3000},
    "continual": {**SMALL["continual"], "num_increments": 3},
    "cluster": {"trainers": {"min": 1, "max": 2}, "shards": 2, "elastic_poll_s": 0.05,
                "faults": [{"trainer": 1, "step": 3, "at": "allreduce"}]},
}  # fmt: skip


def _operate(name: str, out: Path, errors: list) -> None:
    """The operator: once the run is up and has recovered from the fault, 2 -> 1 trainers,
    then a partition moved to a new shard actor."""
    from tidegraph.jobs import resize

    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline:  # bounded: the run's first increment
            if metrics.exists() and '"increment"' in metrics.read_text():
                break
            time.sleep(0.05)
        assert resize.main(["--run-name", name, "--trainers", "1"]) == 0
        assert resize.main(["--run-name", name, "--move-shard", "1"]) == 0
    except BaseException as e:  # noqa: BLE001 - the test reports it
        errors.append(e)


@pytest.mark.slow  # a Ray run: 20 s on 2 cores, besides Ray's start
def test_a_ray_run_with_a_fault_and_a_resize(
    ray_session, quick_polls, members_first, tmp_path, capsys
):
    out = tmp_path / "ray-report-run"
    errors: list = []
    operator = threading.Thread(target=_operate, args=(out.name, out, errors), daemon=True)
    operator.start()
    _job(out, RAY, "--backend", "ray", "--timeline", "2", "--run-name", out.name)
    operator.join(60)
    assert not errors, errors
    capsys.readouterr()
    code, text, err = _report(capsys, out)
    assert code == 0, err
    for want in expected_lines(out):
        assert want in text
    assert re.search(r"events: 1 recovery, 1 resize, \d+ shard resizes?, 1 partition move", text)
    assert re.search(r"bottleneck: [\w ,|-]+: [\d.]+ ms of a [\d.]+ ms step at W = 2", text), text
    page = out / "report.html"
    assert "trainer [1] lost" in page.read_text()
    assert "target 1 &lt; 2 trainers" in page.read_text()  # the operator's count
    images, loaded = loaded_images(page, tmp_path)
    assert images == loaded == 4
