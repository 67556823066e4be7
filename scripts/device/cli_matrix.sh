#!/usr/bin/env bash
# The cases of shared/design/test-cases.md (and some more) through the CLI on the
# cuda backend, each checked against the fp64 reference (`--verify all`, or
# `sample` for the large ones): shapes, topk not a multiple of a tile, head
# counts, D 64, tiny, S_kv < topk, THD with empty sequences (local and global
# ids), global ids with B >= 2, fp32 outputs and weights, both a-operand
# precisions, scalars, strict mode. Fresh generated inputs per case (seeded).
#   device run, carry [".device/bin"]: bash scripts/device/cli_matrix.sh
# Env: BIN (default .device/bin), BACKEND (default cuda; cpu checks the script itself
# without a GPU). Output: one line per case, then a summary;
# $OUT/cli_matrix.txt. Exit 1 when any case does not PASS.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-out}
mkdir -p "$out"
cli=${BIN:-.device/bin}/dsa-indexer-bwd
cases=(
  "--preset race-report-1"
  "--preset race-report-2"
  "--preset race-report-3"
  "--preset thd"
  "--preset thd --id-mode global"
  "--layout thd --seqlens-q 0,5,300,1 --seqlens-k 7,0,300,2 --heads 64 --head-dim 128 --topk 128"
  "--layout thd --seqlens-q 0,5,300,1 --seqlens-k 7,0,300,2 --heads 64 --head-dim 128 --topk 128 --id-mode global"
  "--s-q 5 --s-kv 100 --topk 2048 --heads 64 --head-dim 128"
  "--s-q 1 --s-kv 1 --topk 1 --heads 64 --head-dim 128"
  "--batch 3 --s-q 64 --s-kv 2048 --topk 512 --ids permutation --id-mode global"
  "--batch 3 --s-q 64 --s-kv 2048 --topk 512 --ids permutation"
  "--s-q 256 --s-kv 2304 --topk 1"
  "--s-q 256 --s-kv 2304 --topk 100"
  "--s-q 256 --s-kv 2304 --topk 129"
  "--s-q 256 --s-kv 2304 --topk 1000"
  "--s-q 256 --s-kv 2304 --topk 2176"
  "--s-q 256 --s-kv 2304 --topk 2176 --ids permutation"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 8"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 16"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 32"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 72"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 128"
  "--s-q 128 --s-kv 1024 --topk 256 --heads 128 --head-dim 64"
  "--s-q 256 --s-kv 2048 --topk 512 --head-dim 64 --ids permutation"
  "--s-q 256 --s-kv 2048 --topk 512 --out-dtype f32"
  "--s-q 256 --s-kv 2048 --topk 512 --out-dtype f32 --head-dim 64 --weights-f32"
  "--s-q 256 --s-kv 2048 --topk 512 --a-operand bf16x2"
  "--s-q 256 --s-kv 2048 --topk 512 --a-operand bf16 --weights-f32"
  "--s-q 256 --s-kv 2048 --topk 512 --normalization-count 7 --loss-coeff -2.5 --grad-loss 0.75 --sm-scale 0.3"
  "--s-q 256 --s-kv 2048 --topk 512 --strict-indices"
  "--preset small"
  "--batch 2 --s-q 8192 --topk 2048 --heads 64 --head-dim 128 --verify sample"
  "--preset deepseek-v32 --verify sample"
  # the deterministic mode (fixed-point d_index_k): THD global ids, fp32 outputs (split A), D 64, DeepSeek
  "--preset thd --id-mode global --deterministic"
  "--s-q 256 --s-kv 2048 --topk 512 --out-dtype f32 --deterministic"
  "--s-q 256 --s-kv 2048 --topk 512 --head-dim 64 --ids permutation --deterministic"
  "--preset deepseek-v32 --verify sample --deterministic"
)
pass=0 fail=0
{
  echo "dsa-indexer-bwd backward --backend ${BACKEND:-cuda}, per case: verify, relative RMS of d_index_q / d_weights / d_index_k, result"
  for i in "${!cases[@]}"; do
    c=${cases[$i]}
    verify=all
    [[ $c == *"--verify"* ]] && verify=
    json=$(timeout 300 "$cli" backward --backend ${BACKEND:-cuda} ${verify:+--verify $verify} --seed $((1000 + i)) $c --json 2>/dev/null)
    rc=$?
    line=$(python3 - "$json" <<'EOF'
import json, sys
try:
    j = json.loads(sys.argv[1])
except Exception:
    print("no JSON report"); sys.exit()
if "error" in j:
    print("ERROR " + j["error"]["message"]); sys.exit()
v = j.get("verify", {})
rms = " / ".join("%.2e" % o["rel_rms"] if o["rel_rms"] is not None else "nan" for o in v.get("outputs", []))
print("%s %s  %s" % (v.get("mode"), rms, j["result"]))
EOF
)
    if [[ $rc -eq 0 && $line == *"PASS"* ]]; then pass=$((pass + 1)); else fail=$((fail + 1)); line="$line (exit $rc)"; fi
    printf '%-110s %s\n' "$c" "$line"
  done
  echo "cases: $pass passed, $fail not"
} 2>&1 | tee "$out/cli_matrix.txt"
grep -q "cases: [0-9]* passed, 0 not" "$out/cli_matrix.txt"
