"""A torch.distributed group of trainers, rebuilt per membership generation.

`StoreHost` holds the TCP store that trainers rendezvous through; it lives in a small
coordinator process (not in rank 0, so losing a trainer never loses the store). `Collective`
joins a group over that store under the prefix of a membership generation
(`tidegraph/gen{g}/`), so a later membership (recovery, resize) builds a fresh group on the same
store without stale keys. Every collective has an explicit timeout: a dead peer fails the call
at once (gloo sees the closed socket), a hung one at the timeout; nothing waits unbounded.
Backend: gloo on CPU, NCCL on CUDA tensors.
"""

from __future__ import annotations

import datetime
import logging
import socket

import torch
import torch.distributed as dist

__all__ = ["Collective", "StoreHost"]

log = logging.getLogger(__name__)


class StoreHost:
    """The master TCP store, on a free port of this host."""

    def __init__(self, host: str | None = None, timeout_s: float = 60.0) -> None:
        self.host = host or _node_ip()
        # listen on this host's address only (TCPStore alone would listen on every interface)
        self._socket = socket.create_server((self.host, 0))
        self.store = dist.TCPStore(
            self.host, self._socket.getsockname()[1], is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=self._socket.fileno(),
        )  # fmt: skip
        log.info("trainer store on %s:%d", self.host, self.store.port)

    def address(self) -> tuple[str, int]:
        return self.host, int(self.store.port)


class Collective:
    """Rank `rank` of `world` in generation `generation`; `allreduce_sum_` in place."""

    def __init__(
        self,
        address: tuple[str, int],
        generation: int,
        rank: int,
        world: int,
        timeout_s: float = 60.0,
        backend: str = "gloo",
    ) -> None:
        self.rank, self.world, self.generation = rank, world, generation
        self.group = None
        if world == 1:
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"tidegraph/gen{generation}/", store)
        if dist.is_initialized():  # an earlier membership's group
            dist.destroy_process_group()
        dist.init_process_group(
            backend, store=prefixed, rank=rank, world_size=world, timeout=timeout
        )
        self.group = dist.group.WORLD
        log.info("rank %d of %d joined trainer group generation %d", rank, world, generation)

    def allreduce_sum_(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj`, in rank order (pickled through the group)."""
        if self.group is None:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return socket.gethostbyname(socket.gethostname())
