// Host-side float8 e4m3 ("fn": 4 exponent bits of bias 7, 3 mantissa bits, no
// infinities, NaN at S.1111.111, largest finite 448) <-> double, as torch's
// float8_e4m3fn converts (torch 2.15; older releases turned a magnitude beyond
// 464 into NaN): a double is rounded to float first (torch converts a float64
// tensor through float), then to nearest even; a magnitude beyond 448, +-inf
// included, saturates to +-448; NaN stays NaN, its sign kept.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace dsaib::detail {

inline double e4m3_to_double(uint8_t bits) {
  const int exponent = (bits >> 3) & 15, mantissa = bits & 7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(8 + mantissa, exponent - 10);
  return (bits & 0x80) ? -magnitude : magnitude;
}

inline uint8_t double_to_e4m3(double x) {
  const float f = static_cast<float>(x);  // the first rounding, as torch's
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 464.0) return sign | 0x7e;  // 464, the tie between 448 and the NaN code, goes to the even 448 too
  if (a < 0.015625) {  // below the smallest normal 2^-6: subnormal steps of 2^-9 (a count of 8 is 2^-6 itself)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0));
  }
  int e2 = 0;
  (void)std::frexp(a, &e2);  // a = f 2^e2, f in [0.5, 1): a = 1.m 2^(e2 - 1)
  int exponent = e2 - 1;
  int q = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - exponent)));  // 8 + mantissa, in [8, 16]
  if (q == 16) {
    q = 8;
    ++exponent;
  }
  return sign | static_cast<uint8_t>(((exponent + 7) << 3) | (q - 8));
}

}  // namespace dsaib::detail
