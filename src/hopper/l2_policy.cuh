// L2 eviction priorities of the kernel's global traffic (v20; paired A/B in
// docs/perf-log.md: random ids -2.1% at S 65536, causal within noise).
//
// The dK accumulator (fp32, S_kv x D) and the gathered keys (bf16, S_kv x D)
// are re-touched throughout the launch; topk_indices, attn_score and
// index_score are streamed (read by stage 1's two passes of every task of the
// row: once per row at H <= 64, once per head group above). At S_kv = 65536
// and D = 128, dK and K take 48 of the 60 MiB L2 the H200 reports (24 MiB at D = 64),
// so the streams evict them. Here the reds and the gathers carry an
// L2::evict_last policy and the second pass reads the streams with ld.global.cs
// (evict-first; at H > 64 a sibling head group's task may still want them,
// which costs a re-read, not correctness).
//
// Own inline PTX because neither CCCL's cuda::ptx (13.0) nor CuTe wraps createpolicy,
// red.global with an L2::cache_hint, or a non-bulk cp.async with one.
#pragma once

#include <cstdint>

namespace dsaib::hopper {

/// A createpolicy value: L2 evict_last for the whole access. Not volatile: it has no
/// side effect, so the compiler may hoist or merge repeated calls.
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

/// red.global.add.v4.f32 with an L2 cache policy: atomicAdd(float4*)'s atom.global.add.v4.f32
/// (.relaxed.gpu by default; ptxas makes it a red when the result is unused) plus the hint.
__device__ __forceinline__ void red_add_f32x4(float* dst, const float4& v, uint64_t policy) {
  asm volatile("red.relaxed.gpu.global.add.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;"
               :
               : "l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "l"(policy)
               : "memory");
}

/// cp.async.cg of 16 bytes (zero-filled when !pred) with an L2 cache policy and the
/// 128-byte L2 prefetch of cute's SM80_CP_ASYNC_CACHEGLOBAL_ZFILL.
__device__ __forceinline__ void cp_async_16_zfill(const void* src, void* dst_smem, bool pred, uint64_t policy) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(dst_smem));
  const int src_size = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;"
               :
               : "r"(dst), "l"(src), "r"(src_size), "l"(policy)
               : "memory");
}

}  // namespace dsaib::hopper
