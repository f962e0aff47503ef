#!/usr/bin/env bash
# The one GPU entry point: cuda tests and benchmarks in one call, results under OUTDIR.
#   usage: bash scripts/gpu_check.sh OUTDIR [tests|bench|all] [extra bench args...]
# Runs from the repository root with PYTHONPATH=src (no install needed). The cuda test grid is
# split into five pytest processes so that Triton compiles in parallel (the GPU is shared; these
# are correctness tests, nothing is timed while they run).
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUTDIR [tests|bench|all]}
WHAT=${2:-all}
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p "$OUT"
status=0

if [[ $WHAT == tests || $WHAT == all ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
  shards=("d32 or d40 or d59 or not test_grid" "d64 or d80 or d96" "d111 or d128 or d160" "d192 or d224 or d256")
  pids=()
  for i in "${!shards[@]}"; do
    python -m pytest -q -m cuda -p no:cacheprovider -k "${shards[$i]}" tests/test_prefill_cuda.py \
      > "$OUT/tests_$i.log" 2>&1 &
    pids+=($!)
  done
  # every other cuda test file (decode, kv cache) in a fifth process
  python -m pytest -q -m cuda -p no:cacheprovider tests/ --ignore=tests/test_prefill_cuda.py \
    > "$OUT/tests_4.log" 2>&1 &
  pids+=($!)
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || status=1
    echo "shard $i: $(tail -n 1 "$OUT/tests_$i.log")"
  done
fi

if [[ $WHAT == bench || $WHAT == all ]]; then
  python -m flashtile.bench.prefill --out "$OUT" "${@:3}" > "$OUT/bench_prefill.log" 2>&1 || status=1
  tail -n 3 "$OUT/bench_prefill.log"
  if python -c "import flashtile.bench.decode" 2>/dev/null; then
    python -m flashtile.bench.decode --out "$OUT" > "$OUT/bench_decode.log" 2>&1 || status=1
    tail -n 3 "$OUT/bench_decode.log"
  fi
fi
exit $status
