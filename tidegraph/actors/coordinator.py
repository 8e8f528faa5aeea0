"""The coordinator actor: the progress of the pass under way, and the run's membership
requests. It imports no torch (a process start of about 1 CPU-s instead of 3.4): the trainers'
rendezvous store lives in the driver's process (`RayGroup.store`), on the same node and with
the same fate (this actor is the driver's and dies with it), and here only where the driver
runs outside the cluster (Ray Client), where trainers could not reach it (`host_store`).

While trainers run a whole pass in one task, the driver only waits; trainer 0 reports the
steps it finished here (at most every half second, without waiting for an answer) and the
driver reads them to move its progress bar. The answer to a report says whether the driver
asked the group to stop early (to resize at the next step boundary): trainer 0 reads it
without waiting and carries its vote to the group with the next step's update exchange.

Operators reach a run through this actor too (it is named, in the run's namespace):
`tidegraph.jobs.resize` leaves a wanted trainer or shard-actor count (or a shard to move) here,
which the driver takes.
"""

from __future__ import annotations

import ray

__all__ = ["CoordinatorActor"]


class _Coordinator:
    def __init__(self) -> None:
        self.store = None  # StoreHost, only where the driver cannot host it (`host_store`)
        self.steps = 0
        self.stop = False
        self.wanted: tuple[int, str] | None = None  # (trainers, who asked)
        self.moves: set[int] = set()  # partitions to move to new shard actors
        self.wanted_shards: tuple[int, str] | None = None  # (shard actors, who asked)
        self.status: dict = {}

    def host_store(self, timeout_s: float = 60.0) -> tuple[str, int]:
        """Host the trainers' store here (imports torch); its address."""
        from tidegraph.comm.collective import StoreHost

        if self.store is None:  # on the address Ray knows this node by
            self.store = StoreHost(ray.util.get_node_ip_address(), timeout_s)
        return self.store.address()

    def report(self, steps: int) -> bool:
        """Steps of the pass under way finished so far (0 starts a pass); whether the group
        is asked to stop after a step."""
        self.steps = steps
        return self.stop

    def progress(self) -> int:
        return self.steps

    def request_stop(self, stop: bool = True) -> None:
        self.stop = stop

    def want_trainers(self, count: int, who: str = "operator") -> dict:
        """An operator's wanted trainer count (taken by the driver at the next step
        boundary); returns the run's membership as last published."""
        if int(count) != count or count < 1:
            raise ValueError(f"trainers must be an integer >= 1, got {count}")
        self.wanted = (int(count), who)
        return self.status

    def take_wanted(self) -> tuple[int, str] | None:
        wanted, self.wanted = self.wanted, None
        return wanted

    def want_shards(self, count: int, who: str = "operator") -> dict:
        """An operator's wanted number of shard actors (taken by the driver at the next
        step boundary); returns the run's membership as last published."""
        if int(count) != count or count < 1:
            raise ValueError(f"shards must be an integer >= 1, got {count}")
        self.wanted_shards = (int(count), who)
        return self.status

    def take_wanted_shards(self) -> tuple[int, str] | None:
        wanted, self.wanted_shards = self.wanted_shards, None
        return wanted

    def move_shard(self, part: int) -> None:
        """An operator's request to move partition `part` to a new shard actor."""
        self.moves.add(int(part))

    def take_moves(self) -> list[int]:
        moves, self.moves = sorted(self.moves), set()
        return moves

    def publish(self, status: dict) -> None:
        """The run's membership (trainers, bounds, last resize), for operators."""
        self.status = status

    def membership(self) -> dict:
        return self.status


CoordinatorActor = ray.remote(num_cpus=0)(_Coordinator)
