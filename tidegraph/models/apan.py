"""APAN (Wang et al. 2021) in TGL's formulation: a mailbox per node, read by attention.

Node state (buffers, so the model's `state_dict` carries it): a memory [N, D] per node, and a
mailbox of the node's `mailbox_size` latest mails [N, M, 2D + De] with their times (a ring,
-inf when empty). A root's embedding at time t attends from its memory over the mails older
than t, with the time since each mail (`TemporalAttention`); no neighbour is read at embedding
time, which is APAN's point: the graph work happens after the batch, asynchronously.

After a batch (`commit(events)`), each event (u, v, t, e) sets the memories of u and v to
their embeddings from that forward pass (detached; a node in several events keeps its latest)
and sends the mail [z_u, z_v, e] to u and [z_v, z_u, e] to v, and the same mails on to their
sampled neighbours (the forward pass's first hop: the sampler supplies the propagation targets,
so `num_layers` is 1 while the embedding itself uses no neighbour). Mails land in each
mailbox's ring in time order; a mailbox that receives more than M in one batch keeps the M
newest.

Evaluation in chunks calls `commit(None)` after each chunk and `commit(events)` once at the
end, so forward passes in evaluation mode queue their rows until then; in training mode each
forward pass starts a fresh queue. Memory: M * (2D + De) floats per node for the mailboxes.
"""

from __future__ import annotations

import torch
from torch import nn

from tidegraph.models.base import TableStateModel
from tidegraph.models.layers import TemporalAttention, edge_features
from tidegraph.models.time_encoding import TimeEncoder
from tidegraph.ops import gather_rows, latest_rows
from tidegraph.sampling.block import Block
from tidegraph.storage.events import EventBatch

__all__ = ["APAN"]

_STATE = ("memory", "last_update", "mail", "mail_t", "mail_count")


