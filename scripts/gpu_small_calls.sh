#!/usr/bin/env bash
# Issue 72 on the GPU machine, in one call: the host path, the small-call table, cold starts and
# the cuda tests, results under OUTDIR (8 files at most come back from the device tool).
#   usage: bash scripts/gpu_small_calls.sh OUTDIR [TEST_BUDGET_S]   (0: skip the cuda tests)
# FA4 rows where flash_attn.cute imports (../shared/tools/fa4_peer.sh, sourced before this).
set -uo pipefail
OUT=${1:?usage: gpu_small_calls.sh OUTDIR [TEST_BUDGET_S]}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
fa4=$(python -c "import flash_attn.cute" 2>/dev/null && echo --fa4)
nvidia-smi --query-gpu=name --format=csv,noheader
python scripts/host_prefill.py "$OUT/host_prefill.txt" --profile > /dev/null 2>&1 || echo "host_prefill failed"
python -m flashtile.bench.prefill --out "$OUT" --sections small --no-plot > "$OUT/small.log" 2>&1 || echo "bench small failed"
python scripts/cold_start.py "$OUT/cold_start.txt" $fa4 > /dev/null 2>&1 || echo "cold_start failed"
budget=${2:-240}  # 0: no tests (they ran in a call of their own)
[[ $budget == 0 ]] || TEST_BUDGET_S=$budget ALONE_S=20 bash scripts/gpu_check.sh "$OUT/t" tests 2>&1 | tail -17
head -13 "$OUT/host_prefill.txt"; grep "^small" "$OUT/small.log"; tail -2 "$OUT/small.log"; cat "$OUT/cold_start.txt"
