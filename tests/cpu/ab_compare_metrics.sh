#!/usr/bin/env bash
# scripts/ab_compare.py against fake benches that write the bench's JSON (a list of
# cases, or dsaib-bench's report with its "cases" and a case's "sustained" object):
# the paired deltas of each metric (timed ns_per_row, sustained ns_per_row_sustained,
# both), the op in a case's name, and its refusals (the sustained metric without a
# positive --sustained-ms, a JSON without the metric).
set -uo pipefail
ab=${1:?usage: ab_compare_metrics.sh path/to/ab_compare.py [python3]}
py=${2:-python3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fake() {  # name timed sustained(or "none")
  if [[ $3 == none ]]; then sus=""; else sus=", \"ns_per_row_sustained\": $3"; fi
  cat > "$dir/$1" <<EOS
#!/bin/sh
cat > "\$2" <<J
[{"ids": "random", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": $2$sus}]
J
EOS
  chmod +x "$dir/$1"
}
fake a 100 110
fake b 102 105
fake c 100 none
raw() {  # name json-text [exit-status]: a fake bench writing that text
  printf '#!/bin/sh\ncat > "$2" <<'"'"'J'"'"'\n%s\nJ\nexit %s\n' "$2" "${3:-0}" > "$dir/$1"
  chmod +x "$dir/$1"
}
raw notjson '{"ids": '
raw infinite '[{"ids": "random", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": Infinity}]'
raw boolean '[{"ids": "random", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": true}]'
raw nokey '[{"ids": "random", "seq": 16, "dim": 128, "topk": 4, "ns_per_row": 100}]'
raw other '[{"ids": "causal", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": 100}]'
raw twice '[{"ids": "random", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": 100}, {"ids": "random", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": 101}]'
raw crashes '[]' 3
fail=0
expect() {  # what output-substring rc-wanted command...
  local what=$1 sub=$2 want=$3; shift 3
  out=$("$@" 2>&1); rc=$?
  if [[ $rc -ne $want || $out != *"$sub"* ]]; then
    echo "FAIL: $what: rc=$rc (wanted $want), output:"; echo "$out"; fail=1
  fi
}
expect "timed" "random S16 H64 D128 k4                 100.0     102.0       2.0" 0 \
  "$py" "$ab" "$dir/a" "$dir/b" --pairs 2
expect "sustained" "110.0     105.0      -5.0" 0 \
  "$py" "$ab" "$dir/a" "$dir/b" --pairs 2 --metric ns_per_row_sustained --args "--sustained-ms 5"
expect "both: timed table" "metric: ns_per_row
" 0 "$py" "$ab" "$dir/a" "$dir/b" --pairs 2 --metric both --args "--sustained-ms 5"
expect "both: sustained table" "metric: ns_per_row_sustained" 0 \
  "$py" "$ab" "$dir/a" "$dir/b" --pairs 2 --metric both --args "--sustained-ms 5"
expect "sustained without the flag" "needs --sustained-ms with a positive value" 2 \
  "$py" "$ab" "$dir/a" "$dir/b" --metric ns_per_row_sustained
expect "sustained with 0 ms" "needs --sustained-ms with a positive value" 2 \
  "$py" "$ab" "$dir/a" "$dir/b" --metric ns_per_row_sustained --args "--sustained-ms 0"
expect "no sustained key" "no finite positive 'ns_per_row_sustained'" 1 \
  "$py" "$ab" "$dir/c" "$dir/b" --pairs 1 --metric ns_per_row_sustained --args "--sustained-ms 5"
expect "pairs 0" "--pairs: expected >= 1" 2 "$py" "$ab" "$dir/a" "$dir/b" --pairs 0
# Runs and JSON that are not the bench's: a message naming the binary, no traceback.
expect "not JSON" "notjson: its --json file is not valid JSON" 1 "$py" "$ab" "$dir/notjson" "$dir/b" --pairs 1
expect "Infinity" "no finite positive 'ns_per_row'" 1 "$py" "$ab" "$dir/a" "$dir/infinite" --pairs 1
expect "true" "no finite positive 'ns_per_row'" 1 "$py" "$ab" "$dir/a" "$dir/boolean" --pairs 1
expect "missing key" "a case without 'heads'" 1 "$py" "$ab" "$dir/nokey" "$dir/b" --pairs 1
expect "other cases" "A and B ran different cases" 1 "$py" "$ab" "$dir/a" "$dir/other" --pairs 1
expect "case twice" "twice in its JSON" 1 "$py" "$ab" "$dir/twice" "$dir/b" --pairs 1
expect "exit status" "crashes: exited with status 3" 1 "$py" "$ab" "$dir/a" "$dir/crashes" --pairs 1
expect "missing binary" "cannot run it" 1 "$py" "$ab" "$dir/a" "$dir/nonexistent" --pairs 1
# dsaib-bench's report: the cases under "cases", the sustained time in each case's
# "sustained" object, the op named unless it is the backward.
raw report_a '{"tool": "dsaib-bench", "cases": [{"op": "forward", "ids": "random", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": 100, "sustained": {"ns_per_row": 110}}, {"op": "backward", "ids": "random", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": 300, "sustained": {"ns_per_row": 310}}]}'
raw report_b '{"tool": "dsaib-bench", "cases": [{"op": "forward", "ids": "random", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": 104, "sustained": {"ns_per_row": 105}}, {"op": "backward", "ids": "random", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": 297, "sustained": {"ns_per_row": 311}}]}'
expect "report: forward named" "forward random S16 H64 D128 k4         100.0     104.0       4.0" 0 \
  "$py" "$ab" "$dir/report_a" "$dir/report_b" --pairs 2
expect "report: backward unnamed" "
random S16 H64 D128 k4                 300.0     297.0      -3.0" 0 "$py" "$ab" "$dir/report_a" "$dir/report_b" --pairs 2
expect "report: sustained object" "forward random S16 H64 D128 k4         110.0     105.0      -5.0" 0 \
  "$py" "$ab" "$dir/report_a" "$dir/report_b" --pairs 2 --metric ns_per_row_sustained --args "--sustained-ms 5"
# The top-k's cases name their key ranges, not ids (their JSON has no "ids").
raw topk_a '{"tool": "dsaib-bench", "cases": [{"op": "topk", "ranges": "cp-shard", "seq": 16, "heads": 32, "dim": 128, "topk": 4, "ns_per_row": 200}]}'
raw topk_b '{"tool": "dsaib-bench", "cases": [{"op": "topk", "ranges": "cp-shard", "seq": 16, "heads": 32, "dim": 128, "topk": 4, "ns_per_row": 190}]}'
expect "report: topk by its ranges" "topk cp-shard S16 H32 D128 k4          200.0     190.0     -10.0" 0 \
  "$py" "$ab" "$dir/topk_a" "$dir/topk_b" --pairs 2
# A target case without an lse is its own case beside the one with an lse.
raw lse_a '{"tool": "dsaib-bench", "cases": [{"op": "target", "ids": "random", "seq": 16, "heads": 64, "dim": 192, "topk": 4, "lse": "given", "ns_per_row": 300}, {"op": "target", "ids": "random", "seq": 16, "heads": 64, "dim": 192, "topk": 4, "lse": "absent", "ns_per_row": 600}]}'
raw lse_b '{"tool": "dsaib-bench", "cases": [{"op": "target", "ids": "random", "seq": 16, "heads": 64, "dim": 192, "topk": 4, "lse": "given", "ns_per_row": 310}, {"op": "target", "ids": "random", "seq": 16, "heads": 64, "dim": 192, "topk": 4, "lse": "absent", "ns_per_row": 580}]}'
expect "report: target without an lse" "target random no-lse S16 H64 D192 k4     600.0     580.0     -20.0" 0 \
  "$py" "$ab" "$dir/lse_a" "$dir/lse_b" --pairs 2
raw report_empty '{"tool": "dsaib-bench", "cases": []}'
expect "report without cases" "expected its JSON to hold a non-empty list of cases" 1 \
  "$py" "$ab" "$dir/report_empty" "$dir/report_b" --pairs 1
# One pair: no interval, and the --out file is standard JSON (null, not NaN).
expect "one pair" "[     nan,      nan]" 0 "$py" "$ab" "$dir/a" "$dir/b" --pairs 1 --out "$dir/one.json"
if ! "$py" -c 'import json,sys; r=json.load(open(sys.argv[1]), parse_constant=lambda c: sys.exit("NaN in --out")); assert r[0]["ci95"] is None' "$dir/one.json"; then
  echo "FAIL: one pair: --out is not standard JSON with ci95 null"; fail=1
fi
# The interval: A 100 throughout, B 101, 102, 103, 106 in the four pairs: deltas
# 1, 2, 3, 6, mean 3, sd 2.1602, t(3) 3.182: 3 +- 3.437 = [-0.437, 6.437].
echo 0 > "$dir/count"
cat > "$dir/steps" <<EOS
#!/bin/sh
n=\$(cat "$dir/count"); echo \$((n + 1)) > "$dir/count"
case \$n in 0) v=101;; 1) v=102;; 2) v=103;; *) v=106;; esac
printf '[{"ids": "random", "seq": 16, "heads": 64, "dim": 128, "topk": 4, "ns_per_row": %s}]' \$v > "\$2"
EOS
chmod +x "$dir/steps"
fake constant 100 none
expect "interval" "100.0     102.5       3.0 [    -0.4,      6.4]" 0 \
  "$py" "$ab" "$dir/constant" "$dir/steps" --pairs 4
# Beyond df 30 the quantile follows df (it was held at df 30's 2.042).
if ! (cd "$(dirname "$ab")" && "$py" -c 'import ab_compare as a; assert abs(a.t95(39) - 2.0227) < 2e-4 and abs(a.t95(100) - 1.9840) < 2e-4 and a.t95(30) == 2.042'); then
  echo "FAIL: t95 beyond df 30"; fail=1
fi
[[ $fail -eq 0 ]] && echo "ab_compare: timed, sustained and both metrics; refusals as expected"
exit $fail
