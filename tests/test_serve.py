"""Serving a run while it learns (`tidegraph.serving`, `tidegraph.jobs.serve`).

Exactness against the learner itself: at a checkpoint, the served scores of events not
ingested yet equal the learner's evaluation scores of them from that checkpoint's state; after
the log receives the next increment, the scores the server computes while applying it equal
the learner's evaluation pass over it, logit for logit (and so its recorded AP, AUC and MRR),
and later answers equal the learner's from its state after that pass. `/topk` and `/embed`
agree with `/score`. Then the same over real Ray Serve on loopback: a Ray-backend run served
over HTTP, a checkpoint swapped in while a bounded loop of requests runs (none fails), and bad
requests answered with HTTP 400 naming the field.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tidegraph.serving.engine import QueryError, RunSource, ServedState, evaluation_metrics
from tidegraph.serving.protocol import parse_score, parse_tgb, parse_topk
from tidegraph.training.tgb import HistRndNegatives

sys.path.insert(0, str(Path(__file__).parent))
from serving import (  # noqa: E402
    evaluate_next_increment,
    features_csv,
    finish,
    free_port,
    http,
    learner_scores,
    make_run,
    reference_learner,
    run_config,
    start_run,
)

CASES = {
    "tgn": dict(model="tgn"),
    "tgn-sharded-ldg": dict(model="tgn", memory="sharded", partitioner="ldg"),
    "apan": dict(model="apan"),
    "graphmixer": dict(model="graphmixer"),
    "dygformer": dict(model="dygformer"),
    "tpnet": dict(model="tpnet", memory="sharded", partitioner="ldg"),
    "edgebank": dict(model="edgebank"),
    "tgn-features-string-ids": dict(model="tgn", data="features"),
}


def _config(case: str, tmp_path: Path):
    spec = dict(CASES[case])
    config = run_config(spec.pop("model"), **{k: v for k, v in spec.items() if k != "data"})
    if spec.get("data") == "features":
        config.data.dataset = str(features_csv(tmp_path / "events.csv"))
        config.data.features, config.data.string_ids = "a,b", True
    return config


def _assert_tgb_rank(served, learner, source, src, dst, ts) -> None:
    """TGB's protocol in serving: the positive's hist_rnd negatives with every applied event
    as history, each candidate scored as /score scores it, the rank by TGB's rule."""
    applied = _dense(learner, source.events.read(0, served.offset))
    keys = torch.unique((applied.src.long() << 32) | applied.dst.long())
    assert torch.equal(served._history().keys, keys)
    first = min(int(applied.dst.min()), int(dst[0]))
    last = max(int(applied.dst.max()), int(dst[0]))
    neg, valid = HistRndNegatives(applied.src, applied.dst, first, last, 30, 0.5,
                                  seed=4).sample(src, dst, ts)  # fmt: skip
    cand, logits, rank = served.tgb_rank(int(src[0]), int(dst[0]), float(ts[0]), 30, 4)
    assert torch.equal(cand, torch.cat([dst, neg[0][valid[0]]])) and cand.numel() == 31
    probs = served.score(src.expand(31), cand, ts.expand(31))
    torch.testing.assert_close(torch.sigmoid(logits), probs, rtol=0, atol=2e-6)
    above, tied = (logits[1:] > logits[0]).sum(), (logits[1:] == logits[0]).sum()
    assert rank == 1 + float(above) + 0.5 * float(tied)


def _dense(learner, ev):
    """`ev` (from the log: external int ids; a run of string ids logs dense ones) with the
    run's dense ids."""
    out = ev.select(slice(None))
    idmap = learner.stream.idmap
    if idmap.kind == "int" and idmap.mapped:
        out.src, out.dst = idmap.lookup(ev.src)[0], idmap.lookup(ev.dst)[0]
    return out


