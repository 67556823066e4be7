#!/usr/bin/env bash
# One device call: do the launch decisions that were tuned on pre-rolled timings
# (each launch after a 3 ms GPU spin) still pay when the op runs back to back at
# the H200's power limit? Paired A/Bs (scripts/ab_compare.py --metric
# ns_per_row_sustained) of the staged bench (.device/bin) as it decides (A)
# against the same bench with one decision turned off (B):
#   stagger   DSAIB_START_STAGGER=off  (SEQS_STAGGER, default 4096,16384)
#   l2hints   DSAIB_L2_HINTS=off       (S 65536: the only size where the hint is taken at B1)
#   device run, carry [".device/bin"]: bash scripts/device/sustained_defaults_check.sh
# Env: CHECKS ("stagger l2hints"), PAIRS (3), SUSTAINED_MS (2000), ITERS (5).
# Writes $OUT/sustained_<check>.json and the console to $OUT/sustained_defaults.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
out=${OUT:-out}
mkdir -p "$out" .device/probe_wrappers
bench=$PWD/.device/bin/dsa-indexer-bwd-bench
common="--iters ${ITERS:-5} --warmup 2 --sustained-ms ${SUSTAINED_MS:-2000}"
rc=0
: > "$out/sustained_defaults.txt"
for c in ${CHECKS:-stagger l2hints}; do
  case $c in
    stagger) env="DSAIB_START_STAGGER=off"; args="--seq ${SEQS_STAGGER:-4096,16384} --ids causal,random" ;;
    l2hints) env="DSAIB_L2_HINTS=off"; args="--seq 65536 --ids causal,random" ;;
    *) echo "unknown check $c"; rc=2; continue ;;
  esac
  printf '#!/bin/sh\nexport %s\nexec "%s" "$@"\n' "$env" "$bench" > ".device/probe_wrappers/$c"
  chmod +x ".device/probe_wrappers/$c"
  echo "### A = .device/bin as it decides, B = $env; sustained ($common $args)" | tee -a "$out/sustained_defaults.txt"
  timeout 280 python3 scripts/ab_compare.py "$bench" ".device/probe_wrappers/$c" --pairs "${PAIRS:-3}" \
    --metric ns_per_row_sustained --args "$common $args" --out "$out/sustained_$c.json" 2>&1 |
    tee -a "$out/sustained_defaults.txt"
  (( PIPESTATUS[0] == 0 )) || rc=1
done
exit $rc
