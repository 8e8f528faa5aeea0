"""A short continual run per model, reduced to its final state and its metrics.

`python tests/reference_run.py record` wrote `tests/data/learner_reference.json` with the
single-process learner as it was before the learner split into shards, trainers and a schedule
(commit ee2f68a); `test_split.py` checks that the split reproduces it at P = W = 1. Per state
tensor the record holds a hash, and for floating-point tensors a summary (`summary`: the norm
and two random projections), because float results depend on the CPU that computes them (its
vector width: AVX2 or AVX-512 kernels of ATen, MKL and oneDNN sum in other orders): integer and
boolean state is compared bitwise, float state and metrics at tolerances that float noise stays
far below and a semantic error exceeds. The hashes and metrics are the original recording's;
the summaries were added later, on another AMD EPYC (without AVX-512), where every integer and
boolean hash still matched and float results differed from the recording by up to 1.4e-4 in
loss and 2.7e-3 in AP/AUC/MRR (Adam amplifies last-bit differences over the run's steps).
`tgat` and `jodie` were re-recorded once since, with `record tgat jodie`, when learned node
tables started growing with the nodes seen, each row's initial values drawn from the table's
own seed (a deliberate change of their initial values; TGN's and APAN's did not change).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

REFERENCE = Path(__file__).parent / "data" / "learner_reference.json"
MODELS = ("tgn", "tgat", "jodie", "apan")
FEATURE_MODELS = ("tgn", "apan")  # also run on a copy of the stream with edge features


def feature_file(directory: Path) -> Path:
    """The reference stream as a JODIE CSV with 4 edge features computed from each row."""
    from tidegraph.training.data import load_stream

    ev = load_stream("wikipedia", 1500).events
    k = torch.arange(1, 5, dtype=torch.float64)
    feat = torch.sin(ev.t.unsqueeze(1) / (1000.0 * k) + ev.src.unsqueeze(1).double())
    path = directory / "wiki_feat.csv"
    rows = ["user_id,item_id,timestamp,state_label,f0,f1,f2,f3"]
    cols = (ev.src.tolist(), ev.dst.tolist(), ev.t.tolist(), feat.tolist())
    for s, d, t, f in zip(*cols, strict=True):
        rows.append(f"{s},{d},{t!r},0," + ",".join(f"{x:.6f}" for x in f))
    path.write_text("\n".join(rows) + "\n")
    return path


def reference_config(model: str, dataset: str = "wikipedia") -> dict:
    return {
        "model": {"name": model, "dim": 16, "time_dim": 8, "memory_dim": 16},
        "data": {"max_events": 1500, "dataset": dataset},
        "train": {"batch_size": 100, "epochs": 1, "eval_negatives": 3},
        "continual": {"num_increments": 2, "forget_sample": 100, "train_fraction": 0.6},
        "progress": False,
        "out_dir": None,
        "seed": 7,
    }


def tensor_hash(x: torch.Tensor) -> str:
    x = x.detach().cpu().contiguous()
    return hashlib.sha256(x.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def summary(x: torch.Tensor) -> list[float]:
    """Norm and two projections on fixed random unit directions, in float64: each moves by
    at most the norm of a change of `x`."""
    x = x.detach().cpu().double().flatten()
    x = torch.where(torch.isfinite(x), x, 0.0)  # empty mail slots hold -inf
    gen = torch.Generator().manual_seed(x.numel())
    w = torch.randn(2, x.numel(), generator=gen, dtype=torch.float64)
    w = w / w.norm(dim=1, keepdim=True).clamp(min=1e-300)
    return [float(x.norm()), *(float(v) for v in w @ x)]


def digest(model_state: dict, history: list[dict]) -> dict:
    """Hash per state tensor, a summary per float tensor, and the metric values (exact
    floats via repr)."""
    keys = ("ap", "auc", "mrr", "old_ap", "loss", "val_ap", "replayed")
    state = sorted(model_state.items())
    return {
        "state": {k: tensor_hash(v) for k, v in state},
        "summary": {k: summary(v) for k, v in state if v.is_floating_point()},
        "metrics": [{k: repr(r[k]) for k in keys if k in r} for r in history],
    }


def run_learner(model: str, dataset: str = "wikipedia") -> dict:
    from tidegraph.training import ContinualLearner, RunConfig

    torch.set_num_threads(1)
    learner = ContinualLearner(RunConfig.from_dict(reference_config(model, dataset)))
    learner.run()
    # node state is sized by the nodes seen since the split; the recording was sized by the
    # whole file's node count, whose extra rows hold what growing to it gives
    learner.model.grow(learner.stream.num_nodes)
    return digest(learner.model.state_dict(), learner.history)


def run_all(directory: Path) -> dict:
    out = {m: run_learner(m) for m in MODELS}
    path = str(feature_file(directory))
    out.update({f"{m}+features": run_learner(m, path) for m in FEATURE_MODELS})
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["record"]:
    import tempfile

    from tidegraph.runtime import set_determinism

    set_determinism(7)
    only = sys.argv[2:]  # re-record these entries only, keep the others
    old = json.loads(REFERENCE.read_text()) if only and REFERENCE.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        new = run_all(Path(tmp))
    out = {k: (new[k] if not only or k in only else old[k]) for k in new}
    REFERENCE.write_text(json.dumps(out, indent=1) + "\n")
