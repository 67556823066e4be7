#!/usr/bin/env bash
# ctest scripts_gpu_check_problem_peers: scripts/gpu_check.sh's forward-peers, target-peers,
# topk and topk-peers parts, on a machine without a GPU: a stand-in nvidia-smi (an sm_90 GPU), a
# stand-in dsaib-bench (the report of the cases of the op it is asked for) and a stand-in
# test_gpu_indexer_topk in a fake CUDA build folder; the peer scripts then find no CUDA device
# and say so (exit 77). Checks: ours ran (the forward with --op forward, the target with --op
# target at the peers' shapes, the top-k with --op topk at --topk-seq and its memory run) and
# its rows are in the tables, the peers' reasons are in the summary, a failing bench of ours
# fails its part, a skipped top-k test fails the topk part, a bad --peers-seq or --topk-seq is
# refused, and the part names: every part has its --skip-PART, an unknown part is refused.
#   usage: gpu_check_problem_peers.sh REPO PYTHON
set -uo pipefail
repo=$1
py=$2
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
fail=0
bad() { echo "gpu_check_problem_peers: FAIL: $*"; fail=1; }

mkdir -p "$t/bin" "$t/build/bench" "$t/build/tests/gpu"
cat >"$t/bin/nvidia-smi" <<'EOF'
#!/bin/sh
echo "0, NVIDIA H200, 9.0"
EOF
printf 'DSAIB_ENABLE_CUDA:BOOL=ON\nCMAKE_CUDA_COMPILER:FILEPATH=/usr/local/cuda/bin/nvcc\nCMAKE_BUILD_TYPE:STRING=Release\n' \
  >"$t/build/CMakeCache.txt"
cat >"$t/build/bench/dsaib-bench" <<'EOF'
#!/bin/sh
# stand-in: the report of the cases of --op (or a failure when FAKE_FAIL is set); logs its arguments
[ -n "${FAKE_FAIL:-}" ] && { echo "CUDA error" >&2; exit 1; }
echo "$*" >>"$(dirname "$0")/calls.txt"
while [ $# -gt 0 ]; do
  case $1 in --json) out=$2 ;; --op) op=$2 ;; --shapes) shapes=$2 ;; esac
  shift
done
case $op in
  forward) cat >"$out" <<'J'
{"tool": "dsaib-bench", "cases": [
 {"op": "forward", "ids": "causal", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048,
  "valid_slots_per_row": 1536.0, "ns_per_row": 160.5, "floor": {"ns_per_row": 69.3}, "floor_ratio": 2.32},
 {"op": "forward", "ids": "random", "seq": 4096, "heads": 64, "dim": 128, "topk": 2048,
  "valid_slots_per_row": 2048.0, "ns_per_row": 197.8, "floor": {"ns_per_row": 92.2}, "floor_ratio": 2.15}]}
J
  ;;
  target)
    [ "$shapes" = "128x576,64x192" ] || { echo "unexpected --shapes $shapes" >&2; exit 2; }
    cat >"$out" <<'J'
{"tool": "dsaib-bench", "cases": [
 {"op": "target", "ids": "causal", "seq": 4096, "heads": 128, "dim": 576, "topk": 2048,
  "valid_slots_per_row": 1536.0, "ns_per_row": 400.0, "floor": {"ns_per_row": 320.0}, "floor_ratio": 1.25}]}
J
  ;;
  topk) cat >"$out" <<'J'
{"tool": "dsaib-bench", "cases": [
 {"op": "topk", "ranges": "causal", "seq": 16384, "seq_q": 16384, "heads": 64, "dim": 128, "topk": 2048,
  "visible_keys_per_row": 8192.5, "ns_per_row": 900.0, "floor": {"ns_per_row": 600.0}, "floor_ratio": 1.5}]}
J
  ;;
  *) echo "unexpected --op $op" >&2; exit 2 ;;
