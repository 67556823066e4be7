#!/usr/bin/env bash
# scripts/compare_kernel_text.py: exit 2 naming the file for a missing or unreadable
# binary, a directory, a binary with no CUDA kernels, and a usage error; with a cuda
# build's binary, that binary equals itself (exit 0).
#   usage: compare_kernel_text.sh SCRIPT PYTHON [CUDA_BINARY]
set -uo pipefail
script=${1:?SCRIPT} py=${2:?PYTHON} bin=${3:-}
fail=0
expect() {  # expect RC WHAT ARGS...
  local want=$1 what=$2; shift 2
  out=$("$py" "$script" "$@" 2>&1); rc=$?
  if [[ $rc -ne $want ]]; then echo "FAIL $what: exit $rc, expected $want: $out"; fail=1; else echo "ok   $what: exit $rc"; fi
}
expect 2 "a missing binary" /nonexistent/binary "$script"
[[ $out == *"/nonexistent/binary: no such file"* ]] || { echo "FAIL the message names the file: $out"; fail=1; }
expect 2 "a file that is no binary" "$script" "$script"
[[ $out == *"objcopy could not read it"* ]] || { echo "FAIL the message says objcopy failed: $out"; fail=1; }
expect 2 "a directory" "$(dirname "$script")" "$script"
[[ $out == *"not a regular file"* ]] || { echo "FAIL the message says it is no regular file: $out"; fail=1; }
elf=$("$py" -c "import os, sys; print(os.path.realpath(sys.executable))")  # an ELF host binary with no CUDA kernels
expect 2 "a binary with no CUDA kernels" "$elf" "$elf"
[[ $out == *"no kernel text found"* ]] || { echo "FAIL the message says no kernels: $out"; fail=1; }
expect 2 "one argument" "$script"
if [[ -n $bin ]]; then
  expect 0 "a cuda binary against itself" "$bin" "$bin"
  [[ $out == *identical* ]] || { echo "FAIL the report says identical: $out"; fail=1; }
fi
exit $fail
