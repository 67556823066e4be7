// L2 eviction priority of the scatter role's dK reds in the kernels with
// TileConfig::kL2KeepDk (chosen per launch on the host: l2_hints.hpp).
//
// At B1 S_kv 65536 D 128 the fp32 dK accumulator (32 MiB) and the gathered keys
// (16 MiB) nearly fill the H200's 60 MiB L2, and ncu counts ~233 KB of DRAM
// write-back per query row: ~23% of the reds land on dK lines evicted since their
// last red (docs/perf-log.md, twelfth session, call 1). Marking a fixed fraction
// of the dK lines evict_last keeps those lines resident; the rest keep their
// normal priority (evict_unchanged). Measured, paired A/B at S 65536 against no
// hint (perf-log "v32b"): fraction 1.0: random B/A 0.989; 0.25 / 0.35 / 0.5:
// random 0.955 / 0.956 / 0.957, causal 0.995-0.997 (within noise). 1.0 gains least, as
// if only about the persisting set-aside (11.25 MiB in force on the H200 we
// measured, cudaLimitPersistingL2CacheSize) held evict_last lines and the rest
// churned among themselves; 0.35 of 32 MiB is about that size.
//
// Own inline PTX because neither CCCL's cuda::ptx (13.0) nor CuTe wraps
// createpolicy or red.global with an L2::cache_hint.
#pragma once

#include <cstdint>

namespace dsaib::hopper {

/// The createpolicy value of the dK reds: L2 evict_last for 35% of the lines
/// they touch, evict_unchanged for the others.
__device__ __forceinline__ uint64_t l2_policy_dk_reds() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 0.35;" : "=l"(policy));
  return policy;
}

/// red.global.add.v4.f32 with an L2 cache policy: the instruction of
/// atomicAdd(float4*) with its result unused (.relaxed.gpu), plus the hint.
__device__ __forceinline__ void red_add_f32x4(float* dst, const float4& v, uint64_t policy) {
  asm volatile("red.relaxed.gpu.global.add.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;"
               :
               : "l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "l"(policy)
               : "memory");
}

}  // namespace dsaib::hopper
