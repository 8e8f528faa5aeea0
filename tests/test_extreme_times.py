"""Times far from the stream's: training on a stream in milliseconds whose gaps reach 1e12,
and serving queries at times up to the largest float64 and at ids beyond any seen.

Every model trains without NaN on such a stream (its recorded losses and metrics finite, every
parameter and node-state row of its checkpoint finite), and its served state answers `/score`,
`/topk` and `/embed` at any finite time at or after it with finite values (with the default
slot precision: on the CPU the per-slot encodings take the bfloat16 cosine, which overflowed
to NaN beyond gaps of ~1e7 before). The HTTP side of it (a millisecond time through Ray
Serve) is in `test_serve.py`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tidegraph.models.config import MODELS
from tidegraph.models.registry import spec
from tidegraph.serving.engine import QueryError, RunSource, ServedState

sys.path.insert(0, str(Path(__file__).parent))
from serving import make_run, run_config  # noqa: E402

GAP = 1e12  # the jump in the middle of the stream (in its unit, milliseconds)
GAPS = [1e10, 1e12, 1e15, 1e20, 1e300]  # after the served state's last event


def gapped_csv(path: Path, n: int = 1200) -> Path:
    """Wikipedia's first `n` events with times in milliseconds and, halfway, a jump of
    `GAP`: the second half's nodes meet again after 1e12 (and so does the time encoding)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from tidegraph.training.data import load_stream

    ev = load_stream("wikipedia", n).events
    t = ev.t * 1000.0
    t[n // 2 :] += GAP
    pacsv.write_csv(pa.table({"src": ev.src.numpy(), "dst": ev.dst.numpy(), "time": t.numpy()}),
                    path)  # fmt: skip
    return path


def _all_finite(tensors) -> bool:
    """Every float tensor finite (an empty mail slot's -inf timestamp excepted: APAN marks
    free slots so)."""
    for name, x in tensors:
        if torch.is_tensor(x) and x.is_floating_point():
            x = x[x != -math.inf] if "mail_t" in name or name.endswith("_t") else x
            if not bool(torch.isfinite(x).all()):
                print("not finite:", name)
                return False
    return True


def _walk(obj, prefix=""):
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{prefix}[{i}]")


LOCAL = [(m, "replicated") for m in MODELS]
LOCAL += [(m, "sharded") for m in ("tgn", "jodie", "apan", "tpnet")]  # those with node state


@pytest.mark.parametrize(("model", "memory"), LOCAL)
def test_a_stream_with_gaps_of_1e12_trains_and_serves_finite(tmp_path, model, memory):
    _trains_and_serves_finite(tmp_path, model, memory, "local")


@pytest.mark.parametrize(("model", "memory"), [("tgn", "replicated"), ("apan", "sharded")])
def test_on_ray_a_stream_with_gaps_of_1e12_trains_and_serves_finite(ray_session, tmp_path,
                                                                    model, memory):  # fmt: skip
    _trains_and_serves_finite(tmp_path, model, memory, "ray")


def _trains_and_serves_finite(tmp_path, model, memory, backend):
    config = run_config(model, memory=memory, backend=backend)
    config.model.slot_precision = "auto"  # the default: the bf16 cosine on the CPU
    config.data.dataset = str(gapped_csv(tmp_path / "events.csv"))
    config.data.max_events = None
    run = make_run(tmp_path, "r", config)

    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    values = [v for r in records for k, v in r.items() if k in ("loss", "ap", "auc", "mrr")]
    assert len(values) > 4 and all(math.isfinite(v) for v in values), records
    source = RunSource(str(tmp_path), "r")
    state = source.checkpoints.load(source.latest())
    assert _all_finite(_walk(state))

    served = ServedState(source)
    served.catch_up()
    seen = source.events.read(0, served.offset)
    ids = [int(seen.src[-1]), int(seen.dst[-1]), 10**15, -(2**63)]
    src, dst = served.nodes(ids, "src"), served.nodes(ids[::-1], "dst")
    for t in [served.last_t, *(served.last_t + g for g in GAPS), sys.float_info.max]:
        ts = served.times(t, len(ids))
        scores = served.score(src, dst, ts)
        assert bool(torch.isfinite(scores).all()), (t, scores)
        if spec(model).embeds:  # (dygformer encodes pairs: no embedding of a node alone)
            assert bool(torch.isfinite(served.embed(src, ts)).all()), t
        best, probs = served.topk(int(src[0]), t, 5)
        assert len(best) == 5 and bool(torch.isfinite(probs).all()), t
    with pytest.raises(QueryError, match="an id is out of the int64 range"):
        served.nodes([2**63], "src")
    with pytest.raises(QueryError, match="times must be finite"):
        served.times(math.inf, 1)