def _state_rows(group, ids: torch.Tensor) -> dict:
    """Every node-state table's rows of nodes `ids`, wherever the group holds them."""
    if group.state_shards is None:
        tables = group.trainers[0].model.state_tables()
        return {k: v.index_select(0, ids) for k, v in tables.items()}
    owner = group.partitioner.owner(ids)
    out = {}
    for p, shard in enumerate(group.state_shards):
        for k, v in shard.node_state.read(ids[owner == p]).items():
            out.setdefault(k, torch.zeros((len(ids), *v.shape[1:]), dtype=v.dtype))
            out[k][owner == p] = v
    return out


def _assert_same_node_state(served, learner) -> None:
    """The served state's node-state rows are the learner's, node for node (every node the
    learner holds a row of)."""
    ids = torch.arange(learner.num_nodes)
    placed = getattr(learner.group.partitioner, "map", None)
    if placed is not None:
        ids = ids[(ids < len(placed)) & (placed[ids.clamp(max=len(placed) - 1)] >= 0)]
    if learner.group.state_shards is not None:
        owner = learner.group.partitioner.owner(ids)
        held = torch.zeros(len(ids), dtype=torch.bool)
        for p, shard in enumerate(learner.group.state_shards):
            held[owner == p] = shard.node_state.index.contains(ids[owner == p])
        ids = ids[held]
    want, got = _state_rows(learner.group, ids), _state_rows(served.group, ids)
    assert sorted(want) == sorted(got) and len(ids) > 100
    whole = learner.group.trainers[0].node_state()
    if not want and whole:  # state without node rows (EdgeBank's pairs): all of it, exactly
        served_whole = served.group.trainers[0].node_state()
        assert sorted(whole) == sorted(served_whole)
        for key, x in whole.items():
            assert torch.equal(x, served_whole[key]), key
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=2e-5, msg=key)


def _ask(served, ev):
    """(src, dst, t) of events `ev` (dense ids) as a client names them, mapped back by the
    served state."""
    src = served.nodes(served.external(ev.src), "src")
    return src, served.nodes(served.external(ev.dst), "dst"), served.times(ev.t.tolist(), len(ev))


def _known(learner, ev):
    """The events of `ev` between nodes the learner holds (has seen an event of)."""
    placed = getattr(learner.group.partitioner, "map", None)
    keep = (ev.src < learner.num_nodes) & (ev.dst < learner.num_nodes)
    if placed is not None:
        keep &= (placed[ev.src.clamp(max=len(placed) - 1)] >= 0) & (ev.src < len(placed))
        keep &= (placed[ev.dst.clamp(max=len(placed) - 1)] >= 0) & (ev.dst < len(placed))
    return ev.select(keep)


