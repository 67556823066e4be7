#!/usr/bin/env bash
# Sanitizer harness (label sanitizer). Runs the GPU tests of the Sanitized.*
# suite (the b1-q1-k512-random, b3-q64-k2048-random and b1-s512-causal shapes, DeepSeek shape, every tail case) of the backward
# (test_gpu_hopper), of the loss forward (test_gpu_kl_forward), of the
# attention target (test_gpu_attention_target) and of the indexer's top-k
# (test_gpu_indexer_topk: cuts of the candidate buffers, THD) under
# compute-sanitizer racecheck, synccheck, memcheck and initcheck, requiring zero
# reports, and runs the negative controls of sync_calibration: the lane-0-alone
# handoffs must be flagged, the all-lanes ones must be clean.
#   usage: run_sanitizer.sh BIN_DIR [LOG_DIR] [TOOLS...]
# Exit: 0 all as required, 1 a check failed, 77 skipped (no GPU or no compute-sanitizer).
set -uo pipefail
bin=${1:?BIN_DIR}
logs=${2:-.}
shift $(( $# >= 2 ? 2 : $# ))
tools=("$@")
[[ ${#tools[@]} -eq 0 ]] && tools=(racecheck synccheck memcheck initcheck)
mkdir -p "$logs"
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [[ ! -x $cs ]]; then echo "SKIPPED: compute-sanitizer not found"; exit 77; fi
if ! nvidia-smi -L >/dev/null 2>&1; then echo "SKIPPED: no GPU"; exit 77; fi

fail=0
summary=()
# ---- negative and positive controls (racecheck must be able to fail)
for mode in raw_lane0 war_lane0 raw_all war_all; do
  log="$logs/racecheck_control_$mode.log"
  "$cs" --tool racecheck --racecheck-report hazard --print-limit 0 "$bin/sync_calibration" "$mode" >"$log" 2>&1
  hazards=$(grep -oE "RACECHECK SUMMARY: [0-9]+ hazard" "$log" | grep -oE "[0-9]+" | head -1)
  hazards=${hazards:-0}
  if [[ $mode == *lane0 ]]; then
    if (( hazards > 0 )); then verdict="flagged as required"; else verdict="NOT FLAGGED (control failed)"; fail=1; fi
  else
    if (( hazards == 0 )) && grep -q "ran" "$log"; then verdict="clean as required"; else verdict="FLAGGED (control failed)"; fail=1; fi
  fi
  summary+=("control $mode: $hazards hazards, $verdict")
done
# ---- the kernels under every tool (a binary missing from BIN_DIR fails the check)
for test_bin in test_gpu_hopper test_gpu_kl_forward test_gpu_attention_target test_gpu_indexer_topk; do
  for tool in "${tools[@]}"; do
    log="$logs/${test_bin}_$tool.log"
    extra=()
    [[ $tool == racecheck ]] && extra=(--racecheck-report hazard)
    "$cs" --tool "$tool" "${extra[@]}" --print-limit 0 --error-exitcode 99 "$bin/$test_bin" --gtest_filter='Sanitized.*:SanitizedPFree.*' >"$log" 2>&1
    rc=$?
    errors=$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | grep -oE "[0-9]+" | tail -1)
    hazards=$(grep -oE "RACECHECK SUMMARY: [0-9]+ hazard" "$log" | grep -oE "[0-9]+" | tail -1)
    passed=$(grep -cE "^\[       OK \]" "$log")
    if [[ $rc -ne 0 ]] || (( passed == 0 )); then fail=1; verdict="FAILED (rc $rc, $passed tests ok)"; else verdict="clean"; fi
    summary+=("$test_bin $tool: rc=$rc errors=${errors:-?} hazards=${hazards:-n/a} tests_ok=$passed -> $verdict")
  done
done
printf '%s\n' "${summary[@]}" | tee "$logs/sanitizer_summary.txt"
exit $fail
