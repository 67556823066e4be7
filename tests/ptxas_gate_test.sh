#!/bin/sh
# ctest cmake_ptxas_gate: cmake/ptxas_gate.sh must pass a compile whose ptxas
# output is clean (and keep its exit status and output), and fail one that
# reports C7512, the negative control.
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
echo "ptxas_gate_test: clean compile passes, C7512 fails"
