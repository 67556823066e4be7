#!/usr/bin/env bash
# dsaib-bench's number flags (--l2-set-aside-mib, --sustained-ms), the top-k's list flags
# (--topk-shapes, --ranges, --topk-dtype) and the target's --target-lse: every bad value exits
# 2 with a message that names the flag and the value (a control character shown escaped,
# as the CLI's messages show it), before any GPU is touched (so it runs in CI without
# one). A good value gets past parsing (exit 0 with a GPU, 77 without).
set -uo pipefail
bench=${1:?usage: bench_number_flag_errors.sh path/to/dsaib-bench}
fail=0
check() {  # flag max good...
  local flag=$1 over=$2; shift 2
  for v in abc "" inf nan 1e300 12abc 0x10 -1 " 5" "5 " $'\t5' 1,5 "$over"; do
    err=$("$bench" --seq 16 "$flag" "$v" 2>&1 >/dev/null)
    rc=$?
    shown=${v//$'\t'/\\t}
    if [[ $rc -ne 2 || $err != *"$flag"*"\"$shown\""* ]]; then
      echo "FAIL: $flag '$v': rc=$rc, stderr: $err"
      fail=1
    fi
  done
  for v in "$@"; do
    "$bench" --seq 16 --iters 1 --warmup 0 "$flag" "$v" >/dev/null 2>&1
    rc=$?
    if [[ $rc -eq 2 ]]; then
      echo "FAIL: $flag '$v' rejected"
      fail=1
    fi
  done
}
check --l2-set-aside-mib 1048577 0 37.5 1048576
check --sustained-ms 600001 0 -0 1 1e3 +5 250.5
# The top-k's list flags (--op topk): a bad item exits 2 naming the flag and the item; good
# lists get past parsing.
check_list() {  # flag "bad items" good...
  local flag=$1 bad=$2; shift 2
  local v
  for v in $bad; do
    err=$("$bench" --op topk --seq 16 "$flag" "$v" 2>&1 >/dev/null)
    rc=$?
    if [[ $rc -ne 2 || $err != *"$flag"*"\"$v\""* ]]; then
      echo "FAIL: $flag '$v': rc=$rc, stderr: $err"
      fail=1
    fi
  done
  for v in "$@"; do
    "$bench" --op topk --seq 16 --iters 1 --warmup 0 --no-floor --sustained-ms 0 "$flag" "$v" >/dev/null 2>&1
    rc=$?
    if [[ $rc -eq 2 ]]; then
      echo "FAIL: $flag '$v' rejected"
      fail=1
    fi
  done
}
check_list --topk-shapes "64x96 12x128 136x128 0x64 64 x128 064x128 64x0128 64X128 8x64x1 abc" \
  64x128 32x128,64x64 8x64 128x128
check_list --ranges "random causal-shuffled cp_shard Causal" causal cp-shard causal,cp-shard
check_list --topk-dtype "fp8 e5m2 BF16 e4m3fn f32" bf16 e4m3 bf16,e4m3
check_list --target-lse "none Given lse true base2" given absent given,absent
# e4m3 inputs need D 128 on the cuda backend: refused naming the shape, before any GPU is used.
err=$("$bench" --op topk --seq 16 --topk-dtype e4m3 --topk-shapes 64x64 2>&1 >/dev/null)
rc=$?
if [[ $rc -ne 2 || $err != *"e4m3"*"D 128, got 64x64"* ]]; then
  echo "FAIL: --topk-dtype e4m3 --topk-shapes 64x64: rc=$rc, stderr: $err"
  fail=1
fi
# A report that cannot be written is an error (exit 2), not a silent exit 0.
if [[ -w /dev/full ]]; then
  err=$("$bench" --help 2>&1 >/dev/full)
  rc=$?
  if [[ $rc -ne 2 || $err != *"could not be written"* ]]; then
    echo "FAIL: --help >/dev/full: rc=$rc, stderr: $err"
    fail=1
  fi
fi
[[ $fail -eq 0 ]] && echo "bench number and top-k list flags: bad values rejected, good ones parsed"
exit $fail
