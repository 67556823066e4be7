#!/usr/bin/env bash
# One device call: the L2-hinted kernel (B1 D128, S_kv above ~40 K) against the
# context's L2 set-aside for persisting lines (cudaLimitPersistingL2CacheSize,
# 11.25 MiB in a fresh context on the H200) and the evict_last fraction of its
# dK reds. Paired A/Bs (scripts/ab_compare.py) of the staged bench (.device/bin,
# fraction 0.35) at the default set-aside against:
#   B1 the same bench with the set-aside at SET_ASIDE_MIB (default 37.5, the H200's cap)
#   B2 the bench of .device/cand/$CAND (default v53: fraction 1.0) with the same set-aside
#   B3 the same bench with no set-aside (0 MiB)
#   B4 the bench of .device/cand/$CAND at the default set-aside
#   device run, carry [".device/bin", ".device/cand/v53"]: bash scripts/device/l2_set_aside_probe.sh
# Env: CAND (v53), SET_ASIDE_MIB (37.5), PAIRS (3), ARGS ("--seq 65536 --ids causal,random --iters 10"),
#      PROBES ("B1 B2 B3": which of the four run).
# Writes $OUT/l2_probe_<B>.json and the console to $OUT/l2_probe.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-out}
mkdir -p "$out" .device/probe_wrappers
cand=${CAND:-v53}
mib=${SET_ASIDE_MIB:-37.5}
args=${ARGS:---seq 65536 --ids causal,random --iters 10}
wrap() {  # name binary [set-aside]
  printf '#!/bin/sh\nexec %s "$@"%s\n' "$PWD/$2" "${3:+ --l2-set-aside-mib $3}" > ".device/probe_wrappers/$1"
  chmod +x ".device/probe_wrappers/$1"
}
wrap B1 .device/bin/dsa-indexer-bwd-bench "$mib"
wrap B2 ".device/cand/$cand/dsa-indexer-bwd-bench" "$mib"
wrap B3 .device/bin/dsa-indexer-bwd-bench 0
wrap B4 ".device/cand/$cand/dsa-indexer-bwd-bench"
rc=0
: > "$out/l2_probe.txt"
for b in ${PROBES:-B1 B2 B3}; do
  echo "### A = .device/bin (set-aside as the context has it), B = $b ($(tail -1 .device/probe_wrappers/$b))" |
    tee -a "$out/l2_probe.txt"
  timeout 300 python3 scripts/ab_compare.py .device/bin/dsa-indexer-bwd-bench ".device/probe_wrappers/$b" \
    --pairs "${PAIRS:-3}" --args "$args" --out "$out/l2_probe_$b.json" 2>&1 | tee -a "$out/l2_probe.txt"
  (( PIPESTATUS[0] == 0 )) || rc=1
done
exit $rc
