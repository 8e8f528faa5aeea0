#!/usr/bin/env bash
# One call's worth of GPU checks for the device machine (see README "Benchmarks"):
#   the gpu-marked tests, then the GPU benchmarks, logs and JSON under $OUT (or benchmarks/out).
# Usage there:  bash benchmarks/gpu_suite.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
if [ "${1:-}" = quick ]; then
  python3 benchmarks/bench_graph.py --device cuda --total 10_000_000 2>&1 | tee "$out/graph.log"
  python3 benchmarks/bench_sampler.py --device cuda --edges 1_000_000 2>&1 | tee "$out/sampler.log"
else
  python3 benchmarks/bench_graph.py --device cuda --total 100_000_000 2>&1 | tee "$out/graph.log"
  python3 benchmarks/bench_graph.py --device pinned --total 1_000_000_000 --batches 1_000_000 \
    --out graph_pinned_1b.json 2>&1 | tee "$out/graph_pinned.log"
  python3 benchmarks/bench_sampler.py --device cuda --edges 1_000_000,100_000_000 2>&1 \
    | tee "$out/sampler.log"
fi
cp benchmarks/out/*.json "$out"/ 2>/dev/null || true
