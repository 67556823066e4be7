#!/usr/bin/env bash
# SASS of the one-term D128 kernel in two bench binaries: instruction mix, and the scatter role's loop.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
which cuobjdump nvdisasm
fn='_ZN5dsaib6hopper23indexer_backward_kernelINS0_10TileConfigILi128ELb0ELb0EEEEEvNS0_21IndexerBackwardParamsE'
for b in "$@"; do
  tag=$(echo "$b" | tr '/.' '__')
  cuobjdump -sass -fun "$fn" "$b" > "$out/sass_$tag.txt" 2>&1
  echo "== $b: $(grep -cE '^\s+/\*[0-9a-f]{4}\*/' "$out/sass_$tag.txt") instructions"
  grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9]+(\.[A-Z0-9_]+)*' "$out/sass_$tag.txt" | awk '{print $NF}' | sed 's/\..*//' | sort | uniq -c | sort -rn | head -40 | tr '\n' ' '
  echo
  echo "-- around the REDs:"
  grep -nE 'RED|F2F|HADD2\.F32|F2FP' "$out/sass_$tag.txt" | head -60
done
