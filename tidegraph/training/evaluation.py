"""What a continual run's evaluation units (phase 1's validation, each increment before it is
trained on) score their positives against, and the metrics of a pass.

- `eval.protocol: sampled`: `train.eval_negatives` uniform negatives a positive; AP, AUC and
  MRR over them.
- `eval.protocol: tgb` (`tidegraph.training.tgb`): a block's first `eval.prefix` positives (0:
  all) against TGB's hist_rnd negatives, whose history is every event learned before the block
  (phase 1's validation: phase 1's training part), kept as distinct pairs (`SeenPairs`, in the
  run's checkpoints); destination range the history's and the block's; seed
  `seed_for(seed, "tgb negatives", 0 for phase 1, k + 1 for increment k)`. MRR and Hits@k by
  TGB's rank rule. Every row also carries one uniform negative, last, so that AP and AUC (over
  every event of the block) stay the sampled protocol's, as forgetting's probes are; a
  positive past the prefix has its own destination in place of the hist_rnd row.
A block's rows are drawn once, when its pass starts or resumes (a pure function of the run's
state then): phase 1's kept for its every epoch's validation, an increment's dropped when its
pass ends.
"""

from __future__ import annotations

import torch

from tidegraph.rng import seed_for
from tidegraph.storage.events import EventBatch
from tidegraph.training.metrics import link_metrics
from tidegraph.training.schedule import Unit
from tidegraph.training.tgb import SeenPairs, rank_metrics, tgb_ranks

__all__ = ["Evaluation"]


class Evaluation:
    """The evaluation side of a `ContinualLearner` (its events, negatives, schedule)."""

    def __init__(self, learner) -> None:
        self.learner = learner
        self.tgb = learner.config.eval.protocol == "tgb"
        self.seen = SeenPairs()  # tgb: the distinct pairs learned so far
        self.draw: tuple | None = None  # tgb: (block, negatives, valid) of the block under way

    def learned(self, ev: EventBatch) -> None:
        """Events of a block just learned: TGB's history from now on."""
        if self.tgb:
            self.seen.add(ev.src, ev.dst)

    def load_seen(self, state: dict | None) -> None:
        if state is not None:
            self.seen.load_state_dict(state)
        self.draw = None

    def block(self, u: Unit) -> tuple[int, int]:
        """The events [lo, hi) that evaluation unit `u`'s pass evaluates."""
        lr = self.learner
        return (lr.val_start, lr.phase1_end) if u.increment < 0 else lr.bounds[u.increment]

    def inputs(self, u: Unit) -> tuple[EventBatch, torch.Tensor]:
        """(events, negatives) of evaluation unit `u` (see the module)."""
        lr = self.learner
        ev = lr._events(u.lo, u.hi)
        uniform = lr.negatives.sample(len(ev), 1 if self.tgb else lr.eval_negatives)
        if not self.tgb:
            return ev, uniform
        neg, _, a, m = self._rows(u)
        if m == 0:
            return ev, torch.cat([ev.dst.unsqueeze(1), uniform], 1)
        rows = ev.dst.unsqueeze(1).repeat(1, neg.shape[1])
        rows[:m] = neg[a : a + m]
        return ev, torch.cat([rows, uniform], 1)

    def scores(self, u: Unit, p: torch.Tensor, n: torch.Tensor, ps: dict) -> None:
        """Evaluation unit `u`'s scores into the pass state `ps`: all of them, or under TGB's
        protocol the uniform negative's and the scored positives' ranks."""
        ps["pos"].append(p)
        if not self.tgb:
            ps["neg"].append(n)
            return
        ps["neg"].append(n[:, -1:])
        neg, valid, a, m = self._rows(u)
        if m:
            k = neg.shape[1]
            ps["rank"].append(tgb_ranks(p[:m], n[:m, :k], valid[a : a + m]))

    def _rows(self, u: Unit) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(negatives, valid, a, m) of unit `u`'s block: its scored positives are `m` rows
        from row `a` of them (m = 0: none, past the prefix)."""
        neg, valid = self.negatives(u)
        a = u.lo - self.block(u)[0]
        return neg, valid, a, max(0, min(u.hi - u.lo, neg.shape[0] - a))

    def metrics(self, u: Unit, ps: dict) -> dict:
        """The metrics of the pass that evaluation-end unit `u` closes (its accumulators
        taken from `ps`)."""
        ranks = ps.pop("rank", [])
        out = link_metrics(torch.cat(ps.pop("pos")), torch.cat(ps.pop("neg")))
        if self.tgb:  # MRR and Hits@k by TGB's rank rule, of the scored positives
            if u.increment >= 0:  # an increment is evaluated once (a resume draws again)
                self.draw = None
            rank = torch.cat(ranks)
            k = self.learner.config.eval.hits_k
            out.update(rank_metrics(rank, k), positives=rank.numel())
        return out

    def negatives(self, u: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        """(negatives, valid) of the scored positives of unit `u`'s block (see the module)."""
        block = self.block(u)
        if self.draw is None or self.draw[0] != block:
            lr = self.learner
            start, end = block
            e = lr.config.eval
            scored = end - start if e.prefix == 0 else min(end - start, e.prefix)
            seen = self.seen
            if u.increment < 0:
                seen = SeenPairs()
                for lo, hi in lr._windows(0, lr.val_start):
                    ev = lr._events(lo, hi)
                    seen.add(ev.src, ev.dst)
            ev = lr._events(start, end)
            seed = seed_for(lr.config.seed, "tgb negatives", u.increment + 1)
            sampler = seen.negatives(ev.dst, e.negatives, e.hist_ratio, seed)
            self.draw = (block, *sampler.sample(ev.src, ev.dst, ev.t, rows=scored))
        return self.draw[1], self.draw[2]
