"""tidegraph's TGN against PyTorch Geometric's TGN on the same data, split, batches and machine.

The PyG side follows the structure of PyG's examples/tgn.py (written here, not copied):
TGNMemory with IdentityMessage and LastAggregator, LastNeighborLoader(size=10), a one-layer
TransformerConv graph-attention embedding whose edge attributes are the time encoding of
(last update - edge time) and the raw message, and an MLP link predictor; Adam over all of it,
one random negative destination per positive, memory and neighbour loader reset each epoch.
The tidegraph side is `ContinualLearner`'s offline passes with model `tgn` (fixed time-encoding
frequencies by default, as in tidegraph's default config; PyG trains them).

Both train on the first 70% by time, validate on the next 15% and test on the last 15%, with
batches of 200 and the same learning rate. Epochs alternate between the two (ours, PyG, ours,
...) so that load from other processes on a shared machine hits both alike. Printed: test AP
and AUC (one negative per positive) and the mean training-epoch time of each; JSON goes to
benchmarks/out/vs_pyg_<dataset>_<device>[_<options>].json (a file path as `--dataset` gives
its file name's stem).

Protocols: by default tidegraph samples neighbours strictly before each event's own time, so
an event sees earlier events of its own batch (TGL's convention); PyG's TGN lets no event see
anything of its own batch. `--history batch` (`sampler.history: batch`) runs tidegraph under
PyG's protocol, like for like. `--root-dedup` sets `sampler.root_dedup` (each distinct
(node, time) root of a batch embedded once), `--also-root-dedup` adds a second tidegraph run
with another setting whose epochs alternate with the first's; `--no-pyg` times tidegraph alone.

Needs torch_geometric (not a tidegraph dependency): run it in an environment that has it,
e.g. `python -m venv --system-site-packages /tmp/pygenv && /tmp/pygenv/bin/pip install
torch_geometric && /tmp/pygenv/bin/python benchmarks/bench_vs_pyg.py`.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import machine, print_table, sync, write_json  # noqa: E402

from tidegraph.runtime import tune_host_allocator  # noqa: E402
from tidegraph.training import ContinualLearner, RunConfig, load_stream  # noqa: E402
from tidegraph.training.metrics import average_precision, roc_auc  # noqa: E402
from tidegraph.training.offline import eval_pass, train_pass


def _pyg():
    try:
        from torch_geometric.nn import TransformerConv
        from torch_geometric.nn.models.tgn import (
            IdentityMessage,
            LastAggregator,
            LastNeighborLoader,
            TGNMemory,
        )
    except ImportError as err:  # pragma: no cover - depends on the environment
        sys.exit(f"bench_vs_pyg needs torch_geometric ({err}); see the module docstring")
    return TransformerConv, IdentityMessage, LastAggregator, LastNeighborLoader, TGNMemory


class PygTGN:
    """The PyG example's model and loop, over (src, dst, t, msg) tensors."""

    def __init__(self, num_nodes: int, msg: torch.Tensor, t: torch.Tensor, device, lr: float):
        conv_cls, message_cls, last_cls, loader_cls, memory_cls = _pyg()
        dim = 100
        self.device = device
        self.msg, self.t = msg.to(device), t.long().to(device)  # PyG keeps int64 times
        self.memory = memory_cls(
            num_nodes,
            msg.shape[1],
            dim,
            dim,
            message_module=message_cls(msg.shape[1], dim, dim),
            aggregator_module=last_cls(),
        ).to(device)
        self.conv = conv_cls(dim, dim // 2, heads=2, dropout=0.1, edge_dim=msg.shape[1] + dim).to(
            device
        )
        self.pred = _PygLinkPredictor(dim).to(device)
        self.loader = loader_cls(num_nodes, size=10, device=device)
        params = set(self.memory.parameters()) | set(self.conv.parameters())
        self.optimizer = torch.optim.Adam(params | set(self.pred.parameters()), lr=lr)
        self.assoc = torch.empty(num_nodes, dtype=torch.long, device=device)

    def _embed(self, n_id_in: torch.Tensor):
        n_id, edge_index, e_id = self.loader(n_id_in)
        self.assoc[n_id] = torch.arange(n_id.size(0), device=self.device)
        z, last_update = self.memory(n_id)
        rel_t = last_update[edge_index[0]] - self.t[e_id]
        edge_attr = torch.cat([self.memory.time_enc(rel_t.to(z.dtype)), self.msg[e_id]], -1)
        return self.conv(z, edge_index, edge_attr)

    def _scores(self, src, dst, neg):
        z = self._embed(torch.cat([src, dst, neg]).unique())
        a = self.assoc
        return self.pred(z[a[src]], z[a[dst]]), self.pred(z[a[src]], z[a[neg]])

    def _observe(self, src, dst, t, e):
        self.memory.update_state(src, dst, t, self.msg[e])
        self.loader.insert(src, dst)

    def train_epoch(self, batches) -> float:
        self.memory.train(), self.conv.train(), self.pred.train()
        self.memory.reset_state()
        self.loader.reset_state()
        bce = nn.BCEWithLogitsLoss()
        for src, dst, t, e, neg in batches:
            self.optimizer.zero_grad()
            pos, negl = self._scores(src, dst, neg)
            loss = bce(pos, torch.ones_like(pos)) + bce(negl, torch.zeros_like(negl))
            self._observe(src, dst, t, e)
            loss.backward()
            self.optimizer.step()
            self.memory.detach()
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self, batches) -> dict:
        self.memory.eval(), self.conv.eval(), self.pred.eval()
        pos_all, neg_all = [], []
        for src, dst, t, e, neg in batches:
            pos, negl = self._scores(src, dst, neg)
            pos_all.append(pos.squeeze(-1).cpu())
            neg_all.append(negl.squeeze(-1).cpu())
            self._observe(src, dst, t, e)
        pos, neg = torch.cat(pos_all), torch.cat(neg_all)
        return {"ap": average_precision(pos, neg), "auc": roc_auc(pos, neg)}


