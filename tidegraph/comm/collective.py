"""A torch.distributed group of trainers, rebuilt per membership generation.

`StoreHost` holds the TCP store that trainers rendezvous through; it lives in the driver's
process (not in rank 0, so losing a trainer never loses the store). `Collective`
joins a group over that store under the prefix of a membership generation
(`tidegraph/gen{g}/`), so a later membership (recovery, resize) builds a fresh group on the same
store without stale keys. Every collective has an explicit timeout: a dead peer fails the call
at once (gloo sees the closed socket), a hung one at the timeout; nothing waits unbounded.
Backend: gloo on CPU, NCCL on CUDA tensors.

Gradient compression (`comm:` in the run config): `allreduce_sum_` of a `GradientStep` (see
`gradsync`) goes through the trainer's `GradSync` when `comm.compression` is not "none" and the
group has more than one rank, through the exact fp32 all-reduce otherwise. Any other tensor is
always summed exactly. With `comm.overlap`, `begin_gradient` starts a step's gradient before
backward and its buckets leave as their gradients become final (compressed or exact).
"""

from __future__ import annotations

import datetime
import logging
import math
import pickle
import socket

import torch
import torch.distributed as dist

from tidegraph.comm.config import CommConfig
from tidegraph.comm.gradsync import GradientStep, GradSync, compressing

__all__ = ["Collective", "Gathering", "StoreHost"]

log = logging.getLogger(__name__)


class StoreHost:
    """The master TCP store, on a free port of this host: `host`, or the address the host's
    name resolves to."""

    def __init__(self, host: str | None = None, timeout_s: float = 60.0) -> None:
        self.host = host or _node_ip()
        # listen on this host's address only (TCPStore alone would listen on every interface)
        self._socket = socket.create_server((self.host, 0))
        self.store = dist.TCPStore(
            self.host, self._socket.getsockname()[1], is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=self._socket.fileno(),
        )  # fmt: skip
        self._socket.detach()  # the store owns the descriptor now and closes it
        log.info("trainer store on %s:%d", self.host, self.store.port)

    def address(self) -> tuple[str, int]:
        return self.host, int(self.store.port)

    def close(self) -> None:
        """Stop serving (the store closes its listening socket)."""
        self.store = None


