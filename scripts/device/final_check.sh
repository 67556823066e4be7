#!/usr/bin/env bash
# The closing verification cycle on the H200: GPU tests (kernel and bench tools),
# sanitizer harness, CLI on the cuda backend, benchmarks with the floor measured
# in the same run (DeepSeek shapes and the variations of issue 4), the paired A/B
# of the a-operand precision (bf16x2 vs bf16), one ncu profile.
# Full logs go to $WORK (default /tmp/final_check); at most 8 summary files are
# copied to $OUT (the device tool returns no more).
# SKIP_CHECKS=1 skips the GPU tests and the sanitizer (when release_check.sh ran
# them on the same binaries), SKIP_AB=1 the a-operand A/B, SKIP_MATRIX=1 the CLI
# matrix (cli_matrix.sh).
set -uo pipefail
out=${OUT:-out}
work=${WORK:-/tmp/final_check}
mkdir -p "$out" "$work"
export PATH=/usr/local/cuda/bin:$PATH
rc=0
: > "$work/tests_summary.txt"; : > "$work/sanitizer_out.txt"
if [[ -z ${SKIP_CHECKS:-} ]]; then
  OUT=$work bash scripts/device/gpu_check.sh tests > "$work/tests_summary.txt" 2>&1 || rc=1
  DSAIB_BIN_DIR=.device/bin timeout 300 .device/bin/test_gpu_bench >> "$work/tests_summary.txt" 2>&1 || rc=1
  grep -E "PASSED|FAILED|rc=" "$work/tests_summary.txt" | tail -6
  OUT=$work bash scripts/device/gpu_check.sh sanitizer > "$work/sanitizer_out.txt" 2>&1 || rc=1
  tail -9 "$work/sanitizer_out.txt"
fi
OUT=$work bash scripts/device/gpu_check.sh cli > "$work/cli_summary.txt" 2>&1 || rc=1
grep -E "backward |result|d_index|d_weights" "$work/cli_summary.txt" | head -12
# test-cases.md's cases through the CLI on cuda against the fp64 reference (~60 s;
# SKIP_MATRIX=1 skips it); its lines go into checks.txt.
: > "$work/cli_matrix.txt"
if [[ -z ${SKIP_MATRIX:-} ]]; then
  OUT=$work bash scripts/device/cli_matrix.sh > /dev/null 2>&1 || rc=1
  tail -1 "$work/cli_matrix.txt"
fi
# `dsa-indexer-bwd bench`: the floor re-measured in the same run (per case, at its dK
# size), the op, the ratio to that floor and to the fixed 278 ns.
cli=.device/bin/dsa-indexer-bwd
{
  $cli bench --seq 4096,16384,65536 --ids causal,random --iters 15 --sustained-ms 3000 --json "$work/bench_main.json" 2>>"$work/bench_stderr.log"
  for extra in "--topk 512" "--topk 1024" "--heads 32" "--heads 128" "--dim 64"; do
    tag=$(echo "$extra" | tr -d ' -')
    $cli bench --seq 16384 --ids random $extra --iters 15 --no-floor --sustained-ms 0 --json "$work/bench_$tag.json" 2>>"$work/bench_stderr.log" | grep -E "^random "
  done
} 2>&1 | tee "$work/bench_final.txt"
# Paired A/B: a operand as two bf16 terms (A) vs automatic = one term for bf16 outputs (B).
if [[ -z ${SKIP_AB:-} ]]; then
  mkdir -p .device/bin/ab
  for kv in A=bf16x2 B=auto; do
    printf '#!/bin/sh\nexec %s/.device/bin/dsa-indexer-bwd-bench --a-operand %s "$@"\n' "$PWD" "${kv#*=}" > ".device/bin/ab/bench_${kv%%=*}"
    chmod +x ".device/bin/ab/bench_${kv%%=*}"
  done
  AB_PAIRS=${AB_PAIRS:-4} OUT=$work bash scripts/device/gpu_check.sh ab 2>&1 | tee "$work/ab_summary.txt" | tail -4
fi
OUT=$work bash scripts/device/gpu_check.sh ncu 2>&1 | tail -45 > "$work/ncu_summary.txt"
head -30 "$work/ncu_summary.txt"
cat "$work/tests_summary.txt" "$work/sanitizer_out.txt" "$work/cli_summary.txt" "$work/cli_matrix.txt" > "$work/checks.txt"
for f in checks.txt bench_main.json bench_final.txt ab_summary.txt ncu_summary.txt ncu.txt sanitizer_summary.txt; do
  [[ -f $work/$f ]] && cp "$work/$f" "$out/"
done
exit $rc
