// Host-side element access by dtype: one element at an element offset from a
// base pointer, converted to/from double. Shared by the cpu backend and the tests.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/bf16.hpp"
#include "core/e4m3.hpp"
#include "dsaib/tensor.hpp"

namespace dsaib::detail {

inline double load_element(DType dtype, const void* base, int64_t offset) {
  const char* p = static_cast<const char*>(base);
  switch (dtype) {
    case DType::bf16: {
      uint16_t h;
      std::memcpy(&h, p + offset * 2, 2);
      return bf16_to_float(h);
    }
    case DType::f32: {
      float f;
      std::memcpy(&f, p + offset * 4, 4);
      return f;
    }
    case DType::i32: {
      int32_t i;
      std::memcpy(&i, p + offset * 4, 4);
      return i;
    }
    case DType::f64: {
      double d;
      std::memcpy(&d, p + offset * 8, 8);
      return d;
    }
    case DType::e4m3: return e4m3_to_double(static_cast<uint8_t>(p[offset]));
  }
  return 0;
}

/// bf16 and f32 round from double to nearest even, once; e4m3 as torch
/// converts (core/e4m3.hpp: through float, saturating at +-448); f64 stores
/// the value unrounded; i32 truncates toward zero.
inline void store_element(DType dtype, void* base, int64_t offset, double value) {
  char* p = static_cast<char*>(base);
  switch (dtype) {
    case DType::bf16: {
      const uint16_t h = double_to_bf16(value);
      std::memcpy(p + offset * 2, &h, 2);
      return;
    }
    case DType::f32: {
      const float f = static_cast<float>(value);
      std::memcpy(p + offset * 4, &f, 4);
      return;
    }
    case DType::i32: {
      const int32_t i = static_cast<int32_t>(value);
      std::memcpy(p + offset * 4, &i, 4);
      return;
    }
    case DType::f64: {
      std::memcpy(p + offset * 8, &value, 8);
      return;
    }
    case DType::e4m3: {
      p[offset] = static_cast<char>(double_to_e4m3(value));
      return;
    }
  }
}

}  // namespace dsaib::detail
