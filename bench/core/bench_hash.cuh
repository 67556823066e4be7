// dsaib_bench: the hashes and values the floor kernels and their host checks share.
#pragma once

#include <cstdint>

namespace dsaib::bench {

__host__ __device__ inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Row of row-add i: a hash mapped onto [0, rows) by a multiply-high.
__device__ __forceinline__ uint32_t row_of(uint32_t i, uint32_t seed, uint32_t rows) {
  return static_cast<uint32_t>((static_cast<uint64_t>(mix32(i ^ seed)) * rows) >> 32);
}

// Random non-zero bf16: magnitude in [0.25, 1), random sign; reproducible on the host.
__host__ __device__ inline float gemm_value(uint64_t i, uint32_t salt) {
  const uint32_t u = mix32(static_cast<uint32_t>(i) ^ mix32(static_cast<uint32_t>(i >> 32) + salt));
  const float mag = 0.25f + 0.75f * static_cast<float>(u >> 8) * (1.0f / 16777216.0f);
  return (u & 1u) ? -mag : mag;
}

}  // namespace dsaib::bench
