"""One batch of link prediction: sample, score, and train or evaluate; no loop per event.

`LinkEngine` ties a model, a sampler over the graph, an optimizer and a negative sampler. Per
batch it draws negatives, samples the temporal neighbourhoods of (src, dst, negatives) at the
events' times, scores them, and then either takes an optimizer step (`train_batch`) or returns
scores (`eval_batch`). Afterwards node state is folded in through the model's `commit`: with the
batch's events when they are new in time order (`observe=True`), without them otherwise
(replayed or old events, which must not enter the memory twice or out of order).

The loss per event is BCE(pos, 1) + mean over its negatives of BCE(neg, 0), weighted per event
(replay importance weights) and averaged over the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidegraph.models.base import TemporalModel, link_roots
from tidegraph.sampling.sampler import TemporalSampler
from tidegraph.storage.events import EventBatch
from tidegraph.training.sampling import NegativeSampler

__all__ = ["LinkEngine"]


class LinkEngine:
    def __init__(
        self,
        model: TemporalModel,
        sampler: TemporalSampler,
        optimizer: torch.optim.Optimizer,
        negatives: NegativeSampler,
        device: torch.device,
        train_negatives: int = 1,
        eval_negatives: int = 20,
        eval_max_roots: int = 8192,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.optimizer = optimizer
        self.negatives = negatives
        self.device = torch.device(device)
        self.train_negatives = train_negatives
        self.eval_negatives = eval_negatives
        self.eval_max_roots = eval_max_roots

    def _forward(self, ev: EventBatch, neg_BQ: torch.Tensor):
        roots, ts = link_roots(ev.src, ev.dst, neg_BQ, ev.t)
        graph_dev = self.sampler.graph.device
        blocks = self.sampler.sample(roots.to(graph_dev), ts.to(graph_dev))
        blocks = _blocks_to(blocks, self.device)
        d = self.device
        return self.model.score(ev.src.to(d), ev.dst.to(d), neg_BQ.to(d), ev.t.to(d), blocks)

    def train_batch(
        self, ev: EventBatch, weight: torch.Tensor | None = None, observe: EventBatch | None = None
    ) -> float:
        """One optimizer step on `ev`; `observe` are the events to record in node state."""
        if not self.model.training:  # Module.train() walks every submodule: once per pass
            self.model.train()
        neg = self.negatives.sample(len(ev), self.train_negatives)
        pos, negl = self._forward(ev, neg)
        loss_e = F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos), reduction="none")
        loss_e = loss_e + F.binary_cross_entropy_with_logits(
            negl, torch.zeros_like(negl), reduction="none"
        ).mean(1)
        if weight is not None:
            loss_e = loss_e * weight.to(loss_e.device)
        loss = loss_e.mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.model.commit(None if observe is None else observe.to(self.device))
        return float(loss.detach())

    @torch.no_grad()
    def eval_batch(self, ev: EventBatch, observe: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(pos logits [B], negative logits [B, Q]) on the host; chunked to bound memory."""
        if self.model.training:
            self.model.eval()
        q = self.eval_negatives
        neg = self.negatives.sample(len(ev), q)
        step = max(1, self.eval_max_roots // (2 + q))
        pos_parts, neg_parts = [], []
        for start in range(0, len(ev), step):
            part = ev.select(slice(start, start + step))
            pos, negl = self._forward(part, neg[start : start + step])
            pos_parts.append(pos.float().cpu())
            neg_parts.append(negl.float().cpu())
            if observe:
                self.model.commit(None)  # fold state in; the events are recorded below
            else:
                self.model.discard()
        if observe:
            self.model.commit(ev.to(self.device))
        return torch.cat(pos_parts), torch.cat(neg_parts)


def _blocks_to(blocks: list, device: torch.device) -> list:
    if blocks and isinstance(blocks[0], list):
        return [_blocks_to(b, device) for b in blocks]
    return [b if _on(b.dst_ids, device) else b.to(device) for b in blocks]


def _on(x: torch.Tensor, device: torch.device) -> bool:
    """Whether `x` is on `device`; "cuda" without an index means the current device (tensors
    always carry one, and torch.device("cuda") != torch.device("cuda:0"))."""
    if x.device.type != device.type:
        return False
    if device.index is None and device.type == "cuda":
        return x.device.index == torch.cuda.current_device()
    return device.index is None or x.device.index == device.index