esac
echo "fake bench ran"
EOF
cat >"$t/build/tests/gpu/test_gpu_indexer_topk" <<'EOF'
#!/bin/sh
# stand-in: gtest's lines of a passing run (a skipped test when FAKE_SKIP is set)
echo "[==========] 3 tests from 1 test suite ran. (10 ms total)"
if [ -n "${FAKE_SKIP:-}" ]; then echo "[  SKIPPED ] 3 tests, listed below:"; else echo "[  PASSED  ] 3 tests."; fi
EOF
chmod +x "$t/bin/nvidia-smi" "$t/build/bench/dsaib-bench" "$t/build/tests/gpu/test_gpu_indexer_topk"
export PATH="$t/bin:$PATH" PYTHON=$py CUDA_VISIBLE_DEVICES=""

bash "$repo/scripts/gpu_check.sh" -B "$t/build" --only forward-peers,target-peers --peers-seq 4096 "$t/out" \
  >"$t/log" 2>&1
rc=$?
[[ $rc == 0 ]] || bad "exit $rc, expected 0 (the peers could not run, which is no failure)"
grep -q "^forward-peers PASS.*ours ran" "$t/out/summary.txt" || bad "forward-peers not PASS with ours: $(cat "$t/out/summary.txt")"
grep -q "^target-peers PASS.*ours ran" "$t/out/summary.txt" || bad "target bench not run: $(cat "$t/out/summary.txt")"
grep -q "| causal | 4096 | 128 | 576 | 2048 | 1,536.0 | 400.0 | 320.0 | 1.25 |" "$t/out/target-peers/side_by_side.md" ||
  bad "the target bench's row missing: $(cat "$t/out/target-peers/side_by_side.md" 2>&1)"
grep -q "torch_eager unavailable" "$t/out/summary.txt" || bad "the peers' reasons are missing: $(cat "$t/out/summary.txt")"
grep -q "| causal | 4096 | 64 | 128 | 2048 | 1,536.0 | 160.5 | 69.3 | 2.32 |" "$t/out/forward-peers/side_by_side.md" ||
  bad "ours' row missing from the table: $(cat "$t/out/forward-peers/side_by_side.md" 2>&1)"
"$py" - "$t/out/forward-peers/peers.json" "$t/out/target-peers/peers.json" <<'EOF' || bad "peers.json"
import json, sys
for path in sys.argv[1:]:
    j = json.load(open(path))
    assert j["status"] == "unavailable", j
    assert set(j["peers"]) == {"torch_eager", "cudnn_frontend", "tilelang"}, j["peers"]
EOF

FAKE_FAIL=1 bash "$repo/scripts/gpu_check.sh" -B "$t/build" --only forward-peers --peers-seq 4096 "$t/out2" \
  >"$t/log2" 2>&1
rc=$?
[[ $rc == 1 ]] || bad "a failing bench of ours: exit $rc, expected 1"
grep -q "^forward-peers FAIL.*ours FAILED" "$t/out2/summary.txt" || bad "ours' failure not reported: $(cat "$t/out2/summary.txt")"

bash "$repo/scripts/gpu_check.sh" -B "$t/build" --only forward-peers --peers-seq 4096,x "$t/out3" >"$t/log3" 2>&1
rc=$?
[[ $rc == 2 ]] || bad "--peers-seq 4096,x: exit $rc, expected 2"
grep -q -- "--peers-seq: expected" "$t/log3" || bad "--peers-seq refusal says nothing: $(cat "$t/log3")"

# the topk and topk-peers parts: the bench at --topk-seq with --topk-bench-args, the memory run, the table
: >"$t/build/bench/calls.txt"
bash "$repo/scripts/gpu_check.sh" -B "$t/build" --only topk,topk-peers --topk-seq 16384 \
  --topk-bench-args "--topk-shapes 64x128" "$t/out4" >"$t/log4" 2>&1
rc=$?
[[ $rc == 0 ]] || bad "topk,topk-peers: exit $rc, expected 0"
grep -q "^topk .*PASS.*GPU tests passed" "$t/out4/summary.txt" || bad "topk not PASS: $(cat "$t/out4/summary.txt")"
grep -q "^topk-peers PASS.*ours from .*topk/bench.json" "$t/out4/summary.txt" ||
  bad "topk-peers not PASS with ours: $(cat "$t/out4/summary.txt")"
