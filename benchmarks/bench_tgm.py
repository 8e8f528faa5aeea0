"""TGM (PyPI `tgm-lib`), the peer library, trained on the bundled Wikipedia (= tgbl-wiki): the
seconds an epoch of TGB's training split takes with TGM's own modules and hooks, to set beside
tidegraph's (`bench_tgb.py`, "train s / epoch"). Runs in TGM's environment, never in
tidegraph's (TGM needs torch_geometric):

    python3 -m venv /tmp/tgm && /tmp/tgm/bin/pip install torch==2.13.0 && \\
        /tmp/tgm/bin/pip install tgm-lib
    /tmp/tgm/bin/python benchmarks/bench_tgm.py [--model tgn|graphmixer|dygformer]
        [--epochs 2] [--threads 1] [--max-batches N]

Each model's loop is TGM's link-prediction recipe for it (v0.1.0b1's examples), one uniform
negative a positive, batches of 200, at tidegraph's dimensions:
- `tgn`: TGNMemory with identity messages and last aggregation, a graph-attention embedding
  over the 10 most recent neighbours, TGM's link predictor, deduplicated nodes; memory, time
  and embedding 100. The bundled file has no edge features; TGM's memory wants a message, so
  each edge carries one zero feature.
- `graphmixer`: the 20 most recent neighbours' tokens (edge features and a fixed Time2Vec of
  their age, projected) through two of TGM's MLPMixer layers, masked mean; plus the node's
  feature and the mean feature of its neighbours among the 2,000 events before the batch
  (the recipe's time-gap hook); TGM's link predictor. Node features: random, 100 wide (the
  recipe's for a dataset without any); edge features: 100 zeros, so that the mixer's
  channels are tidegraph's 100 (TGM's recipe mixes the edge-feature channels).
- `dygformer`: TGM's DyGFormer module on sequences of 32 (the node and its 31 most recent
  neighbours), 2 layers, 2 heads, channel embeddings of 25 (its four channels, node, edge,
  time and co-occurrence, give a Transformer 100 wide, tidegraph's: its two channels of 50),
  output 100; random node features of 100 and one zero edge feature.
`--max-batches N` times the first N batches of each epoch only (a model too slow for a
whole epoch here), reported with the epoch's batch count so that an epoch can be read off.
TGB's split (the 0.70 time quantile) is computed here as in
`tidegraph.training.tgb.tgb_bounds`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tgm import DGraph
from tgm.constants import PADDED_NODE_ID
from tgm.data import DGData, DGDataLoader
from tgm.hooks import (
    DeduplicationHook,
    HookManager,
    NegativeEdgeSamplerHook,
    RecencyNeighborHook,
    StatelessHook,
)
from tgm.nn import DyGFormer, LinkPredictor, MLPMixer, TGNMemory, Time2Vec
from tgm.nn.encoder.tgn import GraphAttentionEmbedding, IdentityMessage, LastAggregator
from torch import nn

DATA = Path(__file__).resolve().parents[1] / "tidegraph" / "data" / "wikipedia_u_i_ts_label.csv.gz"
SEEDS = {"seed_nodes_keys": ["edge_src", "edge_dst", "neg"],
         "seed_times_keys": ["edge_time", "edge_time", "neg_time"]}  # fmt: skip


def train_split(path: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(edge_index [E, 2] int32, times int64) of the train split, and the node count."""
    with gzip.open(path, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", skiprows=1, dtype=np.int64)
    t = rows[:, 2]
    val_time = np.quantile(t.astype(np.float64), 0.70)
    end = int(np.searchsorted(t, val_time, "right"))
    index = torch.from_numpy(rows[:end, :2]).to(torch.int32)
    return index, torch.from_numpy(t[:end]), int(rows[:, :2].max()) + 1


def bce(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos)) + \
        F.binary_cross_entropy_with_logits(neg, torch.zeros_like(neg))  # fmt: skip


