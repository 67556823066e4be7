#!/usr/bin/env bash
# Where the L2's throughput goes: ncu's lts__throughput breakdown, the L2
# sectors by operation (reads, reds, writes), the L2 hit rates of reads and
# reds and the DRAM bytes, for one launch each of the fused kernel (random
# ids) and of dsa-floor-bench's reds-only and reds-with-key-reads ways, at
# each S of SEQS (default 4096) with the floor's table of that S's dK size
# (S*128*4 B: 2 MiB at S 4096, 8 at 16384, 32 at 65536; fractional MiB allowed).
#   device run, carry [".device/bin"]: [SEQS="4096 65536"] [BREAKDOWN=0] bash scripts/device/l2_mix_probe.sh
# BREAKDOWN=0 skips the lts__throughput breakdown (a second ncu pass per kernel);
# CACHE_CONTROL=none keeps the L2 warm between ncu passes, in both ncu runs (default all: flushed);
# PAYLOAD_MIB (default 256): bytes added per floor launch.
# Output: $OUT/l2_mix.txt (plus the raw ncu logs).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
bin=${BIN:-.device/bin}
sectors=gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sectors_srcunit_tex_op_atom.sum,lts__t_requests_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_red.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sector_op_read_hit_rate.pct,lts__t_sector_op_red_hit_rate.pct,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum
run() {  # name, kernel regex, command...
  local name=$1 kern=$2; shift 2
  timeout 150 ncu --clock-control none --cache-control "${CACHE_CONTROL:-all}" --kernel-name "regex:$kern" --launch-skip 1 --launch-count 1 --metrics "$sectors" \
    "$@" > "$out/ncu_l2mix_${name}.txt" 2>&1
  echo "=== $name ($kern): ncu exit $?"
  grep -E "gpu__time|lts__|dram__" "$out/ncu_l2mix_${name}.txt"
  [[ ${BREAKDOWN:-1} == 0 ]] && return
  timeout 150 ncu --clock-control none --cache-control "${CACHE_CONTROL:-all}" --kernel-name "regex:$kern" \
    --launch-skip 1 --launch-count 1 --metrics breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed "$@" > "$out/ncu_l2brk_${name}.txt" 2>&1
  grep -E "lts__|pct" "$out/ncu_l2brk_${name}.txt" | sort -k3 -n -r | head -12
}
{
  for seq in ${SEQS:-4096}; do
    mib=$(awk -v s="$seq" 'BEGIN { printf "%.6g", s * 128 * 4 / 1048576 }')  # dK of S keys at D 128, MiB
    run "op_random_$seq" indexer_backward_kernel "$bin/dsa-indexer-bwd-bench" --seq "$seq" --ids random --iters 2 --warmup 1
    run "floor_reds_s$seq" ^scatter_float4_kernel "$bin/dsa-floor-bench" --tables "$mib" --iters 2 --warmup 1 --payload-mib "${PAYLOAD_MIB:-256}" --gemm-size 512
    run "floor_reds_with_key_reads_s$seq" ^gather_scatter_float4_kernel "$bin/dsa-floor-bench" --tables "$mib" --iters 2 --warmup 1 --payload-mib "${PAYLOAD_MIB:-256}" --gemm-size 512
  done
} 2>&1 | tee "$out/l2_mix.txt"
