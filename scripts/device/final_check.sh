#!/usr/bin/env bash
# The closing verification cycle on the H200: GPU tests, sanitizer harness,
# CLI on the cuda backend, benchmarks with the floor measured in the same run
# (DeepSeek shapes and the variations of issue 4), one ncu profile. Everything
# is logged under $OUT.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
rc=0
OUT=$out bash scripts/device/gpu_check.sh tests > "$out/tests_summary.txt" 2>&1 || rc=1
grep -E "PASSED|FAILED|determinism|rc=" "$out/tests_summary.txt" | tail -5
OUT=$out bash scripts/device/gpu_check.sh sanitizer 2>&1 | tail -9 || rc=1
OUT=$out bash scripts/device/gpu_check.sh cli > "$out/cli_summary.txt" 2>&1 || rc=1
grep -E "backward |result|d_index|d_weights" "$out/cli_summary.txt" | head -12
# `dsa-indexer-bwd bench`: the floor re-measured in the same run (per case, at its dK
# size), the op, the ratio to that floor and to the fixed 278 ns.
cli=.device/bin/dsa-indexer-bwd
{
  $cli bench --seq 4096,16384,65536 --ids causal,random --iters 15 --json "$out/bench_main.json" 2>>"$out/bench_stderr.log"
  for extra in "--topk 512" "--topk 1024" "--heads 32" "--heads 128" "--dim 64"; do
    tag=$(echo "$extra" | tr -d ' -')
    $cli bench --seq 16384 --ids random $extra --iters 15 --json "$out/bench_$tag.json" 2>>"$out/bench_stderr.log" | grep -E "^random "
  done
} 2>&1 | tee "$out/bench_final.txt"
OUT=$out bash scripts/device/gpu_check.sh ncu 2>&1 | tail -45 > "$out/ncu_summary.txt"
exit $rc
