#!/usr/bin/env bash
# scripts/ab_compare.py against two fake benches that write the bench's JSON: the
# paired deltas of each metric (timed ns_per_row, sustained ns_per_row_sustained,
# both), and its refusals (the sustained metric without a positive --sustained-ms,
# a JSON without the metric).
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
expect "no sustained key" "no positive 'ns_per_row_sustained'" 1 \
  "$py" "$ab" "$dir/c" "$dir/b" --pairs 1 --metric ns_per_row_sustained --args "--sustained-ms 5"
expect "pairs 0" "--pairs: expected >= 1" 2 "$py" "$ab" "$dir/a" "$dir/b" --pairs 0
[[ $fail -eq 0 ]] && echo "ab_compare: timed, sustained and both metrics; refusals as expected"
exit $fail