class TGN(nn.Module):
    """TGM's TGN recipe: memory, graph attention over the recent neighbours, link predictor."""

    edge_dim = 1

    def __init__(self, num_nodes: int, d: int) -> None:
        super().__init__()
        self.memory = TGNMemory(num_nodes, 1, d, d, message_module=IdentityMessage(1, d, d),
                                aggregator_module=LastAggregator())  # fmt: skip
        self.encoder = GraphAttentionEmbedding(in_channels=d, out_channels=d, msg_dim=1,
                                               time_enc=self.memory.time_enc)  # fmt: skip
        self.decoder = LinkPredictor(node_dim=d, hidden_dim=d)

    def hooks(self, num_nodes: int, nbrs: int) -> list:
        return [RecencyNeighborHook(num_nbrs=[nbrs], num_nodes=num_nodes, **SEEDS),
                DeduplicationHook()]  # fmt: skip

    def start(self) -> None:
        self.memory.reset_state()

    def loss(self, batch, node_x) -> torch.Tensor:
        nbrs = batch.nbr_nids[0].flatten()
        real = nbrs != PADDED_NODE_ID
        per_root = len(nbrs) // (len(batch.edge_src) + len(batch.edge_dst) + len(batch.neg))
        roots = torch.cat([batch.edge_src, batch.edge_dst, batch.neg]).repeat_interleave(per_root)
        edges = torch.stack([batch.global_to_local(roots[real]),
                             batch.global_to_local(nbrs[real])]).long()  # fmt: skip
        z, last = self.memory(batch.unique_nids)
        z = self.encoder(z, last, edges, batch.nbr_edge_time[0].flatten()[real],
                         batch.nbr_edge_x[0].flatten(0, -2).float()[real])  # fmt: skip
        src = z[batch.global_to_local(batch.edge_src)]
        pos = self.decoder(src, z[batch.global_to_local(batch.edge_dst)])
        neg = self.decoder(src, z[batch.global_to_local(batch.neg)])
        self.memory.update_state(batch.edge_src, batch.edge_dst, batch.edge_time,
                                 batch.edge_x.float())  # fmt: skip
        return bce(pos, neg)

    def after_step(self) -> None:
        self.memory.detach()


class TimeGapNeighbours(StatelessHook):
    """The recipe's time-gap hook: per seed node (sources, destinations, negatives), the
    nodes it met among the `gap` events before the batch, as Python lists."""

    requires = {"neg"}
    produces = {"time_gap_nbrs"}

    def __init__(self, gap: int) -> None:
        self.gap = gap

    def __call__(self, dg: DGraph, batch):
        window = replace(dg._slice)
        window.start_idx = max(dg._slice.end_idx - self.gap, 0)
        window.end_time = int(batch.edge_time.min()) - 1
        src, dst, _ = dg._storage.get_edges(window)
        met = defaultdict(list)
        for u, v in zip(src.tolist(), dst.tolist(), strict=True):
            met[u].append(v)
            met[v].append(u)
        seeds = torch.cat([batch.edge_src, batch.edge_dst, batch.neg])
        batch.time_gap_nbrs = [met.get(n, []) for n in seeds.tolist()]
        return batch


class GraphMixer(nn.Module):
    """TGM's GraphMixer recipe (its link encoder over TGM's MLPMixer, its node encoder)."""

    edge_dim = 100

    def __init__(self, num_nodes: int, d: int, tokens: int = 20, gap: int = 2000) -> None:
        super().__init__()
        self.tokens, self.gap = tokens, gap
        self.time_enc = Time2Vec(time_dim=d).requires_grad_(False)  # fixed, as the paper's
        self.project = nn.Linear(self.edge_dim + d, self.edge_dim)
        self.mixers = nn.ModuleList(MLPMixer(num_tokens=tokens, num_channels=self.edge_dim,
                                             token_dim_expansion_factor=0.5,
                                             channel_dim_expansion_factor=4.0, dropout=0.1)
                                    for _ in range(2))  # fmt: skip
        self.out = nn.Linear(self.edge_dim + d, d)
        self.decoder = LinkPredictor(node_dim=d, hidden_dim=d)

    def hooks(self, num_nodes: int, nbrs: int) -> list:
        return [
            TimeGapNeighbours(self.gap),
            RecencyNeighborHook(num_nbrs=[self.tokens], num_nodes=num_nodes, **SEEDS),
        ]

    def loss(self, batch, node_x) -> torch.Tensor:
        age = batch.seed_times[0][:, None] - batch.nbr_edge_time[0]
        z = self.project(torch.cat([batch.nbr_edge_x[0], self.time_enc(age)], -1))
        for mixer in self.mixers:
            z = mixer(z)
        valid = batch.nbr_nids[0] != PADDED_NODE_ID
        z = (z * valid.unsqueeze(-1)).sum(1) / valid.sum(1, keepdim=True).clamp(min=1)
        near = torch.zeros(len(batch.time_gap_nbrs), node_x.shape[1])
        for i, met in enumerate(batch.time_gap_nbrs):  # the recipe's loop, per seed node
            if met:
                near[i] = node_x[met].mean(0)
        node = near + node_x[torch.cat([batch.edge_src, batch.edge_dst, batch.neg])]
        src, dst, neg = torch.chunk(self.out(torch.cat([z, node], 1)), 3)
        return bce(self.decoder(src, dst), self.decoder(src, neg))


