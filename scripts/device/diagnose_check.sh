#!/usr/bin/env bash
# One device call for "where does the time go, and are the design choices right"
# (perf-log: "Prepared for the next session"): the GPU tests and the sanitizer of
# the staged build, then the ablations (scripts/build_ablations.py) timed against
# the op, then paired A/B of the design candidates among them (stages_k6,
# non_persistent) against the op.
#   build here:  cmake --build build && scripts/device/stage.sh build && scripts/build_ablations.py
#   device run, carry [".device/bin", ".device/ablations"]: bash scripts/device/diagnose_check.sh
# Env: SKIP_CHECKS=1 (no tests/sanitizer), SEQS (16384), ITERS (10), ROUNDS (ablation rounds, 2), AB_PAIRS (5),
#      AB_ARGS ("--seq 16384 --iters 10"). At most 8 files come back: summary.txt,
#      ablations.json, ab_*.json, sanitizer_summary.txt, gpu_tests.log.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
t0=$(date +%s)
stamp() { echo "### $1 at +$(( $(date +%s) - t0 )) s"; }
rc=0
exec > >(tee "$out/summary.txt") 2>&1
if true; then
  if [[ -z ${SKIP_CHECKS:-} ]]; then
    stamp "gpu tests"
    OUT=/tmp/diag bash scripts/device/gpu_check.sh tests | tail -4
    (( PIPESTATUS[0] == 0 )) || rc=1
    cp /tmp/diag/gpu_tests.log "$out/" 2>/dev/null
    stamp "sanitizer"
    timeout 240 bash tests/sanitizer/run_sanitizer.sh .device/bin /tmp/diag/san 2>&1 | tail -8
    (( PIPESTATUS[0] == 0 )) || rc=1
    cp /tmp/diag/san/sanitizer_summary.txt "$out/" 2>/dev/null
  fi
  stamp "ablations"
  # The design candidates are timed once, by the paired A/B below.
  EXCLUDE="stages_k6 non_persistent" SEQS=${SEQS:-16384} ITERS=${ITERS:-10} ROUNDS=${ROUNDS:-2} OUT="$out" \
    timeout 300 bash scripts/device/ablations_check.sh || rc=1
  stamp "paired A/B of the design candidates"
  for cand in stages_k6 non_persistent; do
    [[ -x .device/ablations/bench_$cand ]] || continue
    timeout 240 python3 scripts/ab_compare.py .device/bin/dsa-indexer-bwd-bench .device/ablations/bench_$cand \
      --pairs "${AB_PAIRS:-5}" --args "${AB_ARGS:---seq 16384 --iters 10}" --out "$out/ab_$cand.json" || rc=1
  done
  stamp "done (rc=$rc)"
fi
exit $rc
