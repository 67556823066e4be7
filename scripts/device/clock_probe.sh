#!/usr/bin/env bash
# One device call: the GPU's SM clock, power draw and clock-event reasons
# (nvidia-smi, sampled every SAMPLE_MS) while each of these runs alone, long
# enough for ~50 samples:
#   op_random65536 / op_random16384 / op_causal16384  the staged op bench (.device/bin)
#   no_reds16384   the no_reds ablation's bench (.device/ablations, if staged), random ids
#   floor          the floor bench: its scatter ways with a large payload, then cuBLAS
# The question: does the fused op (tensor cores and the L2's reds busy together)
# run at a lower SM clock, or under a power cap, than either half alone?
#   device run, carry [".device/bin", ".device/ablations"]: bash scripts/device/clock_probe.sh
# Env: SAMPLE_MS (20), RUNS (names below), ITERS_SCALE (1), SUSTAINED_MS (3000: the
#      sus_<ids>_<S> runs, e.g. sus_random_65536: 10 timed launches, then a sustained run;
#      abl_<name>: the ablation bench ABL_DIR/bench_<name> the same way at random S ABL_SEQ),
#      RUN_DIR (where each run's console and JSON go; default $OUT). Writes $OUT/clock_<name>.csv (raw samples), $OUT/run_<name>.txt
# (each tool's console) and $OUT/clock_probe.txt (the summary).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
out=${OUT:-out}
mkdir -p "$out"
runs_dir=${RUN_DIR:-$out}  # each tool's console and JSON (RUN_DIR: elsewhere, when $OUT must stay small)
mkdir -p "$runs_dir"
ms=${SAMPLE_MS:-20}
# power.draw is a running average (it ramps over ~1 s); power.draw.instant, where the
# driver has it, is the instantaneous reading.
pw=power.draw.instant
nvidia-smi --query-gpu=$pw --format=csv,noheader >/dev/null 2>&1 || pw=power.draw
q="timestamp,clocks.sm,clocks.mem,$pw,temperature.gpu,clocks_event_reasons.active"
nvidia-smi --query-gpu="$q" --format=csv,noheader >/dev/null 2>&1 ||
  q="timestamp,clocks.sm,clocks.mem,$pw,temperature.gpu,clocks_throttle_reasons.active"
echo "sampled: $q"
nvidia-smi --query-gpu=name,driver_version,power.limit,power.max_limit,clocks.max.sm,clocks.max.mem,clocks.applications.graphics \
  --format=csv | tee "$out/clock_probe.txt"
