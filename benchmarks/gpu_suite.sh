#!/usr/bin/env bash
# The GPU machine's checks in a few device calls (each part fits one 10-minute call):
#   bash benchmarks/gpu_suite.sh PART [PART ...]
# PARTs, in the order a session with a GPU should run them:
#   tests    the gpu-marked tests
#   graph    graph store insert rate and bytes/edge: 100M edges on cuda, 1B edges pinned
#   sampler  sampler on 1M and 100M-edge graphs (cuda), 100M pinned
#   cache    feature cache: hit rates and cached vs pinned-host fetch time (cuda)
#   pyg      TGN vs PyG epoch time and AP on cuda
#   train    continual/offline accuracy and speed on cuda (tgn, tgat)
#   train2   the same for jodie and apan, and the slot-precision step rates
#   quick    a short smoke run of tests, graph and sampler
# Logs and JSON go to $OUT (the device tool's folder: each JSON is written there as soon as its
# benchmark ends, so a call cut off at its limit keeps what finished) or benchmarks/out.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# deterministic cuBLAS for the training runs' deterministic mode (and no warning per matmul)
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
run() {  # run NAME CMD...: tee the output to $out/NAME.log
  local name=$1
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
}
for part in "${@:-quick}"; do
  case $part in
    tests) run gpu_tests python3 -m pytest -m gpu -q -p no:cacheprovider ;;
    graph)
      run graph_cuda python3 benchmarks/bench_graph.py --device cuda --total 100_000_000
      run graph_pinned_1b python3 benchmarks/bench_graph.py --device pinned \
        --total 1_000_000_000 --batches 1_000_000 --out graph_pinned_1b.json
      ;;
    sampler)
      run sampler_cuda python3 benchmarks/bench_sampler.py --device cuda \
        --edges 1_000_000,100_000_000
      run sampler_pinned python3 benchmarks/bench_sampler.py --device pinned \
        --edges 100_000_000 --iters 20
      ;;
    cache) run cache_cuda python3 benchmarks/bench_cache.py --device cuda ;;
    pyg) run vs_pyg_cuda python3 benchmarks/bench_vs_pyg.py --device cuda ;;
    train) run train_cuda python3 benchmarks/bench_train.py --device cuda --models tgn tgat ;;
    train2)
      run train2_cuda python3 benchmarks/bench_train.py --device cuda --models jodie apan
      run step_cuda python3 benchmarks/bench_step.py --device cuda --models tgn tgat \
        --precisions fp32 bf16
      ;;
    quick)
      run gpu_tests python3 -m pytest -m gpu -q -p no:cacheprovider
      run graph_quick python3 benchmarks/bench_graph.py --device cuda --total 10_000_000
      run sampler_quick python3 benchmarks/bench_sampler.py --device cuda --edges 1_000_000
      ;;
    *) echo "gpu_suite.sh: unknown part $part" >&2; exit 2 ;;
  esac
done
