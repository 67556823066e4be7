#!/usr/bin/env bash
# Side-by-side benchmark on the H200 in one device call (issue 4, "peers" and "plot"):
# the floor micro-benchmarks, our op, cudnn-frontend's DSA indexer backward (SM90),
# TileLang's indexer_bwd example and PyTorch eager autograd, all at B1 H64 D128
# topk 2048, S_q = S_kv in SEQS, causal and random ids; then one plot.
#
#   usage (repo root, on the H200): scripts/device/peers_check.sh
#   needs: .device/bin/{dsa-floor-bench,dsa-indexer-bwd-bench} (scripts/device/stage.sh),
#          .peers/*.tar.xz and .peers/tilelang_example (scripts/device/pack_peers.sh) for the
#          two package peers; whatever is missing is reported as unavailable, never fatal.
#   writes into $OUT (default ./out), three files:
#     peers.json         everything: steps (rc, wall time), floor, ours, every peer (or why not)
#     bench_vs_s.png     ns per query row against S, with the floor (scripts/plot_bench.py)
#     peers_check.log    the whole console output
#   env knobs (defaults):
#     SEQS=4096,16384,65536  IDS=causal,random  ITERS=20 (ours)  PEER_ITERS=10  PEER_WARMUP=2
#     SUSTAINED_MS=3000 (ours and cudnn-frontend, after the timed launches: launches back to back
#       for that long, the steady state under the power limit; nineteenth session)
#     TORCH_SEQS=$SEQS  TORCH_ITERS=5  (PyTorch eager: ~0.25 s per backward and ~85 GiB peak
#       memory at S 65536, scaled from the measured 3.8 us/row and 5.3 GiB at S 4096; an
#       out-of-memory case is reported as "oom" and the run goes on; TORCH_SEQS=4096,16384 skips it)
#     CHECK=1 (peers' --check on S 2560 before timing)  BUDGET_S=420 (all steps together;
#     each step's timeout is its cap or what is left, a step with < 20 s left is skipped)
#     PEERS_SITE=/tmp/peers-site (where the archives are unpacked)
#     PEERS="cudnn_frontend tilelang torch_eager" (which peers run; the others are recorded as
#       not selected)  OURS=1 FLOOR=1 (0 skips our bench / the floor bench)
#     BIN=.device/bin (where the two bench binaries are)  PYTHON=python3
#   The cudnn-frontend archive (~60 MiB) does not fit the device tool's 64 MiB carry together
#   with the TileLang one (~29 MiB). All peers in one run (seventeenth session): unpack each
#   archive in a call of its own into an ignored folder that stays on the warm machine,
#     call 1, carry [".peers/cudnn.tar.xz"]:    mkdir -p .peers/site && tar -C .peers/site -xJf .peers/cudnn.tar.xz
#     call 2, carry [".peers/tilelang.tar.xz"]: tar -C .peers/site -xJf .peers/tilelang.tar.xz
#   (the working tree must leave room: move docs/results out of it for call 1), then at once
#     call 3, carry [".device/peersbin", ".peers/tilelang_example"]:
#       rm -f .peers/*.tar.xz; BIN=.device/peersbin PEERS_SITE=$PWD/.peers/site scripts/device/peers_check.sh
#   (the machine is given back after 30 s idle; then the unpacked site is gone). Or run one call
#   per archive and draw both peers.json files with scripts/plot_bench.py --merged a.json --merged b.json.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
log=$out/peers_check.log
: >"$log"
exec > >(tee -a "$log") 2>&1
tee_pid=$!

export SEQS=${SEQS:-4096,16384,65536}
export IDS=${IDS:-causal,random}
export ITERS=${ITERS:-20}
export PEER_ITERS=${PEER_ITERS:-10}
export SUSTAINED_MS=${SUSTAINED_MS:-3000}  # ours and cudnn-frontend: then this long back to back (0: not run)
export PEER_WARMUP=${PEER_WARMUP:-2}
export TORCH_SEQS=${TORCH_SEQS:-$SEQS}
export TORCH_ITERS=${TORCH_ITERS:-5}
export CHECK=${CHECK:-1}
export BUDGET_S=${BUDGET_S:-420}
export PEERS=${PEERS:-cudnn_frontend tilelang torch_eager}
export OURS=${OURS:-1}
export FLOOR=${FLOOR:-1}
site=${PEERS_SITE:-/tmp/peers-site}
bin=${BIN:-.device/bin}
py=${PYTHON:-python3}
work=$(mktemp -d /tmp/peers_check.XXXXXX)
steps=$work/steps.tsv
: >"$steps"
start=$(date +%s)

export PATH=/usr/local/cuda/bin:$PATH
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PYTHONUNBUFFERED=1
export DSAIB_PEERS_SITE=$site
export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}

left() { echo $((BUDGET_S - ($(date +%s) - start))); }

