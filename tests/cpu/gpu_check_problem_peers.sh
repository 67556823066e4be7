#!/usr/bin/env bash
# ctest scripts_gpu_check_problem_peers: scripts/gpu_check.sh's forward-peers and target-peers
# parts, on a machine without a GPU: a stand-in nvidia-smi (an sm_90 GPU) and a stand-in
# dsaib-bench (the report of the cases of the op it is asked for) in a fake CUDA build folder;
# the peer scripts then find no CUDA device and say so (exit 77). Checks: ours ran (the forward
# with --op forward, the target with --op target at the peers' shapes) and its rows are in the
# tables, the peers' reasons are in the summary, a failing bench of ours fails its part, and a
# bad --peers-seq is refused.
#   usage: gpu_check_problem_peers.sh REPO PYTHON
set -uo pipefail
repo=$1
py=$2
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
fail=0
bad() { echo "gpu_check_problem_peers: FAIL: $*"; fail=1; }

mkdir -p "$t/bin" "$t/build/bench"
cat >"$t/bin/nvidia-smi" <<'EOF'
#!/bin/sh
echo "0, NVIDIA H200, 9.0"
EOF
printf 'DSAIB_ENABLE_CUDA:BOOL=ON\nCMAKE_CUDA_COMPILER:FILEPATH=/usr/local/cuda/bin/nvcc\nCMAKE_BUILD_TYPE:STRING=Release\n' \
  >"$t/build/CMakeCache.txt"
cat >"$t/build/bench/dsaib-bench" <<'EOF'
#!/bin/sh
# stand-in: the report of the cases of --op (or a failure when FAKE_FAIL is set)
[ -n "${FAKE_FAIL:-}" ] && { echo "CUDA error" >&2; exit 1; }
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
  *) echo "unexpected --op $op" >&2; exit 2 ;;
esac
echo "fake bench ran"
EOF
chmod +x "$t/bin/nvidia-smi" "$t/build/bench/dsaib-bench"
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

if [[ $fail != 0 ]]; then
  echo "--- log"; cat "$t/log"
  exit 1
fi
echo "gpu_check_problem_peers: forward-peers and target-peers parts behave"
