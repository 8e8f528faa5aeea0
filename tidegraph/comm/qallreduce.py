"""Compressed all-reduce of a flat gradient: two-way stochastic quantization, or top-k.

Why two-way (BytePS-Compress, ZeRO++ qgZ) and not "quantize, all-reduce": an all-reduce sums
partial results at every hop, so each hop would need fp32 (or re-quantize with error growing
per hop). Here every rank sends each peer the quantized chunk that peer owns (all-to-all), the
owner decodes the W contributions and sums them in fp32, re-quantizes the sum once and the
owners' results are all-gathered and decoded. Each value is quantized twice, whatever W, and
each rank sends 2 (W - 1) / W of the codes, like a ring all-reduce sends of fp32.

Every rank, the owner of a piece included, decodes the same gathered bytes with the same code,
so all replicas end bitwise identical (they must, or they drift apart).

The pieces, one concept a module; this module names the public ones, as it did when it held
them all:
- `buckets`: where a flat tensor's buckets lie (`plan_buckets`, fixed or by a link cost model),
  at how many bits each goes (`choose_bits`, adaptive) and what a round sent (`CommStats`);
  pure functions, no collectives;
- `exchange`: the two-way exchange's messages (stages of whole buckets, framed as codes and
  (min, scale) rows with a flag byte), one exchange's worker and owner halves, and how a rank
  that cannot encode makes every rank raise alike;
- `reducer`: `QuantizedAllReduce`, one rank's all-reduce: plan and bits per step, the exact,
  quantized and top-k exchanges over torch.distributed, error feedback, its state;
- `overlap`: `OverlapRound`, the same all-reduce begun while backward still writes the tensor;
- `loopback`: W ranks in threads of one process (`Loopback`, `allreduce_in_process_`);
- `ddp`: a DDP communication hook over `QuantizedAllReduce`.
"""

from tidegraph.comm.buckets import EXACT_BITS as EXACT_BITS
from tidegraph.comm.buckets import TOPK_BITS as TOPK_BITS
from tidegraph.comm.buckets import CommStats, choose_bits, ddp_bucket_cap_mb, plan_buckets
from tidegraph.comm.ddp import DDPHookState, quantized_ddp_hook
from tidegraph.comm.loopback import Loopback, allreduce_in_process_
from tidegraph.comm.overlap import OverlapRound
from tidegraph.comm.reducer import QuantizedAllReduce

__all__ = [
    "CommStats",
    "DDPHookState",
    "Loopback",
    "OverlapRound",
    "QuantizedAllReduce",
    "allreduce_in_process_",
    "choose_bits",
    "ddp_bucket_cap_mb",
    "plan_buckets",
    "quantized_ddp_hook",
]
