// The sum over a warp's 16 heads of each key column of a GEMM1 tile, in a fixed
// order (the P-free score role's logits).
#pragma once

#include <cute/config.hpp>

namespace dsaib::hopper {

/// `col`: this thread's partial sums of its 16 key columns. A butterfly over the
/// lanes with the same lane % 4 (xor 16, 8, 4), each step keeping half the
/// columns: lane ends with the sums of keys 2 * lane and 2 * lane + 1.
__device__ __forceinline__ float2 warp_head_sums(const float (&col)[16], int lane) {
  float c8[8], c4[4], c2[2];
  const bool b4 = (lane & 16) != 0, b3 = (lane & 8) != 0, b2 = (lane & 4) != 0;
  CUTE_UNROLL
  for (int k = 0; k < 8; ++k) {
    const float send = b4 ? col[k] : col[k + 8];
    c8[k] = (b4 ? col[k + 8] : col[k]) + __shfl_xor_sync(0xffffffffu, send, 16);
  }
  CUTE_UNROLL
  for (int k = 0; k < 4; ++k) {
    const float send = b3 ? c8[k] : c8[k + 4];
    c4[k] = (b3 ? c8[k + 4] : c8[k]) + __shfl_xor_sync(0xffffffffu, send, 8);
  }
  CUTE_UNROLL
  for (int k = 0; k < 2; ++k) {
    const float send = b2 ? c4[k] : c4[k + 2];
    c2[k] = (b2 ? c4[k + 2] : c4[k]) + __shfl_xor_sync(0xffffffffu, send, 4);
  }
  return make_float2(c2[0], c2[1]);
}

}  // namespace dsaib::hopper