# step NAME CAP_S CMD...: run CMD under a timeout of min(CAP_S, what is left of the budget)
step() {
  local name=$1 cap=$2
  shift 2
  local l t t0 rc
  l=$(left)
  if ((l < 20)); then
    echo "=== $name: SKIPPED (time budget: ${l}s left of ${BUDGET_S}s)"
    printf '%s\t%s\t%s\t%s\n' "$name" skipped 0 0 >>"$steps"
    return
  fi
  t=$((cap < l ? cap : l))
  echo "=== $name (timeout ${t}s, $(($(date +%s) - start))s into the run)"
  t0=$(date +%s)
  timeout -k 10 "$t" "$@"
  rc=$?
  echo "=== $name: rc=$rc after $(($(date +%s) - t0))s$( ((rc == 124 || rc == 137)) && echo ' (TIMED OUT)')"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$t" >>"$steps"
}

echo "peers_check: $(date -u +%FT%TZ) SEQS=$SEQS IDS=$IDS ITERS=$ITERS PEER_ITERS=$PEER_ITERS TORCH_SEQS=$TORCH_SEQS BUDGET_S=$BUDGET_S"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$work/gpu.txt"
"$py" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, torch.version.cuda)' 2>&1

# The peers' packages: unpack whatever archives were carried.
mkdir -p "$site"
shopt -s nullglob
archives=(.peers/*.tar.xz .peers/*/*.tar.xz)
if ((${#archives[@]} == 0)); then
  if [[ -n $(ls -A "$site" 2>/dev/null) ]]; then
    echo "no .peers/*.tar.xz carried: using what an earlier call unpacked into $site ($(ls "$site" | wc -l) entries)"
  else
    echo "no .peers/*.tar.xz carried and $site is empty: cudnn-frontend and TileLang will report themselves unavailable"
  fi
fi
for a in "${archives[@]}"; do
  t0=$(date +%s)
  if tar -C "$site" -xJf "$a"; then
    echo "unpacked $a ($(du -sh "$a" | cut -f1)) into $site in $(($(date +%s) - t0))s"
  else
    echo "FAILED to unpack $a"
  fi
done
[[ -d .peers/tilelang_example ]] || echo "no .peers/tilelang_example carried: TileLang reports itself unavailable"

check_flag=()
[[ $CHECK == 1 ]] && check_flag=(--check)
selected() { [[ " $PEERS " == *" $1 "* ]] || { echo "=== $1: not selected (PEERS=$PEERS)"; printf '%s\t%s\t%s\t%s\n' "$1" unselected 0 0 >>"$steps"; return 1; }; }

if [[ $FLOOR != 1 ]]; then
  echo "=== floor: not run (FLOOR=$FLOOR); the plot uses the fixed 278 ns"
  printf '%s\t%s\t%s\t%s\n' floor unselected 0 0 >>"$steps"
elif [[ -x $bin/dsa-floor-bench ]]; then
  step floor 120 "$bin/dsa-floor-bench" --json "$work/floor.json"
else
  echo "=== floor: $bin/dsa-floor-bench missing (scripts/device/stage.sh); the plot uses the fixed 278 ns"
  printf '%s\t%s\t%s\t%s\n' floor missing 0 0 >>"$steps"
fi
if [[ $OURS != 1 ]]; then
  echo "=== ours: not run (OURS=$OURS)"
  printf '%s\t%s\t%s\t%s\n' ours unselected 0 0 >>"$steps"
elif [[ -x $bin/dsa-indexer-bwd-bench ]]; then
  step ours 180 "$bin/dsa-indexer-bwd-bench" --json "$work/ours.json" --seq "$SEQS" --ids "$IDS" --iters "$ITERS" \
    --sustained-ms "$SUSTAINED_MS"
else
  echo "=== ours: $bin/dsa-indexer-bwd-bench missing (scripts/device/stage.sh)"
  printf '%s\t%s\t%s\t%s\n' ours missing 0 0 >>"$steps"
fi
selected cudnn_frontend &&
  step cudnn_frontend 240 "$py" bench/peers/cudnn_frontend_dsa.py "${check_flag[@]}" --seq "$SEQS" --ids "$IDS" \
    --iters "$PEER_ITERS" --warmup "$PEER_WARMUP" --sustained-ms "$SUSTAINED_MS" --site "$site" \
    --json "$work/cudnn_frontend.json"
selected tilelang &&
  step tilelang 240 "$py" bench/peers/tilelang_indexer_bwd.py "${check_flag[@]}" --seq "$SEQS" --ids "$IDS" \
    --iters "$PEER_ITERS" --warmup "$PEER_WARMUP" --site "$site" --json "$work/tilelang.json"
selected torch_eager &&
  step torch_eager 180 "$py" bench/peers/torch_eager.py "${check_flag[@]}" --seq "$TORCH_SEQS" --ids "$IDS" \
    --iters "$TORCH_ITERS" --warmup 1 --json "$work/torch_eager.json"

echo "=== merge into $out/peers.json"
"$py" - "$work" "$out/peers.json" <<'EOF'
import json, os, subprocess, sys, time
work, dest = sys.argv[1], sys.argv[2]
env = {k: os.environ.get(k) for k in ("SEQS", "IDS", "ITERS", "PEER_ITERS", "PEER_WARMUP", "SUSTAINED_MS", "TORCH_SEQS",
                                      "TORCH_ITERS", "CHECK", "BUDGET_S", "PEERS", "OURS", "FLOOR")}
steps = {}
for line in open(os.path.join(work, "steps.tsv")):
    name, rc, wall, limit = line.rstrip("\n").split("\t")
    steps[name] = {"rc": rc, "wall_s": int(wall), "timeout_s": int(limit)}

def load(name):
    p = os.path.join(work, name + ".json")
    st = steps.get(name, {"rc": "not run"})
    if st["rc"] == "unselected":
        return {"status": "not_selected", "reason": "not selected in this run (PEERS / OURS / FLOOR)"}
    if not os.path.isfile(p):
        why = {"skipped": "skipped: time budget", "missing": "binary missing", "not run": "not run",
               "unselected": "not selected in this run"}.get(
            st["rc"], f"no JSON written (rc {st['rc']}{', timed out' if st['rc'] in ('124', '137') else ''})")
        return {"status": "unavailable", "reason": why}
    try:
        d = json.load(open(p))
    except ValueError as e:
        return {"status": "error", "reason": f"unreadable JSON: {e}"}
    if isinstance(d, dict) and st.get("rc") in ("124", "137") and d.get("status") == "ok":
        d["status"] = "partial"
        d["reason"] = f"timed out after {st['wall_s']} s; the cases it finished are kept"
    return d

try:
    # The device copy's HEAD, "-dirty" when its files differ from it (the device tool's copy can
    # carry a .git older than the working tree it copied: the twenty-third session's run read
    # 01dc172 for a tree at ff0539a).
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
except OSError:
    commit = ""
ours = load("ours")
merged = {
    "schema": "dsaib-peers-check/1",
    "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "git": commit or None,
    "gpu": open(os.path.join(work, "gpu.txt")).read().strip() if os.path.isfile(os.path.join(work, "gpu.txt")) else None,
    "config": env,
    "steps": steps,
    "floor": load("floor"),
    "ours": {"name": "dsaib (dsa-indexer-bwd-bench)", "status": "ok", "results": ours} if isinstance(ours, list) else ours,
    "peers": [],
}
for name, label in (("cudnn_frontend", "cudnn_frontend_dsa_sm90"), ("tilelang", "tilelang_indexer_bwd_example"),
                    ("torch_eager", "torch_eager_autograd")):
    d = load(name)
    d.setdefault("peer", label)
    merged["peers"].append(d)
with open(dest, "w") as f:
    json.dump(merged, f, indent=2)
    f.write("\n")
print("summary (ns per query row, median):")
rows = []
if isinstance(ours, list):
    rows += [("dsaib", r) for r in ours]
for p in merged["peers"]:
    if p.get("status") in ("ok", "partial", "error"):
        rows += [(p["peer"], r) for r in p.get("results", [])]
    print(f"  {p['peer']:30s} status {p.get('status')}" + (f": {p.get('reason')}" if p.get("reason") else ""))
    if isinstance(p.get("check"), dict):
        c = p["check"]
        print(f"  {'':30s} check ok={c.get('ok')} " + "; ".join(
            f"{x.get('ids')}: " + " ".join(f"{n} {x.get(n + '_rel_rms', x.get(n + '_rel_err_peer_bf16', float('nan'))):.2e}"
                                           for n in ("dq", "dw", "dk")) for x in c.get("cases", [])))
for name, r in rows:
    ns = r.get("ns_per_row")
    print(f"  {name:30s} {r.get('ids', ''):7s} S {r.get('seq', ''):>6} "
          + (f"{ns:10.1f}" if isinstance(ns, (int, float)) else f"{r.get('status', '?'):>10s}")
          + (f"   {r.get('reason', '')[:100]}" if r.get("status") not in (None, "ok") else ""))
EOF

echo "=== plot"
timeout 60 "$py" scripts/plot_bench.py --merged "$out/peers.json" --out "$out/bench_vs_s.png" ||
  echo "plot failed (peers.json is complete; run scripts/plot_bench.py --merged peers.json elsewhere)"
echo "peers_check: done in $(($(date +%s) - start))s; files in $out: $(ls "$out" | tr '\n' ' ')"
rm -rf "$work"
exec 1>&- 2>&-
wait "$tee_pid" 2>/dev/null # let tee finish the log before the device tool collects $OUT
exit 0
