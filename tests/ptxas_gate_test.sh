#!/bin/sh
# ctest cmake_ptxas_gate: cmake/ptxas_gate.sh must pass a compile whose ptxas
# output is clean or only reports an injected warpgroup.arrive (C7519), keep
# the compiler's exit status and output, and fail one that reports serialised
# wgmma (C7512, C7514), the negative controls.
gate=$1
fail() { echo "ptxas_gate_test: FAIL: $*"; exit 1; }
clean='ptxas info    : Used 168 registers, used 10 barriers'
c7512="ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'k'"
got=$(sh "$gate" sh -c "echo '$clean' >&2; echo object" 2>&1) || fail "a clean compile failed"
echo "$got" | grep -q "Used 168 registers" || fail "the compiler's stderr was not passed through"
echo "$got" | grep -q "^object$" || fail "the compiler's stdout was not passed through"
sh "$gate" sh -c "exit 3" 2>/dev/null; [ $? -eq 3 ] || fail "the compiler's exit status was not kept"
if sh "$gate" sh -c "echo \"$c7512\" >&2" 2>/dev/null; then fail "C7512 on stderr passed"; fi
if sh "$gate" sh -c "echo \"$c7512\"" >/dev/null 2>&1; then fail "C7512 on stdout passed"; fi
c7514="ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function 'k'"
if sh "$gate" sh -c "echo \"$c7514\" >&2" 2>/dev/null; then fail "C7514 passed"; fi
c7519="ptxas info    : (C7519) warpgroup.arrive is injected in around line 1 by compiler to allow use of registers in GMMA in function 'k'"
sh "$gate" sh -c "echo \"$c7519\" >&2" 2>/dev/null || fail "an injected warpgroup.arrive (C7519) alone failed"
echo "ptxas_gate_test: clean compile and C7519 pass, C7512 and C7514 fail"
