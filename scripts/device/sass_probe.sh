#!/usr/bin/env bash
# SASS of the one-term D128 kernel in bench binaries (cuobjdump on the device: the build
# machine has no disassembler): instruction count and mix, the reds and the float conversions.
#   device run: bash scripts/device/sass_probe.sh .device/bin/dsa-indexer-bwd-bench [.device/cand/NAME/dsa-indexer-bwd-bench ...]
set -uo pipefail
(( $# > 0 )) || { echo "usage: $0 BENCH_BINARY..." >&2; exit 2; }
out=${OUT:-out}; mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
command -v cuobjdump >/dev/null || { echo "cuobjdump not found" >&2; exit 1; }
fn='_ZN5dsaib6hopper23indexer_backward_kernelINS0_10TileConfigILi128ELb0ELb0EEEEEvNS0_21IndexerBackwardParamsE'
for b in "$@"; do
  tag=$(echo "$b" | tr '/.' '__')
  cuobjdump -sass -fun "$fn" "$b" > "$out/sass_$tag.txt" 2>&1
  # instruction lines: "/*<hex address>*/  [@predicate] OPCODE..." (addresses of any length)
  insn='^\s+/\*[0-9a-f]+\*/\s+(@!?U?P[0-9T] )?[A-Z0-9]+'
  echo "== $b: $(grep -cE "$insn" "$out/sass_$tag.txt") instructions"
  grep -oE "$insn" "$out/sass_$tag.txt" | awk '{print $NF}' | sort | uniq -c | sort -rn | head -40 | tr '\n' ' '
  echo
  echo "-- the reds and the 16/32-bit float conversions:"
  grep -nE 'REDG|F2F|HADD2\.F32' "$out/sass_$tag.txt" | head -200
done
