// Host-side bfloat16 <-> float conversion (round to nearest even, NaN kept quiet).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dsaib::detail {

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// double -> bf16 rounded once, to nearest even. Not float_to_bf16(float(d)):
/// that rounds twice and is one ulp off when d lies just beyond a bf16 tie that
/// the float rounding lands on. Here d goes to float by round-to-odd (exact when
/// representable, else truncated toward zero with the last bit set), which keeps
/// the 16 bits below bf16's that make the second rounding exact (float has more
/// than bf16's 8 + 2 significand bits at every exponent, subnormals included).
inline uint16_t double_to_bf16(double d) {
  float f = static_cast<float>(d);
  if (!std::isnan(d) && !std::isinf(d) && static_cast<double>(f) != d) {
    if (std::isinf(f) || std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= 1u;
    std::memcpy(&f, &u, 4);
  }
  return float_to_bf16(f);
}

}  // namespace dsaib::detail
