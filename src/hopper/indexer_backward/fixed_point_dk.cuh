// The deterministic d_index_k: the scatter role adds round(v * 2^E) as int64
// (associative, so the order of the CTAs' reds cannot change the result), and
// the finish kernel writes sum * 2^-E. E comes from a bound B on every partial
// sum that the bound pass computes on the device before the backward kernel
// (no host synchronisation), so that every partial sum stays below 2^61. The
// bound's derivation and the resolution: docs/hopper-kernel.md §10.
#pragma once

#include <cstdint>

#include "hopper/common/kernel_params.hpp"

namespace dsaib::hopper {

/// The scale's exponent E for *bound: 2^E * B < 2^61 with B = num_q_rows * the
/// largest row bound; 0 when B is 0 or not finite (the finish kernel then writes
/// zeros, or NaN for a non-finite bound). Clamped to [-1000, 1000] (fp64's range).
__device__ __forceinline__ int dk_fixed_exponent(const DkFixedBound& bound, int64_t num_q_rows) {
  const double b = __longlong_as_double(static_cast<long long>(bound.max_row_bound_bits)) *
                   static_cast<double>(num_q_rows > 0 ? num_q_rows : 1);
  if (bound.non_finite != 0 || !(b > 0.0) || !isfinite(b)) return 0;
  const int e = 60 - ilogb(b);
  return e < -1000 ? -1000 : (e > 1000 ? 1000 : e);
}

/// round(v * 2^E) as the int64 the scatter role adds (two's complement in a u64).
__device__ __forceinline__ unsigned long long dk_fixed_term(float v, double scale) {
  return static_cast<unsigned long long>(__double2ll_rn(static_cast<double>(v) * scale));
}

}  // namespace dsaib::hopper
