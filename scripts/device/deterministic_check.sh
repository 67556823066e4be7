#!/usr/bin/env bash
# The deterministic d_index_k (options.deterministic, src/hopper/fixed_point_dk.cuh)
# on the H200, in one call: the GPU tests (its bitwise-reproducibility and graph
# tests among them) with the installed-package consumer, the sanitizer harness
# (Sanitized.DeterministicDk with the other Sanitized cases), the CLI matrix (with
# its --deterministic cases), and its cost: `dsa-indexer-bwd bench` with and
# without --deterministic at the DeepSeek shape (H64 D128 topk 2048), S 4096 and
# 16384, causal and random ids, one process each.
#   device run, carry [".device/bin"]:  OUT=$OUT bash scripts/device/deterministic_check.sh
# Writes into $OUT: tests.txt, sanitizer.txt, cli_matrix.txt, bench_default.json,
# bench_deterministic.json, bench.txt. Exit status: the first failure's.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
work=${WORK:-/tmp/deterministic_check}
mkdir -p "$work"
export PATH=/usr/local/cuda/bin:$PATH
rc=0
OUT=$work bash scripts/device/gpu_check.sh tests > "$out/tests.txt" 2>&1 || rc=1
grep -E "determinism|deterministic|PASSED|FAILED|consumer rc|gpu tests rc" "$out/tests.txt" | tail -12
OUT=$work bash scripts/device/gpu_check.sh sanitizer > "$out/sanitizer.txt" 2>&1 || rc=1
tail -9 "$out/sanitizer.txt"
OUT=$work bash scripts/device/cli_matrix.sh > "$out/cli_matrix.txt" 2>&1 || rc=1
grep -E "determin|cases:" "$out/cli_matrix.txt" | tail -6
args=(--seq 4096,16384 --ids causal,random --iters 10 --sustained-ms 0 --no-floor)
{
  timeout 200 .device/bin/dsa-indexer-bwd bench "${args[@]}" --json "$out/bench_default.json" 2>&1 | grep -v "^\[" | tail -8
  timeout 200 .device/bin/dsa-indexer-bwd bench "${args[@]}" --deterministic --json "$out/bench_deterministic.json" 2>&1 | grep -v "^\[" | tail -8
} > "$out/bench.txt" || rc=1
cat "$out/bench.txt"
echo "deterministic_check rc=$rc"
exit $rc