def _assert_recorded(run: Path, k: int, scores: list) -> None:
    """The metrics of `catch_up(evaluate=True)`'s scores are the run's record of increment
    `k` (to float summation order: the run had 2 trainers, the state has 1; scores that are
    nearly tied, as APAN's often are, may swap places, so the ranking metrics get 1e-3)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    recorded = next(r for r in records if r.get("increment") == k)
    for key, value in evaluation_metrics(scores).items():
        assert value == pytest.approx(recorded[key], abs=1e-3), key


@pytest.mark.parametrize("case", list(CASES))
def test_served_state_is_the_learners_at_its_checkpoint_and_after_the_log_grows(tmp_path, case):
    make_run(tmp_path, "r", _config(case, tmp_path))
    source = RunSource(str(tmp_path), "r")
    tag = "increment-00001"
    served = ServedState(source, tag)
    learner = reference_learner(source, tag)
    bounds = learner.bounds
    k = learner.cursor.increment  # the next increment: not in the checkpoint
    assert served.offset == served.checkpoint_offset == bounds[k][0]
    assert served.pending() == [(bounds[k][0], bounds[k][1]), (bounds[k + 1][0], bounds[k + 1][1])]
    status = served.status()
    assert status["checkpoint"] == tag and status["applied_offset"] == bounds[k][0]
    assert status["log_offset"] == bounds[k + 1][1] and status["lag_seconds"] > 0
    assert status["lag_events"] == bounds[k + 1][1] - bounds[k][0]

    # from the checkpoint's state: events not ingested yet, scored as the learner scores them
    ev = _dense(learner, source.events.read(bounds[k][0], bounds[k][0] + 300))
    ev = _known(learner, ev)
    assert len(ev) > 100
    want = learner_scores(learner, ev)
    got = served.score(*_ask(served, ev))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)

    # the log's next increment applied: the learner's evaluation pass, logit for logit, and
    # its node state after it, node for node
    pos, neg = evaluate_next_increment(learner)
    served._history()  # TGB's history, read from the log now: kept up by the catch-up
    scores = served.catch_up(max_files=1, evaluate=True)
    _assert_same_node_state(served, learner)
    torch.testing.assert_close(torch.cat([p for p, _ in scores]), pos, rtol=0, atol=2e-5)
    torch.testing.assert_close(torch.cat([n for _, n in scores]), neg, rtol=0, atol=2e-5)
    _assert_recorded(tmp_path / "r", k, scores)
    assert served.offset == bounds[k][1]
    assert served.last_t == float(source.events.read(bounds[k][1] - 1, bounds[k][1]).t[0])

    # answers after it are the learner's from its state after that pass
    ev = _dense(learner, source.events.read(bounds[k + 1][0], bounds[k + 1][0] + 300))
    ev = _known(learner, ev)
    assert len(ev) > 100 and served.num_nodes == learner.num_nodes
    src, dst, ts = _ask(served, ev)
    assert torch.equal(src, ev.src) and torch.equal(dst, ev.dst)
    if served.idmap.kind == "str":  # ids are the file's strings
        assert served.external(src[:1])[0].startswith("u")
        with pytest.raises(QueryError, match="src: this run's node ids are strings"):
            served.nodes([1], "src")
    got = served.score(src, dst, ts)
    torch.testing.assert_close(got, learner_scores(learner, ev), rtol=0, atol=2e-6)

    # /topk ranks by the same scores; /embed gives the embeddings they come from
    pool = served.negatives.pool
    best, probs = served.topk(int(src[0]), float(ts[0]), 5)  # positions in the pool
    assert probs.shape == (5,) and bool((probs[:-1] >= probs[1:]).all())
    again = served.score(src[:1].expand(5), pool[best], ts[:1].expand(5))
    torch.testing.assert_close(probs, again, rtol=0, atol=2e-6)
    everything = served.score(src[:1].expand(len(pool)), pool, ts[:1].expand(len(pool)))
    assert float(probs[0]) == pytest.approx(float(everything.max()), abs=2e-6)
    # candidates in passes of at most eval_max_roots roots: the same ranking
    served.config.train.eval_max_roots = 50
    chunked, chunked_probs = served.topk(int(src[0]), float(ts[0]), 5)
    assert torch.equal(chunked, best)
    torch.testing.assert_close(chunked_probs, probs, rtol=0, atol=2e-6)
    served.config.train.eval_max_roots = 8192
    _assert_tgb_rank(served, learner, source, src[:1], dst[:1], ts[:1])
    if case in ("dygformer", "tpnet", "edgebank"):  # pairs scored whole: no node embedding
        with pytest.raises(QueryError, match=f"embed: model {case} scores each .src, dst. "
                           "pair jointly"):  # fmt: skip
            served.embed(src[:1], ts[:1])
        return
    z = served.embed(torch.cat([src[:20], dst[:20]]), torch.cat([ts[:20], ts[:20]]))
    model = served.trainer.model
    with torch.no_grad():
        via_embed = torch.sigmoid(model.predictor(z[:20], z[20:]))
    torch.testing.assert_close(via_embed, got[:20], rtol=0, atol=2e-5)


@pytest.mark.parametrize("placement", [dict(memory="sharded", partitioner="ldg"),
                                       dict(memory="sharded")])  # fmt: skip
def test_new_nodes_are_answered_as_new_nodes(tmp_path, placement):
    make_run(tmp_path, "r", run_config("tgn", **placement))
    source = RunSource(str(tmp_path), "r")
    served = ServedState(source)
    ev = source.events.read(0, served.offset)
    seen = torch.zeros(served.num_nodes, dtype=torch.bool)
    seen[ev.src], seen[ev.dst] = True, True
    never = int((~seen).nonzero()[0])  # an id below the largest seen that no event names
    unknown = served.nodes([10**15, -5, 10**15 + 7, never], "src")
    assert unknown.tolist() == [served.num_nodes] * 4
    unknown = unknown[:3]
    dst = served.nodes([0, 0, 0], "dst")
    t = served.times(served.last_t + 10, 3)
    scores = served.score(unknown, dst, t)
    assert bool(torch.isfinite(scores).all()) and float(scores.std()) == 0.0
    assert served.embed(unknown[:1], t[:1]).shape == (1, served.trainer.model.dim)
    placed = getattr(served.group.partitioner, "map", None)
    assert placed is None or placed.shape[0] <= served.num_nodes  # placed for the query only


def test_tgb_history_holds_a_file_ingested_before_it_is_recorded(tmp_path):
    """TGB's history first read in the middle of a catch-up (a log file ingested into the
    graph whole, its batches not recorded yet) holds that whole file, as the graph does."""
    make_run(tmp_path, "r", run_config("tgn"))
    source = RunSource(str(tmp_path), "r")
    served = ServedState(source, source.checkpoints.tags()[0])
    lo, hi = served.pending()[0]
    with served.lock:  # a catch-up's first move on a file
        served._ingest(source.events.read(lo, hi), lo, hi)
    assert served.offset == lo < hi
    ev = source.events.read(0, hi)
    src, dst = served.idmap.lookup(ev.src)[0], served.idmap.lookup(ev.dst)[0]
    assert torch.equal(served._history().keys, torch.unique(src * 2**32 + dst))


def test_queries_that_cannot_be_answered_name_the_field(tmp_path):
    from tidegraph.serving.app import answer_topk

    make_run(tmp_path, "r", run_config("tgn"))
    served = ServedState(RunSource(str(tmp_path), "r"))
    too_many = {"src": 1, "t": served.last_t, "k": 10**6, "candidates": "tgb", "dst": 8228}
    bad = [
        (lambda: parse_score({"src": [1, 2], "dst": [3], "t": 1.0}), "dst: 1 ids for 2"),
        (lambda: parse_score({"src": [1], "dst": [3]}), "t: missing"),
        (lambda: parse_score({"src": [1.5], "dst": [3], "t": 1}), "src[0]: a node id"),
        (lambda: parse_score({"src": [1], "dst": [3], "t": [1, 2]}), "t: 2 times for 1"),
        (lambda: parse_score({"src": [1], "dst": [3], "t": "now"}), "t: a number"),
        (lambda: parse_score([1, 2]), "body: a JSON object"),
        (lambda: parse_topk({"src": 1, "t": 1.0, "k": 0}), "k: a positive integer"),
        (lambda: parse_topk({"src": [1], "t": 1.0, "k": 1}), "src: one node id"),
        (lambda: parse_topk({"src": 1, "t": 1.0, "k": 3, "candidates": [4, 4]}), "k: 3 is more"),
        (lambda: parse_tgb({"src": 1, "t": 1.0, "k": 3}), "dst: missing"),
        (lambda: parse_tgb({"dst": [2]}), "dst: one node id"),
        (lambda: parse_tgb({"dst": 2, "negatives": 0}), "negatives: an integer in [1, 2**63)"),
        (lambda: parse_tgb({"dst": 2, "seed": -1}), "seed: an integer in [0, 2**63)"),
        (lambda: parse_tgb({"dst": 2, "seed": 2**64}), "seed: an integer in [0, 2**63)"),
        (lambda: answer_topk(served, too_many), "k: 1000000 is more"),
        (lambda: served.nodes(["a"], "src"), "src: this run's node ids are integers"),
        (lambda: served.times(served.last_t - 1, 1), "t: "),
        (lambda: served.times(float("nan"), 1), "t: times must be finite"),
        (lambda: served.topk(0, served.last_t, 10**6), "k: must be in [1, "),
    ]
    for call, message in bad:
        with pytest.raises(QueryError) as err:
            call()
        assert message in str(err.value)
    with pytest.raises(ValueError, match="no run 'nope' under"):
        RunSource(str(tmp_path), "nope")


@pytest.mark.gpu
def test_served_state_on_cuda_answers_as_on_cpu(tmp_path):
    make_run(tmp_path, "r", run_config("tgn"))
    source = RunSource(str(tmp_path), "r")
    tag = "increment-00001"
    cpu, gpu = ServedState(source, tag), ServedState(source, tag, "cuda")
    for a, b in zip(cpu.catch_up(1, True), gpu.catch_up(1, True), strict=True):
        torch.testing.assert_close(a[0], b[0].cpu(), rtol=1e-4, atol=1e-4)
    ev = source.events.read(cpu.offset, cpu.offset + 100)
    asked = [s.nodes(ev.src.tolist(), "src") for s in (cpu, gpu)]
    t = cpu.times(ev.t.tolist(), len(ev))
    torch.testing.assert_close(
        gpu.score(asked[1], gpu.nodes(ev.dst.tolist(), "dst"), t).cpu(),
        cpu.score(asked[0], cpu.nodes(ev.dst.tolist(), "dst"), t), rtol=1e-4, atol=1e-4,
    )  # fmt: skip
    torch.testing.assert_close(gpu.embed(asked[1], t).cpu(), cpu.embed(asked[0], t),
                               rtol=1e-3, atol=1e-3)  # fmt: skip


# ---- real Ray Serve on loopback -------------------------------------------------------------


@pytest.fixture(scope="module")
def serve_http(ray_session):
    """Ray Serve's HTTP proxy on a free loopback port of the shared Ray; shut down after."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def _deploy(run_name: str, storage: Path, **options):
    from ray import serve

    from tidegraph.serving.app import server_app

    app = server_app(run_name, str(storage), num_cpus=0.5, **options)
    serve.run(app, name="tidegraph", route_prefix="/")


