#!/bin/sh
# Compiler launcher of the cuda backend (src/hopper/sources.cmake): runs the
# compile command given as arguments, passes its output through, and fails the
# compile when ptxas reports C7512 ("wgmma.mma_async instructions are serialized
# due to insufficient register resources"). ptxas prints C7512 as info, not as a
# warning, so -Xptxas -Werror (which fails spills) does not catch it; a kernel
# with serialised wgmma is correct and several times slower (perf-log, build
# probe v22 and v24). Tested by ctest cmake_ptxas_gate (label cpu).
#   ptxas_gate.sh <compiler> <args...>
out=$(mktemp) || exit 1
err=$(mktemp) || exit 1
"$@" >"$out" 2>"$err"
rc=$?
cat "$out"
cat "$err" >&2
if [ "$rc" -eq 0 ] && grep -q "(C7512)" "$out" "$err"; then
  echo "ptxas_gate: error: ptxas serialised wgmma (C7512) in the kernel(s) named above; give the consumer more registers or fewer live values (docs/hopper-kernel.md, registers)" >&2
  rc=1
fi
rm -f "$out" "$err"
exit "$rc"
