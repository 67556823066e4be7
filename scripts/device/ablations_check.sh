#!/usr/bin/env bash
# Where the time goes: the op (.device/bin/dsa-indexer-bwd-bench) and each
# diagnostic ablation built by scripts/build_ablations.py (.device/ablations/),
# alternated per round so drift hits all alike, at S 4096 and 16384, causal and
# random ids. Carry [".device/bin/dsa-indexer-bwd-bench", ".device/ablations"].
#   ROUNDS=3 ITERS=15 SEQS=4096,16384 bash scripts/device/ablations_check.sh
# EXCLUDE="stages_k6 ..." skips those builds (e.g. candidates timed by a paired A/B instead).
# Writes $OUT/ablations.json (every run) and prints the median per binary and case.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
rounds=${ROUNDS:-3}
bins=(${BIN:-.device/bin/dsa-indexer-bwd-bench} ${ABLATIONS:-.device/ablations}/bench_*)
work=$(mktemp -d)
for ((r = 0; r < rounds; ++r)); do
  for b in "${bins[@]}"; do
    [[ -x $b && $b != *.txt ]] || continue
    name=$(basename "$b"); [[ $name == dsa-indexer-bwd-bench ]] && name=op
    [[ " ${EXCLUDE:-} " == *" ${name#bench_} "* ]] && continue
    timeout 120 "$b" --seq "${SEQS:-4096,16384}" --iters "${ITERS:-15}" --json "$work/${name}_$r.json" >/dev/null 2>&1 \
      || echo "$name round $r: rc=$?"
  done
done
python3 - "$work" "$out/ablations.json" <<'PY'
import glob, json, os, statistics, sys
work, dst = sys.argv[1], sys.argv[2]
runs = {}
for f in sorted(glob.glob(os.path.join(work, "*.json"))):
    name = os.path.basename(f).rsplit("_", 1)[0]
    for r in json.load(open(f)):
        runs.setdefault(name, {}).setdefault(f'{r["ids"]} S{r["seq"]}', []).append(r["ns_per_row"])
json.dump(runs, open(dst, "w"), indent=1)
cases = sorted({c for v in runs.values() for c in v})
print(f'{"binary":24s}' + "".join(f"{c:>18s}" for c in cases))
for name in sorted(runs, key=lambda n: (n != "op", n)):
    print(f"{name:24s}" + "".join(f"{statistics.median(runs[name].get(c, [float('nan')])):18.1f}" for c in cases))
PY