class _PygLinkPredictor(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_src, self.lin_dst, self.lin_final = (
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
            nn.Linear(dim, 1),
        )

    def forward(self, z_src, z_dst):
        return self.lin_final((self.lin_src(z_src) + self.lin_dst(z_dst)).relu())


def _pyg_batches(ev, lo, hi, size, dst_range, gen, device):
    out = []
    for s in range(lo, hi, size):
        e = torch.arange(s, min(s + size, hi))
        neg = torch.randint(dst_range[0], dst_range[1] + 1, (e.numel(),), generator=gen)
        out.append(tuple(x.to(device) for x in (ev.src[e], ev.dst[e], ev.t[e].long(), e, neg)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--max-events", type=int, default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trainable-time-encoding",
        action="store_true",
        help="tidegraph side: train the time-encoding frequencies (default: fixed, GraphMixer)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (both sides)")
    p.add_argument("--history", choices=("event", "batch"), default="event",
                   help="tidegraph's sampler.history (batch: PyG's protocol)")  # fmt: skip
    p.add_argument("--root-dedup", choices=("auto", "always", "never"), default="auto",
                   help="tidegraph's sampler.root_dedup")  # fmt: skip
    p.add_argument("--also-root-dedup", choices=("auto", "always", "never"), default=None,
                   help="a second tidegraph run with this root_dedup, its epochs alternating "
                   "with the first's (a paired timing under the same load)")  # fmt: skip
    p.add_argument("--no-pyg", action="store_true", help="time tidegraph alone")
    args = p.parse_args()
    tune_host_allocator()  # as the job does (in bench_vs_pyg: for both systems, one process)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    stream = load_stream(args.dataset, args.max_events)
    ev = stream.events
    n = len(ev)
    train_end, val_end = int(0.70 * n), int(0.70 * n) + int(0.15 * n)
    modes = [args.root_dedup] + ([args.also_root_dedup] if args.also_root_dedup else [])
    ours = {f"tidegraph/{m}": _ours(args, stream, m) for m in modes}

    torch.manual_seed(args.seed)
    # PyG's message store cannot hold zero-width messages; one zero column carries nothing
    msg = torch.zeros(n, max(stream.edge_dim, 1))
    pyg = None if args.no_pyg else PygTGN(stream.num_nodes, msg, ev.t, device, args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    dst_range = (int(ev.dst.min()), int(ev.dst.max()))
    mk = lambda lo, hi: _pyg_batches(ev, lo, hi, args.batch_size, dst_range, gen, device)

    times = {name: [] for name in ours} | {"pyg": []}
    # CPU seconds of this process too: on a shared machine other processes' load stretches
    # wall time (time slicing) far more than the CPU time a pass needs
    cpu = {name: [] for name in times}
    for epoch in range(args.epochs):
        for name, learner in ours.items():
            learner.model.reset_state()
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            train_pass(learner, 0, train_end, f"{name} epoch {epoch + 1}")
            sync(device)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            eval_pass(learner, train_end, val_end, f"{name} val", observe=True)
        if pyg is not None:
            batches = mk(0, train_end)
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            pyg.train_epoch(batches)
            sync(device)
            times["pyg"].append(time.perf_counter() - t0)
            cpu["pyg"].append(time.process_time() - c0)
            pyg.evaluate(mk(train_end, val_end))
        shown = ", ".join(
            f"{k} {v[-1]:.2f} s (cpu {cpu[k][-1]:.2f})" for k, v in times.items() if v
        )
        print(f"epoch {epoch + 1}: {shown}", flush=True)
    tests = {name: eval_pass(learner, val_end, n, f"{name} test", observe=True)
             for name, learner in ours.items()}  # fmt: skip
    rows = [_row(f"tidegraph TGN ({args.history} history, root_dedup {name.split('/')[1]})",
                 test, times[name], cpu[name]) for name, test in tests.items()]  # fmt: skip
    if pyg is not None:
        rows.append(_row("PyG TGN", pyg.evaluate(mk(val_end, n)), times["pyg"], cpu["pyg"]))
    print(
        f"\n{stream.name}: {n} events, split 70/15/15, batch {args.batch_size}, "
        f"{args.epochs} epochs, lr {args.lr}, history {args.history}, {machine()}"
    )
    print_table(rows)
    speedup = None
    if pyg is not None:
        speedup = rows[-1]["epoch_s"] / rows[0]["epoch_s"]
        speedup_cpu = rows[-1]["epoch_cpu_s"] / rows[0]["epoch_cpu_s"]
        ap_diff = 100 * (rows[0]["test_ap"] - rows[-1]["test_ap"])
        print(
            f"epoch speedup (PyG / tidegraph): {speedup:.2f}x (CPU time {speedup_cpu:.2f}x); "
            f"AP difference (tidegraph - PyG): {ap_diff:+.2f} points"
        )
    if len(ours) == 2:
        ratio = rows[1]["epoch_s"] / rows[0]["epoch_s"]
        ratio_cpu = rows[1]["epoch_cpu_s"] / rows[0]["epoch_cpu_s"]
        print(f"epoch time {modes[1]} / {modes[0]}: {ratio:.3f} (CPU time {ratio_cpu:.3f})")
    path = write_json(
        f"vs_pyg_{_file_part(args.dataset)}_{device.type}{_suffix(args)}.json",
        {
            "dataset": stream.name,
            "events": n,
            "args": vars(args),
            "rows": rows,
            "epoch_times": times,
            "epoch_cpu_times": cpu,
            "speedup": speedup,
            "tidegraph_test": tests[f"tidegraph/{modes[0]}"],
        },
    )
    print(f"wrote {path}")


def _ours(args, stream, root_dedup: str) -> ContinualLearner:
    """tidegraph's learner over the whole stream (ingested; negatives from PyG's range)."""
    cfg = RunConfig.from_dict(
        {
            "model": {"name": "tgn", "time_trainable": args.trainable_time_encoding},
            "sampler": {"history": args.history, "root_dedup": root_dedup},
            "train": {"batch_size": args.batch_size, "lr": args.lr, "epochs": args.epochs},
            "seed": args.seed,
            "device": args.device,
            # deterministic mode is process-wide: on CUDA it would also put PyG's scatters on
            # slower deterministic kernels, so it is off there (CPU kernels are unaffected)
            "deterministic": torch.device(args.device).type == "cpu",
            "out_dir": None,
            "progress": False,
        }
    )
    ev = stream.events
    ours = ContinualLearner(cfg, stream)
    ours.negatives.pool = torch.arange(int(ev.dst.min()), int(ev.dst.max()) + 1)
    ours.ingest(0, len(ev))
    ours.negatives.pool = torch.arange(int(ev.dst.min()), int(ev.dst.max()) + 1)
    return ours


def _row(system: str, test: dict, epoch_times: list[float], cpu_times: list[float]) -> dict:
    return {
        "system": system,
        "test_ap": test["ap"],
        "test_auc": test["auc"],
        "epoch_s": sum(epoch_times) / len(epoch_times),
        "epoch_cpu_s": sum(cpu_times) / len(cpu_times),
    }


def _file_part(dataset: str) -> str:
    """A bundled name as it is; a file path as its file name's stem (no directories, no
    characters a file name should not hold)."""
    name = Path(dataset).name
    for ext in (".gz", ".bz2", ".xz", ".zst"):
        name = name.removesuffix(ext)
    stem = Path(name).stem if Path(dataset).suffix else name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) or "dataset"


def _suffix(args) -> str:
    parts = ["_trainable_time" if args.trainable_time_encoding else ""]
    parts.append("_batch_history" if args.history == "batch" else "")
    parts.append("" if args.root_dedup == "auto" else f"_root_dedup_{args.root_dedup}")
    parts.append(f"_vs_{args.also_root_dedup}" if args.also_root_dedup else "")
    parts.append("_no_pyg" if args.no_pyg else "")
    return "".join(parts)


if __name__ == "__main__":
    main()
