#!/usr/bin/env bash
# Copies the binaries a device run needs from build/ into .device/bin (ignored
# by git; name .device in the device tool's carry list).
set -euo pipefail
build=${1:-build}
mkdir -p .device/bin
# test_gpu_bench runs the staged tools: DSAIB_BIN_DIR=.device/bin .device/bin/test_gpu_bench
for b in tests/gpu/test_gpu_hopper tests/gpu/test_gpu_bench tests/sanitizer/sync_calibration bench/dsa-indexer-bwd-bench bench/dsa-floor-bench cli/dsa-indexer-bwd; do
  if [[ -f $build/$b ]]; then cp "$build/$b" .device/bin/; fi
done
# The installed-package consumers (tests/install_consumer/), built against an install
# of this build: consumer_cxx runs the cuda backend through find_package(dsaib).
if [[ -f $build/CMakeCache.txt ]]; then
  DSAIB_CONSUMER_KEEP=$PWD/.device/bin sh tests/install_and_consume.sh cmake "$build" "$PWD" -G Ninja \
    -DCUDAToolkit_ROOT=/usr/local/cuda > /dev/null || echo "stage.sh: install_and_consume failed; no consumers staged" >&2
fi
# Variant benches for paired A/B runs: AB_VARIANTS="A=path/to/bench B=path/to/bench ..."
if [[ -n ${AB_VARIANTS:-} ]]; then
  rm -rf .device/bin/ab && mkdir -p .device/bin/ab
  for kv in $AB_VARIANTS; do cp "${kv#*=}" ".device/bin/ab/bench_${kv%%=*}"; done
fi
# Their CLIs, checked against the fp64 reference before timing: AB_CLIS="B=path/to/dsa-indexer-bwd ..."
if [[ -n ${AB_CLIS:-} ]]; then
  mkdir -p .device/bin/ab
  for kv in $AB_CLIS; do cp "${kv#*=}" ".device/bin/ab/cli_${kv%%=*}"; done
fi
strip --strip-debug .device/bin/* .device/bin/ab/* 2>/dev/null || true
du -sh .device/bin/* .device/bin/ab/* 2>/dev/null