def test_a_ray_run_served_over_http_answers_as_its_learner(serve_http, tmp_path):
    """The default backend's checkpoint (written by its actors) served by Ray Serve: the
    state's evaluation of the next increment gives the run's recorded metrics, and HTTP
    answers equal the in-process state's."""
    from ray import serve

    config = run_config("tgn", backend="ray")
    config.model.slot_precision = "auto"  # the default (the bf16 cosine on the CPU)
    make_run(tmp_path, "ray-run", config)
    source = RunSource(str(tmp_path), "ray-run")
    early = ServedState(source, "increment-00001")
    _assert_recorded(tmp_path / "ray-run", 1, early.catch_up(1, evaluate=True))
    served = ServedState(source)  # what a replica serves: the newest, up to the log's end
    served.catch_up()

    _deploy("ray-run", tmp_path, poll_s=0.2)
    try:
        status, answer = http(f"{serve_http}/status")
        assert status == 200
        assert answer["checkpoint"] == source.latest() == served.tag
        assert answer["applied_offset"] == answer["log_offset"] == served.offset
        assert answer["lag_events"] == 0
        ev = source.events.read(served.offset - 300, served.offset)
        t = served.last_t + 1.0
        body = {"src": ev.src.tolist(), "dst": ev.dst.tolist(), "t": t}
        status, answer = http(f"{serve_http}/score", body)
        assert status == 200, answer
        want = served.score(served.nodes(body["src"], "src"), served.nodes(body["dst"], "dst"),
                            served.times(t, len(ev)))  # fmt: skip
        assert answer["checkpoint"] == served.tag
        torch.testing.assert_close(torch.tensor(answer["scores"]), want, rtol=0, atol=1e-6)
        src = int(ev.src[0])
        status, answer = http(f"{serve_http}/topk", {"src": src, "t": t, "k": 10})
        assert status == 200, answer
        best, probs = served.topk(int(served.nodes([src], "src")[0]), t, 10)
        assert answer["dst"] == served.external(served.negatives.pool[best])
        torch.testing.assert_close(torch.tensor(answer["scores"]), probs, rtol=0, atol=1e-6)
        status, answer = http(f"{serve_http}/embed", {"nodes": [src, 10**15], "t": t})
        assert status == 200, answer
        z = served.embed(served.nodes([src, 10**15], "nodes"), served.times(t, 2))
        torch.testing.assert_close(torch.tensor(answer["embeddings"]), z, rtol=0, atol=1e-6)
        three = [10**15, int(ev.dst[0]), 10**15 + 1]  # two new nodes and a known one
        body = {"src": src, "t": t, "k": 3, "candidates": three + [10**15]}
        status, answer = http(f"{serve_http}/topk", body)
        assert status == 200 and sorted(answer["dst"]) == sorted(three), answer
        new = [p for d, p in zip(answer["dst"], answer["scores"], strict=True) if d >= 10**15]
        assert len(new) == 2 and new[0] == new[1]  # new nodes look alike
        # TGB's protocol: a positive ranked against its hist_rnd negatives
        body = {"src": src, "t": t, "k": 5, "candidates": "tgb", "dst": int(ev.dst[0]),
                "negatives": 50}  # fmt: skip
        status, answer = http(f"{serve_http}/topk", body)
        assert status == 200, answer
        s, d = served.nodes([src], "src"), served.nodes([int(ev.dst[0])], "dst")
        cand, logits, rank = served.tgb_rank(int(s[0]), int(d[0]), t, 50, 0)
        assert answer["rank"] == rank and answer["negatives"] == cand.numel() - 1 == 50
        assert answer["dst"] == served.external(cand[torch.topk(logits, 5).indices])
        status, answer = http(f"{serve_http}/topk", {**body, "dst": 10**15})
        assert status == 400 and answer["error"].startswith("dst: a node the run has not seen")

        # a time in milliseconds (the stream's are seconds), a gap of 1e15 and the largest
        # float: finite answers, as from the in-process state
        ms = served.last_t * 1000.0
        for later in (ms, served.last_t + 1e15, sys.float_info.max):
            body = {"src": [src, 10**15], "dst": [int(ev.dst[0]), int(ev.dst[1])], "t": later}
            status, answer = http(f"{serve_http}/score", body)
            assert status == 200, (later, answer)
            src_ids, dst_ids = served.nodes(body["src"], "src"), served.nodes(body["dst"], "dst")
            want = served.score(src_ids, dst_ids, served.times(later, 2))
            torch.testing.assert_close(torch.tensor(answer["scores"]), want, rtol=0, atol=1e-6)
            status, answer = http(f"{serve_http}/topk", {"src": src, "t": later, "k": 5})
            assert status == 200 and len(answer["scores"]) == 5, (later, answer)
            status, answer = http(f"{serve_http}/embed", {"nodes": [src], "t": later})
            assert status == 200 and len(answer["embeddings"][0]) > 0, (later, answer)
        status, answer = http(f"{serve_http}/score", b'{"src": [1], "dst": [1], "t": 1e999}')
        assert status == 400 and "t: times must be finite" in answer["error"], answer

        # bad requests: 400 naming the field
        for body, message in [
            (b"{not json", "body: not JSON"),
            ({"src": [1, 2], "dst": [1], "t": t}, "dst: 1 ids for 2"),
            ({"src": ["x"], "dst": [1], "t": t}, "src: this run's node ids are integers"),
            ({"src": [1], "dst": [1], "t": served.last_t - 100}, "is before the served state"),
            ({"src": [1], "dst": [1]}, "t: missing"),
        ]:
            status, answer = http(f"{serve_http}/score", body)
            assert status == 400 and message in answer["error"], (body, answer)
        for body, message in [
            ({"src": src, "t": t, "k": 0}, "k: a positive integer"),
            ({"src": src, "t": t, "k": 10**7}, "k: must be in [1, "),
            ({"src": "x", "t": t, "k": 1}, "src: this run's node ids are integers"),
        ]:
            status, answer = http(f"{serve_http}/topk", body)
            assert status == 400 and message in answer["error"], (body, answer)
        status, answer = http(f"{serve_http}/embed", {"nodes": [], "t": t})
        assert status == 400 and "nodes: empty" in answer["error"]
    finally:
        serve.delete("tidegraph")


