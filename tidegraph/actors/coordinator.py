"""The coordinator actor: hosts the trainers' rendezvous store (never a trainer's process) and
the progress of the pass under way.

While trainers run a whole pass in one task, the driver only waits; trainer 0 reports the
steps it finished here (at most every half second, without waiting for an answer) and the
driver reads them to move its progress bar.
"""

from __future__ import annotations

import ray

from tidegraph.comm.collective import StoreHost

__all__ = ["CoordinatorActor"]


class _Coordinator(StoreHost):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def report(self, steps: int) -> None:
        """Steps of the pass under way finished so far (0 starts a pass)."""
        self.steps = steps

    def progress(self) -> int:
        return self.steps


CoordinatorActor = ray.remote(num_cpus=0)(_Coordinator)