class Collective:
    """Rank `rank` of `world` in generation `generation`; `allreduce_sum_` in place.

    `comm`, `seed`: how gradients (`GradientStep`s) are compressed, and the run's seed that
    the rounding streams derive from."""

    rendezvous_s = 8.0  # below the driver's probe time (`RayGroup.probe_s`)

    def __init__(
        self,
        address: tuple[str, int],
        generation: int,
        rank: int,
        world: int,
        timeout_s: float = 60.0,
        backend: str = "gloo",
        comm: CommConfig | None = None,
        seed: int = 0,
    ) -> None:
        self.rank, self.world, self.generation = rank, world, generation
        self.comm, self.seed = comm, seed
        self.group = None
        if world == 1:
            return
        # joining waits at most `rendezvous_s` for the other members (one lost while the
        # group forms fails the others soon, so they answer the driver's probe and are not
        # taken for hung); the group's collectives then wait up to `timeout_s`
        join = datetime.timedelta(seconds=min(timeout_s, self.rendezvous_s))
        store = dist.TCPStore(address[0], address[1], is_master=False, timeout=join)
        prefixed = dist.PrefixStore(f"tidegraph/gen{generation}/", store)
        if dist.is_initialized():  # an earlier membership's group
            dist.destroy_process_group()
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world,
                                timeout=join)  # fmt: skip
        self.group = dist.group.WORLD
        _set_timeout(self.group, datetime.timedelta(seconds=timeout_s))
        log.info("rank %d of %d joined trainer group generation %d", rank, world, generation)

    def allreduce_sum_(self, x: torch.Tensor | GradientStep) -> torch.Tensor | GradientStep:
        """`x` summed over the group in place; a `GradientStep`'s flat gradient compressed as
        `comm` says (its `sync` then holds the trainer's live `GradSync`). Returns `x`."""
        if isinstance(x, GradientStep):
            if x.round is not None:  # begun during backward
                x.sync.finish(x.round)
                x.round = None
                return x
            if compressing(self.comm, self.world):
                x.sync = GradSync.restore(self.comm, self.seed, self.rank, x.sync)
                x.sync.allreduce_(x.flat, x.step, x.sizes, self.group, self.world)
                return x
            self.allreduce_sum_(x.flat)
        elif self.group is not None:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def begin_gradient(self, x: GradientStep) -> GradientStep:
        """With `comm.overlap` in a group of several: start `allreduce_sum_(x)` before `x`'s
        gradient is computed; `x.round.ready(i)` once tensor i of `x.sizes` is final sends
        what can go (see `QuantizedAllReduce.begin`), and `allreduce_sum_(x)` completes it,
        bitwise as without overlap (fp32 buckets: at W = 2; at W >= 3 up to gloo's order of
        addition per bucket). With `compression: none` the gradient then goes through a
        `GradSync` too (exact buckets; its totals count them). Otherwise `x` unchanged.
        Issues no collective itself."""
        if self.comm is not None and self.comm.overlap and self.group is not None:
            x.sync = GradSync.restore(self.comm, self.seed, self.rank, x.sync)
            x.round = x.sync.begin(x.flat, x.step, x.sizes, self.group, self.world)
        return x

    def gradient(
        self, flat: torch.Tensor, step: int, sizes=None, sync: GradSync | dict | None = None
    ) -> GradientStep:
        """A step's flat gradient for `allreduce_sum_` (see `GradientStep`)."""
        return GradientStep(flat, step, sizes, sync)

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj`, in rank order (pickled through the group)."""
        if self.group is None:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_gather_tensors(self, obj, device: torch.device | str = "cpu") -> list:
        """Every rank's `obj` (nested dicts, lists and tuples of tensors and small values), in
        rank order, its tensors on `device`; `all_gather_tensors_async(...).wait()` is the
        same. Tensors travel as raw bytes in one buffer (`all_gather_object` pickles each
        tensor, several times slower for a step's node-state updates)."""
        return self.all_gather_tensors_async(obj, device).wait()

    def all_gather_tensors_async(self, obj, device: torch.device | str = "cpu") -> Gathering:
        """Start gathering `obj` from every rank (see `all_gather_tensors`): the sizes are
        exchanged now, the bytes in the background; `wait()` returns the list."""
        if self.group is None:
            return Gathering([obj], None, None, None)
        leaves: list[torch.Tensor] = []
        skeleton = _skeleton(obj, leaves)
        byte_views = [x.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for x in leaves]
        meta = pickle.dumps(
            (skeleton, [(x.dtype, tuple(x.shape)) for x in leaves]), pickle.HIGHEST_PROTOCOL
        )
        head = _aligned(len(meta))
        sizes = [_aligned(v.numel()) for v in byte_views]
        mine = torch.tensor([head, head + sum(sizes)], dtype=torch.int64)
        all_sizes = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(all_sizes, mine, group=self.group)
        length = max(int(s[1]) for s in all_sizes)
        buf = torch.zeros(length, dtype=torch.uint8)
        buf[: len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        offset = head
        for v, n in zip(byte_views, sizes, strict=True):
            buf[offset : offset + v.numel()] = v
            offset += n
        out = [torch.empty_like(buf) for _ in range(self.world)]
        work = dist.all_gather(out, buf, group=self.group, async_op=True)
        heads = [int(s[0]) for s in all_sizes]
        return Gathering(out, work, heads, torch.device(device))

    def close(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None


class Gathering:
    """An all-gather under way; `wait()` returns every rank's object in rank order."""

    def __init__(self, bufs: list, work, heads: list | None, device) -> None:
        self._bufs, self._work, self._heads, self._device = bufs, work, heads, device

    def wait(self) -> list:
        if self._work is None:
            return self._bufs
        self._work.wait()
        self._work = None
        self._bufs = [_unpack(b, h, self._device) for b, h in zip(self._bufs, self._heads,
                                                                   strict=True)]  # fmt: skip
        return self._bufs


class _Slot(int):
    """Where the i-th tensor goes in a gathered object's skeleton."""


def _skeleton(obj, leaves: list):
    """`obj` with each tensor replaced by its `_Slot` in `leaves` (appended to)."""
    if torch.is_tensor(obj):
        leaves.append(obj)
        return _Slot(len(leaves) - 1)
    if isinstance(obj, dict):
        return {k: _skeleton(v, leaves) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_skeleton(v, leaves) for v in obj)
    return obj


def _fill(skeleton, tensors: list):
    if isinstance(skeleton, _Slot):
        return tensors[skeleton]
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton


def _aligned(n: int) -> int:
    """`n` rounded up to 8 bytes (every dtype views an 8-aligned offset)."""
    return -(-n // 8) * 8


def _unpack(buf: torch.Tensor, head: int, device: torch.device):
    skeleton, specs = pickle.loads(buf[:head].numpy().tobytes())
    tensors, offset = [], head
    for dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        raw = buf[offset : offset + nbytes]
        tensors.append(raw.view(dtype).reshape(shape).to(device))
        offset += _aligned(nbytes)
    return _fill(skeleton, tensors)


def _set_timeout(group, timeout: datetime.timedelta) -> None:
    """The collectives' timeout of a formed group. torch has no public way to give a group's
    rendezvous and its collectives different timeouts (a sub-group would do, but its store
    keys count the groups a process made, which differs between a survivor and a newly
    started replacement), so this uses torch's own setter; without it collectives keep the
    rendezvous timeout."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:  # pragma: no cover - present in the torch versions tidegraph supports
        log.warning("torch has no _set_pg_timeout: collectives time out as the rendezvous")
        return
    setter(timeout, group)


def _node_ip() -> str:
    """This host's address by its name (a Ray driver passes the address Ray knows its node
    by: `tidegraph.orchestrator.ray_group`)."""
    return socket.gethostbyname(socket.gethostname())
