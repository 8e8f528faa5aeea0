"""A DDP communication hook that all-reduces each DDP bucket through `QuantizedAllReduce`.

Apart from reducer.py: an adapter for torch's DistributedDataParallel (its bucket and future
types), which tidegraph's own trainers do not use (they all-reduce one flat gradient).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tidegraph import rng
from tidegraph.comm.buckets import CommStats
from tidegraph.comm.config import CommConfig
from tidegraph.comm.reducer import QuantizedAllReduce

__all__ = ["DDPHookState", "quantized_ddp_hook"]


class DDPHookState:
    """State of `quantized_ddp_hook`: one `QuantizedAllReduce` per DDP bucket, a step count.

    ddp.register_comm_hook(DDPHookState(config, seed=seed), quantized_ddp_hook)
    """

    def __init__(self, config: CommConfig, group: dist.ProcessGroup | None = None, seed: int = 0):
        self.config, self.group, self.seed = config, group, seed
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.step = 0
        self.reducers: dict[int, QuantizedAllReduce] = {}
        self.last_stats: dict[int, CommStats] = {}


def quantized_ddp_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """A DDP communication hook: the bucket's mean gradient through `QuantizedAllReduce`.

    Runs synchronously inside backward and returns a completed future (DDP copies the result
    back into the parameters' gradients). Steps count the buckets marked last.
    """
    buf = bucket.buffer()
    reducer = state.reducers.get(bucket.index())
    if reducer is None:
        seed = rng.seed_for(state.seed, "comm-ddp-bucket", bucket.index())
        reducer = QuantizedAllReduce(state.config, state.group, state.rank, state.world, seed)
        state.reducers[bucket.index()] = reducer
    state.last_stats[bucket.index()] = reducer.allreduce_(buf, state.step, average=True)
    if bucket.is_last():
        state.step += 1
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them
# strings, so give it the evaluated ones
quantized_ddp_hook.__annotations__ = {
    "state": DDPHookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