class APAN(TableStateModel):
    num_layers = 1
    state_names = _STATE
    state_fill = {"mail_t": -torch.inf}

    def __init__(
        self,
        num_nodes: int,
        dim: int = 100,
        time_dim: int = 100,
        edge_dim: int = 0,
        heads: int = 2,
        mailbox_size: int = 10,
    ) -> None:
        super().__init__(dim)
        self.edge_dim = edge_dim
        self.mailbox_size = mailbox_size
        self.mail_dim = 2 * dim + edge_dim
        self.time_enc = TimeEncoder(time_dim)
        self.mail_in = nn.Linear(self.mail_dim, dim)
        self.attention = TemporalAttention(dim, self.time_enc, 0, dim, heads)
        self._alloc(num_nodes)
        self._batch: int | None = None  # events in the forward pass under way (set by score)

    def _alloc(self, n: int) -> None:
        m = self.mailbox_size
        self.register_buffer("memory", torch.zeros(n, self.dim))
        self.register_buffer("last_update", torch.zeros(n, dtype=torch.float64))
        self.register_buffer("mail", torch.zeros(n, m, self.mail_dim))
        self.register_buffer("mail_t", torch.full((n, m), -torch.inf, dtype=torch.float64))
        self.register_buffer("mail_count", torch.zeros(n, dtype=torch.int64))  # mails received

    def state_ids(self, roots: torch.Tensor, blocks: list) -> torch.Tensor:
        return torch.unique(roots)  # embeddings read the roots' memory and mails only

    # ---- forward ----------------------------------------------------------------------------

    def score(self, src, dst, neg_BQ, t, blocks):
        if self.training:
            self._queue.clear()
        self._batch = src.shape[0]
        return super().score(src, dst, neg_BQ, t, blocks)

    def embed(self, ids: torch.Tensor, ts: torch.Tensor, blocks: list) -> torch.Tensor:
        loc = self._r(ids)
        mail_t = gather_rows(self.mail_t, loc)  # [R, M]
        ts = ts.to(mail_t.dtype)
        # only filled slots (-inf: empty) holding mails of earlier events
        visible = (mail_t < ts.unsqueeze(1)) & (mail_t > -torch.inf)
        box = Block(
            dst_ids=ids,
            dst_ts=ts,
            nbr_ids=torch.zeros_like(visible, dtype=torch.int64),
            nbr_ts=mail_t,
            nbr_eids=torch.zeros_like(visible, dtype=torch.int64),
            dt=torch.where(visible, ts.unsqueeze(1) - mail_t, 0).float(),
            mask=visible,
        )
        m = self.mailbox_size
        flat = loc.unsqueeze(1) * m + torch.arange(m, device=ids.device)  # [R, M] mail rows
        mails = gather_rows(self.mail.view(-1, self.mail_dim), box.valid(flat))
        z = self.attention(
            gather_rows(self.memory, loc), self.mail_in(mails), box.valid(box.dt), None, box
        )
        b = self._batch
        if b is not None and blocks:  # rows of the events' endpoints, kept for commit()
            self._queue.append((b, z[: 2 * b].detach(), blocks[0]))
            self._batch = None
        return z

    # ---- node state -------------------------------------------------------------------------

    def commit(self, events: EventBatch | None) -> None:
        if events is None or not len(events) or not self._queue:
            return  # evaluation chunks queue their rows until the events are recorded
        super().commit(events)

    @torch.no_grad()
    def take_updates(self, events: EventBatch | None) -> dict | None:
        """The new memories of the events' endpoints and the mails to deliver, by kind (to
        the events' sources, destinations, and the sources' and destinations' sampled
        neighbours), so that slices concatenate kind by kind into one batch's order."""
        if events is None or not len(events) or not self._queue:
            self._queue.clear()
            return None
        n = len(events)
        z_src = torch.cat([z[:b] for b, z, _ in self._queue])[:n]
        z_dst = torch.cat([z[b:] for b, z, _ in self._queue])[:n]
        nbr = torch.cat([blk.nbr_ids[:b] for b, _, blk in self._queue])[:n]
        nbr_dst = torch.cat([blk.nbr_ids[b : 2 * b] for b, _, blk in self._queue])[:n]
        ok = torch.cat([blk.mask[:b] for b, _, blk in self._queue])[:n]
        ok_dst = torch.cat([blk.mask[b : 2 * b] for b, _, blk in self._queue])[:n]
        self._queue.clear()
        t = events.t.to(torch.float64)
        e = edge_features(events.edge_feat, self.edge_dim, z_src)
        parts = [z_src, z_dst] + ([e] if e is not None else [])
        mail_u = torch.cat(parts, -1)
        mail_v = torch.cat([z_dst, z_src] + parts[2:], -1)
        # neighbours (row-major, like nbr[ok]) get the mail of their row's event
        u_rows, v_rows = ok.nonzero()[:, 0], ok_dst.nonzero()[:, 0]
        return {
            "src": events.src, "dst": events.dst, "t": t, "z_src": z_src, "z_dst": z_dst,
            "mail_u": mail_u, "mail_v": mail_v, "nbr_u": nbr[ok], "nbr_v": nbr_dst[ok_dst],
            "nbr_mail_u": mail_u[u_rows], "nbr_mail_v": mail_v[v_rows],
            "nbr_t_u": t[u_rows], "nbr_t_v": t[v_rows],
        }  # fmt: skip

    @torch.no_grad()
    def apply_updates(self, updates: list[dict | None], owned=None) -> None:
        updates = [u for u in updates if u is not None]
        if not updates:
            return
        cat = lambda key: torch.cat([u[key] for u in updates])  # noqa: E731
        src, dst, t = cat("src"), cat("dst"), cat("t")
        nodes, z = torch.cat([src, dst]), torch.cat([cat("z_src"), cat("z_dst")])
        times = t.repeat(2)
        targets = torch.cat([src, dst, cat("nbr_u"), cat("nbr_v")])
        mails = torch.cat([cat("mail_u"), cat("mail_v"), cat("nbr_mail_u"), cat("nbr_mail_v")])
        mail_t = torch.cat([t, t, cat("nbr_t_u"), cat("nbr_t_v")])
        if owned is not None:  # a shard's part: its nodes' rows, in the same order
            keep = owned(nodes).nonzero().squeeze(1)
            nodes, z, times = (x.index_select(0, keep) for x in (nodes, z, times))
            keep = owned(targets).nonzero().squeeze(1)
            targets, mails, mail_t = (x.index_select(0, keep) for x in (targets, mails, mail_t))
        self._set_memory(nodes, z, times)
        self._deliver(targets, mails, mail_t)

    def _set_memory(self, nodes: torch.Tensor, z: torch.Tensor, times: torch.Tensor) -> None:
        """memory[v] = z of v's latest event in the batch (ties: the later row)."""
        uniq, row = latest_rows(nodes, times)
        loc = self._r(uniq)
        self.changed.mark(loc)
        self.memory[loc] = z[row].to(self.memory.dtype)
        self.last_update[loc] = times[row]

    def _deliver(self, targets: torch.Tensor, mails: torch.Tensor, times: torch.Tensor) -> None:
        """Append mails to their targets' rings in time order, the M newest per target."""
        if targets.numel() == 0:
            return
        m = self.mailbox_size
        order = torch.argsort(times, stable=True)
        order = order[torch.argsort(targets[order], stable=True)]  # by target, then time
        tgt = targets[order]
        uniq, counts = torch.unique_consecutive(tgt, return_counts=True)
        first = torch.cumsum(counts, 0) - counts
        rank = torch.arange(tgt.shape[0], device=tgt.device) - torch.repeat_interleave(
            first, counts
        )
        count = torch.repeat_interleave(counts, counts)
        keep = rank >= count - m  # older ones would be overwritten in this batch anyway
        tgt, rank, order = self._r(tgt[keep]), rank[keep], order[keep]
        slot = (self.mail_count[tgt] + rank) % m
        self.changed.mark(self._r(uniq))  # every target's count changes (its mails too)
        self.mail[tgt, slot] = mails[order].to(self.mail.dtype)
        self.mail_t[tgt, slot] = times[order]
        self.mail_count[self._r(uniq)] += counts
