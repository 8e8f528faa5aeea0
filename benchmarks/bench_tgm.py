"""TGM (PyPI `tgm-lib`), the peer library, trained on the bundled Wikipedia (= tgbl-wiki): the
seconds an epoch of TGB's training split takes with TGM's own TGN modules and hooks, to set
beside tidegraph's (`bench_tgb.py`, "train s / epoch"). Runs in TGM's environment, never in
tidegraph's (TGM needs torch_geometric):

    python3 -m venv /tmp/tgm && /tmp/tgm/bin/pip install torch==2.13.0 && \\
        /tmp/tgm/bin/pip install tgm-lib
    /tmp/tgm/bin/python benchmarks/bench_tgm.py [--epochs 2] [--threads 1]

The training loop is TGM's TGN link-prediction recipe (TGNMemory with identity messages and
last aggregation, a graph-attention embedding over the 10 most recent neighbours, TGM's link
predictor, one uniform negative a positive, batches of 200, deduplicated nodes), at
tidegraph's TGN dimensions (100 memory, time and embedding). The bundled file has no edge
features; TGM's memory wants a message, so each edge carries one zero feature. TGB's split
(the 0.70 time quantile) is computed here as in `tidegraph.training.tgb.tgb_bounds`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tgm import DGraph
from tgm.constants import PADDED_NODE_ID
from tgm.data import DGData, DGDataLoader
from tgm.hooks import DeduplicationHook, HookManager, NegativeEdgeSamplerHook, RecencyNeighborHook
from tgm.nn import LinkPredictor, TGNMemory
from tgm.nn.encoder.tgn import GraphAttentionEmbedding, IdentityMessage, LastAggregator

DATA = Path(__file__).resolve().parents[1] / "tidegraph" / "data" / "wikipedia_u_i_ts_label.csv.gz"


def train_split(path: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(edge_index [E, 2] int32, times int64) of the train split, and the node count."""
    with gzip.open(path, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", skiprows=1, dtype=np.int64)
    t = rows[:, 2]
    val_time = np.quantile(t.astype(np.float64), 0.70)
    end = int(np.searchsorted(t, val_time, "right"))
    index = torch.from_numpy(rows[:end, :2]).to(torch.int32)
    return index, torch.from_numpy(t[:end]), int(rows[:, :2].max()) + 1


def epoch(loader, memory, encoder, decoder, opt) -> tuple[float, float]:
    """One training pass as TGM's TGN recipe runs it: (seconds, mean loss)."""
    memory.train(), encoder.train(), decoder.train()
    memory.reset_state()
    t0, total, n = time.perf_counter(), 0.0, 0
    for batch in loader:
        opt.zero_grad()
        nbrs = batch.nbr_nids[0].flatten()
        real = nbrs != PADDED_NODE_ID
        per_root = len(nbrs) // (len(batch.edge_src) + len(batch.edge_dst) + len(batch.neg))
        roots = torch.cat([batch.edge_src, batch.edge_dst, batch.neg]).repeat_interleave(per_root)
        edges = torch.stack([batch.global_to_local(roots[real]),
                             batch.global_to_local(nbrs[real])]).long()  # fmt: skip
        z, last = memory(batch.unique_nids)
        z = encoder(z, last, edges, batch.nbr_edge_time[0].flatten()[real],
                    batch.nbr_edge_x[0].flatten(0, -2).float()[real])  # fmt: skip
        src = z[batch.global_to_local(batch.edge_src)]
        pos = decoder(src, z[batch.global_to_local(batch.edge_dst)])
        neg = decoder(src, z[batch.global_to_local(batch.neg)])
        loss = F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos))
        loss = loss + F.binary_cross_entropy_with_logits(neg, torch.zeros_like(neg))
        memory.update_state(batch.edge_src, batch.edge_dst, batch.edge_time,
                            batch.edge_x.float())  # fmt: skip
        loss.backward()
        opt.step()
        memory.detach()
        total, n = total + float(loss) * len(batch.edge_src), n + len(batch.edge_src)
    return time.perf_counter() - t0, total / max(n, 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dim", type=int, default=100)
    p.add_argument("--nbrs", type=int, default=10)
    p.add_argument("--batch", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--out", default="benchmarks/out/tgm.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    index, t, num_nodes = train_split(DATA)
    data = DGData.from_raw(t, index, torch.zeros(len(t), 1))
    dg = DGraph(data)
    hm = HookManager(keys=["train"])
    dst = index[:, 1]
    hm.register("train", NegativeEdgeSamplerHook(low=int(dst.min()), high=int(dst.max())))
    hm.register_shared(RecencyNeighborHook(num_nbrs=[args.nbrs], num_nodes=num_nodes,
                                           seed_nodes_keys=["edge_src", "edge_dst", "neg"],
                                           seed_times_keys=["edge_time", "edge_time",
                                                            "neg_time"]))  # fmt: skip
    hm.register_shared(DeduplicationHook())
    loader = DGDataLoader(dg, args.batch, hook_manager=hm)
    d = args.dim
    memory = TGNMemory(num_nodes, 1, d, d, message_module=IdentityMessage(1, d, d),
                       aggregator_module=LastAggregator())  # fmt: skip
    encoder = GraphAttentionEmbedding(in_channels=d, out_channels=d, msg_dim=1,
                                      time_enc=memory.time_enc)  # fmt: skip
    decoder = LinkPredictor(node_dim=d, hidden_dim=d)
    params = set(memory.parameters()) | set(encoder.parameters()) | set(decoder.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)
    rows = []
    for e in range(args.epochs):
        with hm.activate("train"):
            seconds, loss = epoch(loader, memory, encoder, decoder, opt)
        hm.reset_state()
        rows.append({"epoch": e + 1, "train_s": seconds, "loss": loss, "events": len(t)})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"library": "tgm-lib", "model": "tgn",
                                          "threads": args.threads, "epochs": rows},
                                         indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
