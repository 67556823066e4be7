#!/usr/bin/env bash
# Builds the fuzz targets with clang (libFuzzer, AddressSanitizer, UndefinedBehaviorSanitizer),
# writes the seed corpus and runs the safetensors fuzzer for SECONDS. Exits non-zero on any
# finding; the input that caused it is left in BUILD_DIR/artifacts/ (fuzz/README.md).
#
# Usage: bash fuzz/run.sh [SECONDS] [BUILD_DIR] [libFuzzer flags...]
#   SECONDS    total fuzzing time (default 60)
#   BUILD_DIR  the fuzz build (default build-fuzz); its corpus/ keeps what earlier runs found
#   e.g.       bash fuzz/run.sh 3600 build-fuzz -jobs=4 -workers=4
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds="${1:-60}"
build="${2:-build-fuzz}"
shift $(($# < 2 ? $# : 2))
jobs="${FUZZ_BUILD_JOBS:-2}"

command -v clang++ >/dev/null 2>&1 || { echo "fuzz: clang++ not found (Debian: apt-get install clang libclang-rt-dev)" >&2; exit 1; }
cmake -S fuzz -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$build" -j"$jobs"

seeds="$build/seeds"
corpus="$build/corpus"
artifacts="$build/artifacts"
rm -rf "$seeds"
mkdir -p "$seeds" "$corpus" "$artifacts"
"$build/safetensors_fuzz_seeds" "$seeds"

# New inputs go to corpus/ (kept between runs), the seeds are read only.
# -max_len: the seeds are a few KB; 64 KB leaves room for larger headers.
# -timeout / -rss_limit_mb: an input that takes over 10 s or 2 GB is a finding.
# -dict: the header's keys, dtypes, tensor names and metadata (fuzz/safetensors.dict).
"$build/safetensors_fuzzer" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
  -dict=fuzz/safetensors.dict -artifact_prefix="$artifacts/" -print_final_stats=1 "$@" "$corpus" "$seeds"
