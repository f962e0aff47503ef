#!/usr/bin/env bash
# The one GPU entry point: cuda tests and benchmarks, results under OUTDIR.
#   usage: bash scripts/gpu_check.sh OUTDIR [tests|bench|all] [extra prefill bench args...]
# Runs from the repository root with PYTHONPATH=src (no install needed). The cuda tests run in fifteen
# pytest processes at once so that Triton compiles in parallel (the GPU is shared; these are
# correctness tests, nothing is timed while they run); the few that need most of the GPU's memory
# run alone after them, in the last ALONE_S seconds of the budget (default 90).
#
# Files written to OUTDIR (the device tool returns at most 8):
#   tests: gpu.txt, tests.log (every pytest process's log, one after another)
#   bench: bench.log, prefill.json, prefill.md, decode.json (plots: redraw them off the GPU with
#          `python -m flashtile.bench.prefill --out DIR --plot-only`, likewise decode)
# One device command may run 10 minutes: call `tests` and `bench` separately. The tests stop
# themselves after TEST_BUDGET_S seconds in all (default 540; pytest gets SIGINT and prints what it
# has) so that tests.log is always assembled; the benchmarks rewrite their JSON after every row, so a
# run cut off by the tool's limit still returns the rows measured so far.
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUTDIR [tests|bench|all]}
WHAT=${2:-all}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the cd below must not move it
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
status=0

if [[ $WHAT == tests || $WHAT == all ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
  logs=$(mktemp -d)  # per-process logs stay outside OUTDIR; tests.log gathers them
  alone_s=${ALONE_S:-90}  # the serial step's share of the budget (its Hopper pair took 12 s alone on the H100)
  budget=$(( ${TEST_BUDGET_S:-540} - alone_s ))  # the shards'
  prefill="tests/test_prefill_cuda.py"
  alone="(past_65535 or long_and_many_short)"  # 4100 x 16-head batches, a 4 GB oracle: out of memory beside the other shards (the H100), so run after them
  varlen="tests/test_varlen_cuda.py"
  sink="tests/test_sink_cuda.py"
  hopper="tests/test_hopper_cuda.py"
  names=("grid d32-59" "grid d64-96" "grid d111-160" "grid d192-256" "prefill other" "decode/kvcache"
         "varlen grid d32-64" "varlen grid d96-256" "varlen other, dropout" "sink grid" "sink other"
         "hopper forward, full" "hopper forward, causal" "hopper backward" "hopper varlen")
  cmds=("-k 'test_grid and (d32 or d40 or d59)' $prefill"
        "-k 'test_grid and (d64 or d80 or d96)' $prefill"
        "-k 'test_grid and (d111 or d128 or d160)' $prefill"
        "-k 'test_grid and (d192 or d224 or d256)' $prefill"
        "-k 'not test_grid and not $alone' $prefill"
        "tests/ --ignore=$prefill --ignore=$varlen --ignore=$sink --ignore=$hopper"
        "-k 'test_varlen_grid and (d32 or d59 or d64)' $varlen"
        "-k 'test_varlen_grid and (d96 or d128 or d256)' $varlen"
        "-k 'not test_varlen_grid' $varlen"
        "-k test_prefill_grid $sink"
        "-k 'not test_prefill_grid' $sink"
        "-k 'not backward_ and not varlen and not $alone and not causal' $hopper"
        "-k 'not backward_ and not varlen and not $alone and causal' $hopper"
        "-k 'backward_ and not varlen' $hopper"
        "-k 'varlen and not $alone' $hopper")
  pids=()
  for i in "${!cmds[@]}"; do
    eval "timeout -s INT -k 30 $budget python -m pytest -q -m cuda -p no:cacheprovider ${cmds[$i]}" \
      > "$logs/$i.log" 2>&1 &
    pids+=($!)
  done
  : > "$OUT/tests.log"
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; rc=$?
    [[ $rc == 0 ]] || status=1
    [[ $rc == 124 ]] && note=" (stopped at the shards' $budget s of TEST_BUDGET_S)" || note=""
    echo "shard $i (${names[$i]}): rc=$rc$note: $(tail -n 1 "$logs/$i.log")"
    { echo "===== shard $i: ${names[$i]}: pytest ${cmds[$i]}: rc=$rc$note"; cat "$logs/$i.log"; echo; } \
      >> "$OUT/tests.log"
  done
  timeout -s INT -k 30 $alone_s python -m pytest -q -m cuda -p no:cacheprovider -k "$alone" $prefill $hopper \
    > "$logs/alone.log" 2>&1; rc=$?
  [[ $rc == 0 ]] || status=1
  [[ $rc == 124 ]] && note=" (stopped at ALONE_S=$alone_s s)" || note=""
  echo "after the shards, alone (-k $alone): rc=$rc$note: $(tail -n 1 "$logs/alone.log")"
  { echo "===== after the shards, alone: pytest -k $alone $prefill $hopper: rc=$rc$note"; cat "$logs/alone.log"; echo; } \
    >> "$OUT/tests.log"
  rm -rf "$logs"
fi

if [[ $WHAT == bench || $WHAT == all ]]; then
  { echo "===== python -m flashtile.bench.prefill --out $OUT --no-plot ${*:3}"
    python -m flashtile.bench.prefill --out "$OUT" --no-plot "${@:3}" 2>&1 || status=1
    echo "===== python -m flashtile.bench.decode --out $OUT --no-plot"
    python -m flashtile.bench.decode --out "$OUT" --no-plot 2>&1 || status=1
  } > "$OUT/bench.log"
  tail -n 5 "$OUT/bench.log"
fi
exit $status