rc=0
probe() {  # name command...
  local name=$1; shift
  nvidia-smi --query-gpu="$q" --format=csv,noheader,nounits -lms "$ms" > "$out/clock_$name.csv" &
  local sampler=$!
  sleep 0.3
  timeout 240 "$@" > "$runs_dir/run_$name.txt" 2>&1 || { echo "$name: rc=$?" | tee -a "$out/clock_probe.txt"; rc=1; }
  grep -E "^(causal|random)|sustained:" "$runs_dir/run_$name.txt" | sed "s/^/$name: /" | tee -a "$out/clock_probe.txt"
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  python3 - "$out/clock_$name.csv" "$name" <<'EOF' | tee -a "$out/clock_probe.txt"
import sys, statistics
path, name = sys.argv[1], sys.argv[2]
rows = []
for line in open(path):
    f = [x.strip() for x in line.split(",")]
    if len(f) < 6: continue
    try: rows.append((float(f[1]), float(f[2]), float(f[3]), float(f[4]), int(f[5], 16)))
    except ValueError: pass
busy = [r for r in rows if r[2] > 150.0]  # watts: samples while a kernel runs (idle H200 ~75-120 W)
def stat(i): v = sorted(r[i] for r in busy); return f"{statistics.median(v):.0f} [{v[0]:.0f}, {v[-1]:.0f}]"
if not busy:
    print(f"{name:16s} no busy samples of {len(rows)}"); sys.exit(0)
reasons = {}
for r in busy: reasons[r[4]] = reasons.get(r[4], 0) + 1
half = busy[len(busy) // 2:]
hv = sorted(r[0] for r in half); hp = sorted(r[2] for r in half)
print(f"{name:16s} second half of the busy samples: SM MHz median {statistics.median(hv):.0f}, W median {statistics.median(hp):.0f}")
print(f"{name:16s} busy samples {len(busy):4d}/{len(rows):4d}  SM MHz {stat(0)}  mem MHz {stat(1)}  "
      f"W {stat(2)}  C {stat(3)}  reasons " + " ".join(f"{k:#x}:{v}" for k, v in sorted(reasons.items())))
EOF
}
bench=.device/bin/dsa-indexer-bwd-bench
# RUNS: which of the runs below (default all); ITERS_SCALE multiplies every run's launches.
runs=${RUNS:-op_random65536 op_random16384 op_causal16384 no_reds16384 floor}
x=${ITERS_SCALE:-1}
for r in $runs; do
  case $r in
    op_random65536) probe $r "$bench" --seq 65536 --ids random --iters $((60 * x)) ;;
    op_causal65536) probe $r "$bench" --seq 65536 --ids causal --iters $((60 * x)) ;;
    op_random16384) probe $r "$bench" --seq 16384 --ids random --iters $((250 * x)) ;;
    op_causal16384) probe $r "$bench" --seq 16384 --ids causal --iters $((250 * x)) ;;
    op_random4096) probe $r "$bench" --seq 4096 --ids random --iters $((1000 * x)) ;;
    no_reds16384) [[ -x .device/ablations/bench_no_reds ]] &&
      probe $r .device/ablations/bench_no_reds --seq 16384 --ids random --iters $((250 * x)) ;;
    no_reds65536) [[ -x .device/ablations/bench_no_reds ]] &&
      probe $r .device/ablations/bench_no_reds --seq 65536 --ids random --iters $((60 * x)) ;;
    sus_*_*)  # sus_<ids>_<S>: the op's timed launches, then SUSTAINED_MS of launches back to back
      ids=${r#sus_}; ids=${ids%_*}; seq=${r##*_}
      if [[ -z $ids || ! $seq =~ ^[0-9]+$ ]]; then echo "bad run name $r (sus_<ids>_<S>)"; rc=2; continue; fi
      probe $r "$bench" --seq "$seq" --ids "$ids" --iters 10 --sustained-ms "${SUSTAINED_MS:-3000}" \
        --json "$runs_dir/$r.json" ;;
    abl_*)  # abl_<ablation>: $ABL_DIR/bench_<ablation> (scripts/build_ablations.py), random S 16384, sustained
      b=${ABL_DIR:-.device/ablations_s19}/bench_${r#abl_}
      if [[ ! -x $b ]]; then echo "$r: $b missing"; rc=2; continue; fi
      probe $r "$b" --seq "${ABL_SEQ:-16384}" --ids random --iters 10 --sustained-ms "${SUSTAINED_MS:-3000}" \
        --json "$runs_dir/$r.json" ;;
    cudnn_sustained)  # the cudnn-frontend peer, issue 4's cases, pre-rolled then sustained
      # (its archive unpacked into PEERS_SITE first; see scripts/device/peers_check.sh)
      probe $r python3 bench/peers/cudnn_frontend_dsa.py --seq "${SEQS:-4096,16384,65536}" --ids causal,random \
        --iters 10 --warmup 2 --sustained-ms "${SUSTAINED_MS:-3000}" --site "${PEERS_SITE:-/tmp/peers-site}" \
        --json "$runs_dir/$r.json" ;;
    floor) probe $r .device/bin/dsa-floor-bench --tables 8 --payload-mib 65536 --iters $((40 * x)) --gemm-size 16384 ;;
    *) echo "unknown run $r"; rc=2 ;;
  esac
done
echo "reasons: bitmask of nvidia-smi clocks_event_reasons (0x1 idle, 0x4 SW power cap, 0x8 HW slowdown," \
  "0x20 SW thermal, 0x40 HW thermal, 0x80 HW power brake); busy = samples above 150 W" | tee -a "$out/clock_probe.txt"
exit $rc
