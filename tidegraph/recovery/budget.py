"""The run's recovery budget (`cluster.max_recoveries`), counted in one place.

Two things draw on it, as they always have, and they count differently:
- every trainer recovery and every shard rebuild by replay spends one recovery (`spend`); a
  shard promoted from a replica spends none. Spending past the budget raises, and the count
  stays spent (it goes below zero: every later spend raises too);
- every loop that tries an operation again after a recovery (a step, a pass's settling, a
  read of actors) makes at most one try more than the budget allows (`tries`), whatever has
  been spent: the recoveries inside it are what the budget bounds.
"""

from __future__ import annotations

__all__ = ["RecoveryBudget"]


class RecoveryBudget:
    """`max_recoveries` recoveries for a run; `left` of them remain (below zero once spent)."""

    def __init__(self, max_recoveries: int) -> None:
        self.max_recoveries = max_recoveries
        self.left = max_recoveries

    def spend(self, what: str, cause: BaseException | None = None) -> None:
        """One `what` recovery ("trainer", "shard"); raises when the budget is spent
        (chained to `cause`, the failure being recovered from)."""
        self.left -= 1
        if self.left < 0:
            raise self.error(what) from cause

    def tries(self) -> range:
        """The tries of a loop that recovers between them: one more than recoveries."""
        return range(self.max_recoveries + 1)

    @staticmethod
    def error(what: str) -> RuntimeError:
        """The error of a `what` recovery that the budget does not allow."""
        return RuntimeError(f"{what} recovery: the retry budget is spent")
