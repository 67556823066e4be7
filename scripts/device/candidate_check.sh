#!/usr/bin/env bash
# One device call for a kernel candidate built into .device/cand/<name>/
# (dsa-indexer-bwd-bench, dsa-indexer-bwd, test_gpu_hopper, optionally
# sync_calibration): correctness first (its GPU tests, its CLI against the fp64
# reference at the case's shape, the sanitizer harness when sync_calibration is
# there), then
# a paired A/B of its bench against the staged op (.device/bin).
#   device run, carry [".device/bin", ".device/cand/<name>"]:
#     CAND=v17d64 AB_ARGS="--seq 16384 --dim 64 --iters 10" bash scripts/device/candidate_check.sh
# Env: CAND (required), AB_ARGS (default "--seq 16384 --iters 10"), AB_PAIRS (5),
#      CLI_ARGS (default "--preset deepseek-v32 --backend cuda --verify sample"),
#      SKIP_SANITIZER=1 (any non-empty value; screening several candidates in one
#      call: the sanitizer harness, ~110 s, then runs only on the one that lands),
#      BASE (default .device/bin: the folder whose dsa-indexer-bwd-bench is side A),
#      AB_METRIC (ns_per_row; ns_per_row_sustained or both with "--sustained-ms 2000" in
#      AB_ARGS: back to back the op is power-bound, docs/perf-log.md nineteenth session).
# Writes $OUT/candidate_<name>.txt and $OUT/ab_<name>.json. Exit 0 when the
# tests and the check passed and the A/B ran.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${CAND:?set CAND to a folder name under .device/cand}"
out=${OUT:-out}
mkdir -p "$out"
dir=.device/cand/$CAND
export PATH=/usr/local/cuda/bin:$PATH
rc=0
{
  echo "### $CAND: GPU tests"
  timeout 300 "$dir/test_gpu_hopper" 2>&1 | grep -E "OK \]|FAILED|PASSED|Failure" | tail -25
  (( PIPESTATUS[0] == 0 )) || { echo "$CAND: GPU tests FAILED: not timed"; exit 1; }
  echo "### $CAND: CLI against the fp64 reference (${CLI_ARGS:=--preset deepseek-v32 --backend cuda --verify sample})"
  timeout 200 "$dir/dsa-indexer-bwd" backward $CLI_ARGS 2>&1 | tail -8
  (( PIPESTATUS[0] == 0 )) || { echo "$CAND: CLI check FAILED: not timed"; exit 1; }
  if [[ -x $dir/sync_calibration && -z ${SKIP_SANITIZER:-} ]]; then  # staged with it: the sanitizer harness too
    echo "### $CAND: sanitizer harness"
    timeout 240 bash tests/sanitizer/run_sanitizer.sh "$dir" /tmp/cand_san 2>&1 | tail -8
    (( PIPESTATUS[0] == 0 )) || { echo "$CAND: sanitizer FAILED: not timed"; exit 1; }
  fi
  echo "### $CAND: paired A/B against ${BASE:=.device/bin} (${AB_ARGS:=--seq 16384 --iters 10})"
  timeout 400 python3 scripts/ab_compare.py "$BASE/dsa-indexer-bwd-bench" "$dir/dsa-indexer-bwd-bench" \
    --pairs "${AB_PAIRS:-5}" --args "$AB_ARGS" --metric "${AB_METRIC:-ns_per_row}" --out "$out/ab_$CAND.json"
} 2>&1 | tee "$out/candidate_$CAND.txt"
rc=${PIPESTATUS[0]}
exit $rc
