// The L2 evict_last policy of the scatter role's dK reds (TileConfig::kL2KeepDk),
// so that dK lines are evicted less between two reds when dK and K crowd the L2
// (docs/hopper-kernel.md §4). The fraction is a share of the accesses, chosen by
// the hardware, and evict_last a priority, not a pin; after the kernel every
// accumulator line goes back to evict_normal. Inline PTX: neither CCCL's
// cuda::ptx (13.0) nor CuTe wraps createpolicy, red with L2::cache_hint, or
// applypriority.
#pragma once

#include <cstdint>

#include "hopper/common/l2_hints.hpp"

namespace dsaib::hopper {

/// evict_last for 35%, 75% or all of the accesses (`keep_fraction`, an
/// L2KeepFraction: l2_hints.hpp), evict_unchanged for the others. The fraction
/// is an immediate in PTX, hence one instruction per value.
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
