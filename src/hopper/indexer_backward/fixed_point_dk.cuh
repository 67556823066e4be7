// The deterministic d_index_k (options.deterministic on the cuda backend):
// fixed-point accumulation, so that the order in which CTAs add their
// contributions cannot change the result.
//
// The fp32 reds of the default kernels are not associative, so d_index_k varies
// in its last bits from run to run. Integer addition is associative: with a
// scale 2^E fixed for the launch, the scatter role adds round(v * 2^E) (int64,
// two's complement, red.global.add.u64) for each staged fp32 value v, and the
// finish kernel writes sum * 2^-E. Every rounding then depends on v and E only,
// so the result is bitwise reproducible for given inputs (and device code).
//
// E comes from a bound on the magnitudes, computed on the device before the
// fused kernel (no host synchronisation: CUDA graphs capture it):
//   |gs_i| <= |c| T~_i m_i + |P_i| |G|,  |G| <= |c| S_T,  S_T = sum_valid T~_i m_i
//   sum_i |gs_i| <= |c| S_T (1 + S_P),  S_P = sum_valid |P_i|
//   |dK contribution of slot i, column d| = |sum_h a_ih q_hd|
//       <= |gs_i| |sm_scale| W,  W = sum_h |w_h| max_d |q_hd|
// (docs/math.md, stage 1 and 2), so the row's contributions to every dK element
// together stay below R = 2 |c| |sm_scale| W S_T (1 + S_P); the factor 2 covers
// the bf16 rounding of the a operand (2^-8) and the fp32 GEMM (64 products).
// Every partial sum of every dK element is then at most B = num_q_rows * max R,
// and E = 60 - floor(log2 B) keeps it below 2^61 (no int64 overflow). Max and
// floor(log2) do not depend on the order of the rows, so E is deterministic.
// A row whose R is not finite (NaN or Inf among its valid T, P, q, w, or c)
// makes the finish kernel write NaN to all of d_index_k.
//
// Resolution: 2^-E = B 2^-61. At the DeepSeek shape B is ~2^20 times the
// largest |dK| element, so each term is rounded at ~2^-41 of it: far below the
// fp32 output's own rounding. The cost: 8 bytes of reds per element instead of
// 4, and the bound pass reads Q, w, ids, T and P once more.
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
