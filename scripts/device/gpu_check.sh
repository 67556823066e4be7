#!/usr/bin/env bash
# One build-check-time cycle on the H200 (through the device tool), driven by
# binaries built here and carried in .device/bin (see scripts/device/stage.sh).
#   usage: scripts/device/gpu_check.sh [tests|cli|bench|bench-floor|sanitizer|all|ab|ncu|ncu-source|ncu-l2] [gtest filter]
#   ncu-l2       ncu memory tables (L2 hit rate per operation: loads, reductions; L2
#                fabric; DRAM bytes) of one launch per S in SEQS (default "16384 65536"), ids IDS (random)
#   bench        dsa-indexer-bwd-bench: the op alone, ratio to the fixed 278 ns (bench.json)
#   bench-floor  dsa-indexer-bwd bench: the floor micro-benchmarks and the op in one run,
#                issue 4's shapes, ratio to the floor measured per case (bench_floor.json)
# Logs go to $OUT (or ./out when OUT is unset).
set -uo pipefail
what=${1:-all}
filter=${2:-*}
out=${OUT:-out}
mkdir -p "$out"
bin=${BIN:-.device/bin}  # BIN: another staged folder (a candidate: .device/cand/NAME)
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  echo "=== gpu tests"
  timeout 420 "$bin/test_gpu_hopper" --gtest_filter="$filter" 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[(numerics|determinism)|OK|FAILED|PASSED|SKIPPED|Failure|Expected|Which is|error|rel_rms" | head -150
  rc=${PIPESTATUS[0]}
  echo "gpu tests rc=$rc"
  # The installed-package consumer (tests/install_consumer/, staged by stage.sh):
  # the cuda backend through find_package(dsaib) in a foreign executable. It must
  # run the cuda part here, not skip it.
  if [[ -x $bin/consumer_cxx ]]; then
    echo "=== installed-package consumer"
    timeout 60 "$bin/consumer_cxx" > "$out/consumer.log" 2>&1
    crc=$?
    cat "$out/consumer.log"
    if [[ $crc -eq 0 ]] && ! grep -q "PASS (cpu and cuda backends)" "$out/consumer.log"; then crc=1; fi
    echo "consumer rc=$crc"
    rc=$((rc | crc))
  fi
fi
if [[ $what == cli || $what == all ]]; then
  echo "=== cli (cuda backend)"
  cli=$bin/dsa-indexer-bwd
  timeout 200 "$cli" backward --preset deepseek-v32 --backend cuda --verify sample --repeat 10 2>&1 | tee "$out/cli_deepseek.log" | tail -14
  rc=$((rc | PIPESTATUS[0]))
  "$cli" generate --preset race-report-2 --out /tmp/race2.safetensors >/dev/null 2>&1
  timeout 120 "$cli" backward --in /tmp/race2.safetensors --backend cuda --verify all --out /tmp/race2_grads.safetensors 2>&1 | tee "$out/cli_file.log" | tail -12
  rc=$((rc | PIPESTATUS[0]))
fi
if [[ $what == sanitizer || $what == all ]]; then
  echo "=== sanitizer"
  timeout 500 bash tests/sanitizer/run_sanitizer.sh "$bin" "$out" 2>&1 | tail -40
  rc=$((rc | PIPESTATUS[0]))
fi
if [[ $what == bench || $what == all ]]; then
  echo "=== bench"
  timeout 300 "$bin/dsa-indexer-bwd-bench" --json "$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -30
  rc=$((rc | PIPESTATUS[0]))
fi
if [[ $what == bench-floor ]]; then
  echo "=== bench with the floor measured in the same run (dsa-indexer-bwd bench)"
  timeout 500 "$bin/dsa-indexer-bwd" bench --json "$out/bench_floor.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_floor.log" | grep -v "^\[" | tail -30
  rc=$((rc | PIPESTATUS[0]))
fi
if [[ $what == ab ]]; then
  # Paired A/B of every variant bench in .device/bin/ab/ against the baseline
  # named there "bench_A": alternating processes (scripts/ab_compare.py).
  echo "=== paired A/B (baseline: ab/bench_A)"
  for b in .device/bin/ab/bench_*; do
    [[ $b == */bench_A ]] && continue
    # A variant staged with its CLI (ab/cli_X, stage.sh AB_CLIS) is first checked
    # against the fp64 reference at the DeepSeek shape; a failing variant is not timed.
    cli=.device/bin/ab/cli_${b##*/bench_}
    if [[ -x $cli ]]; then
      echo "--- verify $(basename "$cli")"
      if ! timeout 200 "$cli" backward --preset deepseek-v32 --backend cuda --verify sample 2>&1 | tail -6; then
        echo "$(basename "$cli"): verification FAILED, variant not timed"
        rc=1
        continue
      fi
    fi
    echo "--- A = bench_A, B = $(basename "$b")"
    timeout 240 python3 scripts/ab_compare.py .device/bin/ab/bench_A "$b" --pairs ${AB_PAIRS:-6} \
      --args "${AB_ARGS:---seq 4096 --iters 15}" --out "$out/ab_$(basename "$b").json"
    rc=$((rc | $?))
  done
fi
if [[ $what == ncu ]]; then
  echo "=== ncu (--clock-control none) of the fused kernel, random ids S 4096"
  timeout 300 ncu --clock-control none --kernel-name regex:indexer_backward_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section SourceCounters \
    "$bin/dsa-indexer-bwd-bench" --seq 4096 --ids random --iters 1 > "$out/ncu.txt" 2>&1
  rc=$((rc | $?))
  grep -E "Duration|Throughput|Pipe|Stall|stall|Issue Slot|Warp Cycles|L2 Hit|Mem Busy|Max Bandwidth|Registers|Executed Ipc" "$out/ncu.txt" | head -60
  # Tensor-core work counted by the hardware (bf16 in, fp32 accumulate): ops / duration
  # = achieved tensor rate, to set against the cuBLAS rate of the floor bench. A separate
  # run, allowed to fail (metric names differ between ncu versions): never the verdict.
  timeout 120 ncu --clock-control none --kernel-name regex:indexer_backward_kernel --launch-skip 2 --launch-count 1 \
    --metrics sm__ops_path_tensor_src_bf16_dst_fp32.sum,gpu__time_duration.sum \
    "$bin/dsa-indexer-bwd-bench" --seq 4096 --ids random --iters 1 > "$out/ncu_tensor.txt" 2>&1 \
    && grep -E "sm__ops_path_tensor|gpu__time_duration" "$out/ncu_tensor.txt" || echo "ncu tensor-op metric: not available (see ncu_tensor.txt)"
  # Stall reasons (the numbers behind WarpStateStats' chart): warps stalled per
  # issued instruction, by reason, largest first. Also a separate run, allowed to fail.
  timeout 120 ncu --clock-control none --kernel-name regex:indexer_backward_kernel --launch-skip 2 --launch-count 1 \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    "$bin/dsa-indexer-bwd-bench" --seq 4096 --ids random --iters 1 > "$out/ncu_stalls.txt" 2>&1 \
    && python3 scripts/ncu_stall_reasons.py "$out/ncu_stalls.txt" | tee "$out/ncu_stall_reasons.txt" \
    || echo "ncu stall-reason metrics: not available (see ncu_stalls.txt)"
fi
if [[ $what == ncu-source ]]; then
  # Per-SASS-instruction warp-stall samples of the fused kernel (random ids, S 4096):
  # which instructions of which role the warps wait on. ncu_source.csv: the source
  # page (SASS) exported from the report; ncu_source_top.txt: the 60 instructions
  # with the most stall samples.
  echo "=== ncu source counters (--clock-control none), random ids S 4096"
  rep=/tmp/dsaib_source
  timeout 300 ncu --clock-control none --kernel-name regex:indexer_backward_kernel --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
    --import-source yes -f -o "$rep" "$bin/dsa-indexer-bwd-bench" --seq 4096 --ids random --iters 1 > "$out/ncu_source.log" 2>&1
  rc=$((rc | $?))
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$out/ncu_source.csv" 2>>"$out/ncu_source.log"
  rc=$((rc | $?))
  ncu --import "$rep.ncu-rep" --page details > "$out/ncu_details.txt" 2>>"$out/ncu_source.log"
  python3 scripts/ncu_top_stalls.py "$out/ncu_source.csv" 60 > "$out/ncu_source_top.txt" 2>&1 || true
  head -80 "$out/ncu_source_top.txt"
fi
if [[ $what == ncu-l2 ]]; then
  # Where the dK reds and the K gathers are served as dK outgrows the L2: the
  # memory-workload tables of one launch per sequence length.
  for seq in ${SEQS:-16384 65536}; do
    echo "=== ncu memory tables (--clock-control none), ${IDS:-random} ids S $seq"
    timeout 300 ncu --clock-control none --kernel-name regex:indexer_backward_kernel --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__xbar2lts_cycles_active.avg.pct_of_peak_sustained_elapsed \
      "$bin/dsa-indexer-bwd-bench" --seq "$seq" --ids "${IDS:-random}" --iters 1 --warmup 1 > "$out/ncu_l2_s$seq.txt" 2>&1
    rc=$((rc | $?))
    grep -E "Duration|L2 Hit|Hit Rate|dram__bytes|lts__|Fabric|Reduction|Global Load|Mem Busy|Max Bandwidth|DRAM Throughput|L2 Cache Throughput" "$out/ncu_l2_s$seq.txt" | head -40
  done
fi
exit $rc
