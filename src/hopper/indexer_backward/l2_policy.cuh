// L2 eviction priority of the scatter role's dK reds in the kernels with
// TileConfig::kL2KeepDk (chosen per launch on the host: l2_hints.hpp).
//
// At B1 S_kv 65536 D 128 the fp32 dK accumulator (32 MiB) and the gathered keys
// (16 MiB) nearly fill the H200's 60 MiB L2, and ncu counts ~233 KB of DRAM
// write-back per query row: ~23% of the reds land on dK lines evicted since their
// last red.
//
// The reds carry a createpolicy.fractional.L2::evict_last policy with fraction
// 0.35, 0.75 or 1.0 (l2_keep_fraction in l2_hints.hpp: from the context's L2
// set-aside for persisting lines; 0.35 at the H200's default): the PTX ISA applies the primary priority (evict_last) to that fraction of
// the cache accesses made with the policy and the secondary one (here the default,
// evict_unchanged) to the rest; which accesses is the hardware's choice (the CUDA
// guide says of hitRatio: random, with a distribution that depends on the
// architecture and the memory extent). So it is a share of the dK traffic, not a
// chosen set of lines, and evict_last is a priority, not a pin. After the kernel,
// reset_l2_priority_to_normal (backend.cu) applies evict_normal to every line of
// the accumulator, so that no evict_last line outlives the call.
//
// Measured on the H200, paired A/B at S 65536 against no hint: fraction
// 1.0: random B/A 0.989; 0.25 / 0.35 / 0.5: random 0.955 / 0.956 / 0.957, causal
// 0.995-0.997 (within noise). A hypothesis for why 1.0 gains least, not
// measured: only about the persisting set-aside (11.25 MiB in force on the H200
// we measured, cudaLimitPersistingL2CacheSize) holds evict_last lines, and with
// every red evict_last they churn among themselves. With the set-aside at its
// cap (37.5 MiB), 0.35 took +38% at random ids and 1.0 took -1.6% against 0.35
// at the default: hence the fraction follows the set-aside.
//
// Own inline PTX because neither CCCL's cuda::ptx (13.0) nor CuTe wraps
// createpolicy, red.global with an L2::cache_hint, or applypriority.
#pragma once

#include <cstdint>

#include "hopper/common/l2_hints.hpp"

namespace dsaib::hopper {

/// The createpolicy value of the dK reds: L2 evict_last for 35%, 75% or all of
/// the accesses made with it (`keep_fraction`, an L2KeepFraction chosen on the
/// host from the set-aside in force, l2_hints.hpp), evict_unchanged for the
/// others. The fraction is an immediate in PTX, hence one instruction per value.
__device__ __forceinline__ uint64_t l2_policy_dk_reds(int32_t keep_fraction) {
  uint64_t policy;
  if (keep_fraction == static_cast<int32_t>(L2KeepFraction::f100)) {
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  } else if (keep_fraction == static_cast<int32_t>(L2KeepFraction::f075)) {
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 0.75;" : "=l"(policy));
  } else {
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 0.35;" : "=l"(policy));
  }
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

/// applypriority.global.L2::evict_normal on the 128-byte L2 line at `line`
/// (128-byte aligned): an evict_last line becomes a normal one; no effect on
/// data, and none when the line is not in L2.
__device__ __forceinline__ void l2_priority_to_normal(const void* line) {
  asm volatile("applypriority.global.L2::evict_normal [%0], 128;" : : "l"(line) : "memory");
}

}  // namespace dsaib::hopper
