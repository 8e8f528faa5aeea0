"""Link-prediction metrics computed in torch (float64 on the host): AP, ROC AUC, MRR.

- `average_precision`: mean of the precision at each positive, scores ranked high to low; tied
  scores are ranked as one group (the precision of the whole group), as scikit-learn does.
- `roc_auc`: Mann-Whitney U with average ranks for ties.
- `mrr`: for each positive, 1 / (1 + #negatives scored higher + 0.5 #tied), as TGB does with
  its optimistic/pessimistic average.
"""

from __future__ import annotations

import torch

__all__ = ["average_precision", "link_metrics", "mrr", "roc_auc"]


def average_precision(pos: torch.Tensor, neg: torch.Tensor) -> float:
    scores, labels = _joined(pos, neg)
    if labels.sum() == 0:
        return float("nan")
    order = torch.argsort(scores, descending=True, stable=True)
    scores, labels = scores[order], labels[order]
    tp = torch.cumsum(labels, 0)
    # last index of each group of tied scores: precision and recall are taken per group
    last = torch.ones_like(labels, dtype=torch.bool)
    last[:-1] = scores[1:] != scores[:-1]
    tp_g = tp[last]
    n_g = torch.nonzero(last).squeeze(1).to(torch.float64) + 1
    recall_step = torch.diff(tp_g, prepend=tp_g.new_zeros(1))
    return float((recall_step * tp_g / n_g).sum() / tp_g[-1])


def roc_auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    scores, labels = _joined(pos, neg)
    n_pos, n_neg = float(labels.sum()), float((1 - labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inv, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    start = torch.cumsum(counts, 0) - counts
    avg_rank = start.to(torch.float64) + (counts.to(torch.float64) + 1) / 2
    rank_sum = float((avg_rank[inv] * labels).sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def mrr(pos: torch.Tensor, neg_BQ: torch.Tensor) -> float:
    pos = pos.detach().double().cpu().unsqueeze(1)
    neg_BQ = neg_BQ.detach().double().cpu()
    rank = 1 + (neg_BQ > pos).sum(1) + 0.5 * (neg_BQ == pos).sum(1)
    return float((1.0 / rank).mean()) if rank.numel() else float("nan")


def link_metrics(pos: torch.Tensor, neg_BQ: torch.Tensor) -> dict[str, float]:
    """AP and AUC with the first negative of each positive; MRR against all of them."""
    first = neg_BQ[:, 0]
    return {
        "ap": average_precision(pos, first),
        "auc": roc_auc(pos, first),
        "mrr": mrr(pos, neg_BQ),
    }


def _joined(pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pos, neg = pos.detach().double().cpu().flatten(), neg.detach().double().cpu().flatten()
    labels = torch.cat([torch.ones_like(pos), torch.zeros_like(neg)])
    return torch.cat([pos, neg]), labels
