#!/usr/bin/env bash
# dsa-indexer-bwd-bench --l2-set-aside-mib: every bad value exits 2 with a message
# that names the flag and the value, before any GPU is touched (so it runs in CI
# without one). A good value gets past parsing (exit 0 with a GPU, 77 without).
set -uo pipefail
bench=${1:?usage: bench_set_aside_flag_errors.sh path/to/dsa-indexer-bwd-bench}
fail=0
for v in abc "" inf nan 1e300 12abc 0x10 -1 1048577; do
  err=$("$bench" --seq 16 --l2-set-aside-mib "$v" 2>&1 >/dev/null)
  rc=$?
  if [[ $rc -ne 2 || $err != *"--l2-set-aside-mib"*"\"$v\""* ]]; then
    echo "FAIL: --l2-set-aside-mib '$v': rc=$rc, stderr: $err"
    fail=1
  fi
done
for v in 0 37.5 1048576; do
  "$bench" --seq 16 --iters 1 --warmup 0 --l2-set-aside-mib "$v" >/dev/null 2>&1
  rc=$?
  if [[ $rc -eq 2 ]]; then
    echo "FAIL: --l2-set-aside-mib '$v' rejected"
    fail=1
  fi
done
[[ $fail -eq 0 ]] && echo "bench --l2-set-aside-mib: bad values rejected, good ones parsed"
exit $fail