def test_a_newer_checkpoint_is_swapped_in_under_a_request_loop(serve_http, tmp_path):
    """A local run learns in this process while Ray Serve serves it: a bounded loop of
    requests sees every answer succeed while the served checkpoint advances to the run's
    last one and the log is applied to its end."""
    from ray import serve

    orchestrator = start_run(tmp_path, "live", run_config("tgn"))
    orchestrator.step()  # phase 1: its checkpoint
    source = RunSource(str(tmp_path), "live")
    assert source.latest() == "phase1"
    _deploy("live", tmp_path, poll_s=0.1)
    answers: list[tuple[int, str | None]] = []
    stop = threading.Event()

    def loop() -> None:  # new nodes and candidates too: ids are mapped while the log applies
        score = {"src": [1, 2, 3, 10**15], "dst": [8000, 8001, 8002, 8003], "t": 1e12}
        topk = {"src": 10**15, "t": 1e12, "k": 3, "candidates": [8000, 10**15 + 1, 9000]}
        for i in range(20_000):  # bounded
            if stop.is_set():
                return
            status, answer = http(f"{serve_http}/score", score) if i % 2 else http(
                f"{serve_http}/topk", topk)  # fmt: skip
            answers.append((status, answer.get("checkpoint") or answer.get("error")))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        finish(orchestrator)
        final = source.latest()
        for _ in range(600):  # bounded: until the replica serves the final checkpoint
            status, answer = http(f"{serve_http}/status")
            if answer["checkpoint"] == final and answer["lag_events"] == 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the replica never served {final}: {answer}")
        time.sleep(0.5)  # some answers from the final state too
    finally:
        stop.set()
        thread.join(timeout=60)
        serve.delete("tidegraph")
    assert answers and all(status == 200 for status, _ in answers), [
        a for a in answers if a[0] != 200
    ][:3]
    seen = [tag for _, tag in answers]
    assert seen[0] == "phase1" and seen[-1] == final and final != "phase1"
    assert answer["swaps"] >= 1 and answer["refresh_error"] is None


def test_the_serve_config_file_is_ray_serves_and_builds_the_app(serve_http, tmp_path):
    """deploy/serve.yaml passes Ray Serve's own schema, and its application builder serves a
    run with the file's arguments (a missing run, or a wrong argument, refused by name)."""
    import yaml
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    from tidegraph.serving.app import build

    path = Path(__file__).parents[1] / "deploy" / "serve.yaml"
    config = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "tidegraph.serving.app:build"
    assert [d["name"] for d in app["deployments"]] == ["tidegraph"]
    make_run(tmp_path, "r", run_config("tgn"))
    args = {**app["args"], "run_name": "r", "storage": str(tmp_path)}
    with pytest.raises(ValueError, match="no run 'elsewhere'"):
        build({**args, "run_name": "elsewhere"})
    with pytest.raises(ValueError, match="got \\['colour', "):
        build({**args, "colour": "blue"})
    serve.run(build(args), name="tidegraph", route_prefix="/")
    try:
        status, answer = http(f"{serve_http}/status")
        assert status == 200 and answer["run"] == "r" and answer["lag_events"] == 0
    finally:
        serve.delete("tidegraph")
