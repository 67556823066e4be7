#!/usr/bin/env bash
# Builds a kernel candidate from a patch in docs/kernel-ladder/ into
# .device/cand/<name>/ (ignored by git) for scripts/device/candidate_check.sh:
# a git worktree of HEAD in /tmp (never this tree), `git apply` of the patch,
# a Release CUDA build of the four binaries the check runs (bench, CLI, GPU
# tests, sync_calibration), stripped, and ptxas's register/spill lines of the
# fused kernels. Exit status non-zero when the patch does not apply, the build
# fails, or ptxas reports a spill (the project builds with -Werror on spills).
#
#   scripts/build_candidate.sh docs/kernel-ladder/v19-bulk-reduce-scatter-role.patch v19 [--keep]
#
# CUTLASS headers: $DSAIB_CUTLASS_INCLUDE_DIR, else the value in build/CMakeCache.txt.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
patch=${1:?usage: build_candidate.sh PATCH NAME [--keep]}
name=${2:?usage: build_candidate.sh PATCH NAME [--keep]}
keep=${3:-}
patch=$(cd "$(dirname "$patch")" && pwd)/$(basename "$patch")
cutlass=${DSAIB_CUTLASS_INCLUDE_DIR:-$(sed -n 's/^DSAIB_CUTLASS_INCLUDE_DIR:PATH=//p' "$repo/build/CMakeCache.txt" 2>/dev/null || true)}
[[ -n $cutlass ]] || { echo "build_candidate: set DSAIB_CUTLASS_INCLUDE_DIR (no build/CMakeCache.txt to read it from)"; exit 2; }
wt=/tmp/cand-$name
git -C "$repo" worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"
git -C "$repo" worktree add -q --detach "$wt" HEAD
cleanup() { [[ $keep == --keep ]] || git -C "$repo" worktree remove --force "$wt"; }
trap cleanup EXIT
git -C "$wt" apply "$patch"
echo "build_candidate: $name = $(git -C "$repo" rev-parse --short HEAD) + $(basename "$patch")"
cmake -S "$wt" -B "$wt/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSAIB_ENABLE_CUDA=ON -DDSAIB_BUILD_TESTS=ON \
  -DDSAIB_CUTLASS_INCLUDE_DIR="$cutlass" > "$wt/configure.log" 2>&1 || { tail -20 "$wt/configure.log"; exit 1; }
if ! cmake --build "$wt/build" -j"$(nproc)" --target dsa-indexer-bwd-bench dsa-indexer-bwd test_gpu_hopper sync_calibration \
    > "$wt/build.log" 2>&1; then
  grep -E "error|spill" "$wt/build.log" | head -20
  exit 1
fi
grep -E "Used [0-9]+ registers|spill stores" "$wt/build.log" | sed 's/^ *//' | paste - - | grep -E "168|2[0-9][0-9] registers" || true
# ptxas's note that a kernel's wgmma run serialized (too few registers): a
# likely loss even without a spill (perf-log, probe v22).
if grep -q "C7512" "$wt/build.log"; then
  echo "build_candidate: WARNING: ptxas serializes wgmma in:"
  grep "C7512" "$wt/build.log" | sed 's/.*function //' | sort -u
fi
out=$repo/.device/cand/$name
rm -rf "$out" && mkdir -p "$out"
cp "$wt/build/bench/dsa-indexer-bwd-bench" "$wt/build/cli/dsa-indexer-bwd" "$wt/build/tests/gpu/test_gpu_hopper" \
   "$wt/build/tests/sanitizer/sync_calibration" "$out/"
strip --strip-debug "$out"/*
du -sh "$out"
echo "build_candidate: device run, carry [\".device/bin\", \".device/cand/$name\"]: CAND=$name bash scripts/device/candidate_check.sh"
