#!/bin/sh
# Compiler launcher of the cuda backend (src/hopper/sources.cmake): runs the
# compile command given as arguments, passes its output through, and fails the
# compile when ptxas reports that it serialised wgmma: "(C75xx) Potential
# Performance Loss: wgmma.mma_async instructions are serialized due to ..." (C7512
# insufficient registers; C7514 / C7515 non-wgmma instructions reading / defining
# accumulators of wgmma in flight; each measured far slower). ptxas prints these as
# info, not as warnings, so -Xptxas -Werror (which fails spills) does not catch
# them; a kernel with serialised wgmma is correct and much slower. An injected
# warpgroup.arrive (C7519) alone is not a failure. Tested by ctest
# cmake_ptxas_gate (label cpu).
#   ptxas_gate.sh <compiler> <args...>
out=$(mktemp) || exit 1
err=$(mktemp) || exit 1
"$@" >"$out" 2>"$err"
rc=$?
cat "$out"
cat "$err" >&2
if [ "$rc" -eq 0 ] && grep -qE "\(C75[0-9][0-9]\) Potential Performance Loss: wgmma" "$out" "$err"; then
  echo "ptxas_gate: error: ptxas serialised wgmma in the kernel(s) named above (docs/hopper-kernel.md, registers)" >&2
  rc=1
fi
rm -f "$out" "$err"
exit "$rc"
