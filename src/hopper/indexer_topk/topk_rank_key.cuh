// The rank key of a (logit, key row) pair: one 64-bit unsigned integer whose
// order is the selection's order (docs/indexer-topk.md, "Order"), so that every
// comparison, radix pass and sort in the top-k kernels is one integer compare
// and the selected set does not depend on the order in which keys arrive.
//
//   high word: the logit's bits mapped so that unsigned order is float order,
//              -0.0 mapped as +0.0, every NaN as 0xffffffff (above +inf)
//   low word:  0xffffffff - key row (a smaller row ranks higher among equal logits)
//
// No real key is 0 (the high word of -inf is 0x007fffff), so 0 pads.
#pragma once

#include <cstdint>
#include <cstring>

namespace dsaib::hopper {

__host__ __device__ __forceinline__ uint32_t logit_order_bits(float logit) {
  if (logit != logit) return 0xffffffffu;
  uint32_t u;
  memcpy(&u, &logit, sizeof(u));
  if (u == 0x80000000u) u = 0u;  // -0.0 ranks as +0.0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// The logit that logit_order_bits maps to `bits` (NaN for 0xffffffff).
__host__ __device__ __forceinline__ float logit_from_order_bits(uint32_t bits) {
  const uint32_t u = bits == 0xffffffffu ? 0x7fc00000u : (bits & 0x80000000u) ? (bits & 0x7fffffffu) : ~bits;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

__host__ __device__ __forceinline__ unsigned long long rank_key(float logit, uint32_t key_row) {
  return (static_cast<unsigned long long>(logit_order_bits(logit)) << 32) | (0xffffffffu - key_row);
}

__host__ __device__ __forceinline__ uint32_t key_row_of_rank_key(unsigned long long key) {
  return 0xffffffffu - static_cast<uint32_t>(key);
}

}  // namespace dsaib::hopper