grep -q -- "^--op topk --seq 16384 --topk 2048 --json .*/topk/bench.json --topk-shapes 64x128$" "$t/build/bench/calls.txt" ||
  bad "the topk bench's arguments: $(cat "$t/build/bench/calls.txt")"
grep -q -- "^--op topk --seq 131072,262144 --topk 2048 --iters 3 --warmup 1 --sustained-ms 0 --no-floor --json .*/topk/memory.json$" \
  "$t/build/bench/calls.txt" || bad "the topk memory run's arguments: $(cat "$t/build/bench/calls.txt")"
grep -q "| causal | 16384 | 64 | 128 | 2048 | .* | 900.0 | 600.0 | 1.50 |" "$t/out4/topk-peers/side_by_side.md" ||
  bad "the topk bench's row missing: $(cat "$t/out4/topk-peers/side_by_side.md" 2>&1)"
"$py" - "$t/out4/topk-peers/peers.json" <<'EOF' || bad "topk peers.json"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["status"] == "unavailable", j
assert j["problem"] == "indexer_topk", j["problem"]
EOF

FAKE_SKIP=1 bash "$repo/scripts/gpu_check.sh" -B "$t/build" --only topk --topk-seq 16384 "$t/out5" >"$t/log5" 2>&1
rc=$?
[[ $rc == 1 ]] || bad "a skipped top-k test: exit $rc, expected 1"
grep -q "^topk .*FAIL.*skipped tests" "$t/out5/summary.txt" || bad "the skipped top-k test not reported: $(cat "$t/out5/summary.txt")"

bash "$repo/scripts/gpu_check.sh" -B "$t/build" --only topk --topk-seq 0 "$t/out6" >"$t/log6" 2>&1
rc=$?
[[ $rc == 2 ]] || bad "--topk-seq 0: exit $rc, expected 2"
grep -q -- "--topk-seq: expected" "$t/log6" || bad "--topk-seq refusal says nothing: $(cat "$t/log6")"

# the part names: each one's --skip-PART is accepted (every part skipped: exit 0, each SKIPPED, in
# order), a misspelt one is refused with the list, and --help names each --skip-PART
parts=(tests sanitizer cli bench target topk peers forward-peers target-peers topk-peers python torch-step megatron)
skips=()
for p in "${parts[@]}"; do skips+=("--skip-$p"); done
bash "$repo/scripts/gpu_check.sh" -B "$t/build" "${skips[@]}" "$t/out7" >"$t/log7" 2>&1
rc=$?
[[ $rc == 0 ]] || bad "every --skip-PART: exit $rc, expected 0 ($(tail -3 "$t/log7"))"
[[ $(awk '$2 == "SKIPPED" {print $1}' "$t/out7/summary.txt" | tr '\n' ' ') == "${parts[*]} " ]] ||
  bad "every part skipped, in order: $(cat "$t/out7/summary.txt")"
for opt in --skip-top-k "--only topk,toppk"; do
  # shellcheck disable=SC2086  # opt is one or two words
  bash "$repo/scripts/gpu_check.sh" -B "$t/build" $opt "$t/out8" >"$t/log8" 2>&1
  rc=$?
  [[ $rc == 2 ]] || bad "$opt: exit $rc, expected 2"
  grep -q "the parts are: ${parts[*]}" "$t/log8" || bad "$opt: the parts not listed: $(cat "$t/log8")"
done
help=$(bash "$repo/scripts/gpu_check.sh" --help)
for p in "${parts[@]}"; do
  [[ $help == *"--skip-$p"[,\ $'\n']* ]] || bad "--help names no --skip-$p"
done
[[ $help == *"--topk-bench-args"* && $help == *"--topk-seq"* ]] || bad "--help names no --topk-bench-args or --topk-seq"

if [[ $fail != 0 ]]; then
  echo "--- log"; cat "$t/log"
  exit 1
fi
echo "gpu_check_problem_peers: forward-peers, target-peers, topk and topk-peers parts and the part names behave"
