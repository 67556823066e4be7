#!/usr/bin/env bash
# One build-check-time cycle on the H200 (through the device tool), driven by
# binaries built here and carried in .device/bin (see scripts/device/stage.sh).
#   usage: scripts/device/gpu_check.sh [tests|cli|bench|sanitizer|all] [gtest filter]
# Logs go to $OUT (or ./out when OUT is unset).
set -uo pipefail
what=${1:-all}
filter=${2:-*}
out=${OUT:-out}
mkdir -p "$out"
bin=.device/bin
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  echo "=== gpu tests"
  timeout 420 "$bin/test_gpu_hopper" --gtest_filter="$filter" 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[(numerics|determinism)|OK|FAILED|PASSED|SKIPPED|Failure|Expected|Which is|error|rel_rms" | head -150
  rc=${PIPESTATUS[0]}
  echo "gpu tests rc=$rc"
fi
if [[ $what == cli || $what == all ]]; then
  echo "=== cli (cuda backend)"
  cli=$bin/dsa-indexer-bwd
  timeout 200 "$cli" backward --preset deepseek-v32 --backend cuda --verify sample --repeat 10 2>&1 | tee "$out/cli_deepseek.log" | tail -14
  rc=$((rc | PIPESTATUS[0]))
  "$cli" generate --preset race-report-2 --out /tmp/race2.safetensors >/dev/null 2>&1
  timeout 120 "$cli" backward --in /tmp/race2.safetensors --backend cuda --verify all --out /tmp/race2_grads.safetensors 2>&1 | tee "$out/cli_file.log" | tail -12
  rc=$((rc | PIPESTATUS[0]))
fi
if [[ $what == sanitizer || $what == all ]]; then
  echo "=== sanitizer"
  timeout 500 bash tests/sanitizer/run_sanitizer.sh "$bin" "$out" 2>&1 | tail -40
  rc=$((rc | PIPESTATUS[0]))
fi
if [[ $what == bench || $what == all ]]; then
  echo "=== bench"
  timeout 300 "$bin/dsa-indexer-bwd-bench" --json "$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -30
  rc=$((rc | PIPESTATUS[0]))
fi
exit $rc
