#!/usr/bin/env bash
# Where the L2's throughput goes: ncu's lts__throughput breakdown and the L2
# sectors by operation (reads, reds, writes) for one launch each of the fused
# kernel (random ids, S 4096) and of dsa-floor-bench's reds-only and
# reds-with-key-reads ways (2 MiB table = S_kv 4096 at D 128).
#   device run, carry [".device/bin"]: bash scripts/device/l2_mix_probe.sh
# Output: $OUT/l2_mix.txt (plus the raw ncu logs).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
bin=${BIN:-.device/bin}
sectors=gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sectors_srcunit_tex_op_atom.sum,lts__t_requests_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_red.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum
run() {  # name, kernel regex, command...
  local name=$1 kern=$2; shift 2
  timeout 150 ncu --clock-control none --kernel-name "regex:$kern" --launch-skip 1 --launch-count 1 --metrics "$sectors" \
    "$@" > "$out/ncu_l2mix_${name}.txt" 2>&1
  echo "=== $name ($kern)"
  grep -E "gpu__time|lts__" "$out/ncu_l2mix_${name}.txt"
  timeout 150 ncu --clock-control none --kernel-name "regex:$kern" --launch-skip 1 --launch-count 1 \
    --metrics breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed "$@" > "$out/ncu_l2brk_${name}.txt" 2>&1
  grep -E "lts__|pct" "$out/ncu_l2brk_${name}.txt" | sort -k3 -n -r | head -12
}
{
  run op_random_4096 indexer_backward_kernel "$bin/dsa-indexer-bwd-bench" --seq 4096 --ids random --iters 2 --warmup 1
  run floor_reds ^scatter_float4_kernel "$bin/dsa-floor-bench" --tables 2 --iters 2 --warmup 1 --payload-mib 256 --gemm-size 512
  run floor_reds_with_key_reads ^gather_scatter_float4_kernel "$bin/dsa-floor-bench" --tables 2 --iters 2 --warmup 1 --payload-mib 256 --gemm-size 512
} 2>&1 | tee "$out/l2_mix.txt"