class DyGFormerModel(nn.Module):
    """TGM's DyGFormer recipe: its DyGFormer module over both endpoints' sequences, a
    positive pair and its negative pair each encoded jointly, TGM's link predictor."""

    edge_dim = 1

    def __init__(self, num_nodes: int, d: int, length: int = 32) -> None:
        super().__init__()
        self.length = length
        self.encoder = DyGFormer(node_feat_dim=d, edge_feat_dim=self.edge_dim, time_feat_dim=d,
                                 channel_embedding_dim=25, output_dim=d, patch_size=1,
                                 num_layers=2, num_heads=2, dropout=0.1,
                                 max_input_sequence_length=length, num_channels=4)  # fmt: skip
        self.decoder = LinkPredictor(node_dim=d, hidden_dim=d)

    def hooks(self, num_nodes: int, nbrs: int) -> list:
        return [RecencyNeighborHook(num_nbrs=[self.length - 1], num_nodes=num_nodes, **SEEDS)]

    def loss(self, batch, node_x) -> torch.Tensor:
        ids, times, feats = batch.nbr_nids[0], batch.nbr_edge_time[0], batch.nbr_edge_x[0]
        mask = batch.seed_node_nbr_mask
        s, d, n = mask["edge_src"], mask["edge_dst"], mask["neg"]
        t = batch.edge_time

        def pair(u, v, a, b):
            z_u, z_v = self.encoder(node_x, torch.stack([u, v]), t, torch.cat([ids[a], ids[b]]),
                                    torch.cat([times[a], times[b]]),
                                    torch.cat([feats[a], feats[b]]))  # fmt: skip
            return self.decoder(z_u, z_v)

        return bce(pair(batch.edge_src, batch.edge_dst, s, d),
                   pair(batch.edge_src, batch.neg, s, n))  # fmt: skip


MODELS = {"tgn": TGN, "graphmixer": GraphMixer, "dygformer": DyGFormerModel}


def epoch(loader, model, node_x, opt, max_batches: int) -> tuple[float, float, int]:
    """One training pass as TGM's recipe runs it: (seconds, mean loss, batches timed)."""
    model.train()
    if hasattr(model, "start"):
        model.start()
    t0, total, n, batches = time.perf_counter(), 0.0, 0, 0
    for batch in loader:
        opt.zero_grad()
        loss = model.loss(batch, node_x)
        loss.backward()
        opt.step()
        if hasattr(model, "after_step"):
            model.after_step()
        total, n = total + float(loss) * len(batch.edge_src), n + len(batch.edge_src)
        batches += 1
        if batches == max_batches:
            break
    return time.perf_counter() - t0, total / max(n, 1), batches


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=tuple(MODELS), default="tgn")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dim", type=int, default=100)
    p.add_argument("--nbrs", type=int, default=10, help="tgn's neighbours")
    p.add_argument("--batch", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-batches", type=int, default=0, help="time this many a pass (0: all)")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    index, t, num_nodes = train_split(DATA)
    model = MODELS[args.model](num_nodes, args.dim)
    data = DGData.from_raw(t, index, torch.zeros(len(t), model.edge_dim))
    dg = DGraph(data)
    node_x = torch.randn(num_nodes, args.dim)  # the recipes' node features without any
    hm = HookManager(keys=["train"])
    dst = index[:, 1]
    hm.register("train", NegativeEdgeSamplerHook(low=int(dst.min()), high=int(dst.max())))
    for hook in model.hooks(num_nodes, args.nbrs):
        hm.register_shared(hook)
    loader = DGDataLoader(dg, args.batch, hook_manager=hm)
    opt = torch.optim.Adam([q for q in model.parameters() if q.requires_grad], lr=args.lr)
    rows, per_epoch = [], -(-len(t) // args.batch)
    for e in range(args.epochs):
        with hm.activate("train"):
            seconds, loss, batches = epoch(loader, model, node_x, opt, args.max_batches)
        hm.reset_state()
        rows.append({"epoch": e + 1, "train_s": seconds, "loss": loss, "batches": batches,
                     "epoch_batches": per_epoch, "epoch_s": seconds * per_epoch / batches,
                     "events": len(t)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out or f"benchmarks/out/tgm_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"library": "tgm-lib", "model": args.model,
                               "threads": args.threads, "epochs": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
