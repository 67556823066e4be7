// An owning, contiguous host tensor: the container used by the generator,
// the safetensors reader/writer and the CLI.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsaib/tensor.hpp"

namespace dsaib {

struct HostTensor {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // row-major, numel() * dtype_size(dtype) bytes

  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);  // zero-filled

  int64_t numel() const;
  bool empty() const { return shape.empty() && bytes.empty(); }
  template <class T>
  T* data() { return reinterpret_cast<T*>(bytes.data()); }
  template <class T>
  const T* data() const { return reinterpret_cast<const T*>(bytes.data()); }
  /// A contiguous cpu view (absent view if this tensor is empty()).
  TensorView view() const;
};

/// "(2, 5, 8)", "(3,)", "()": a shape as the library's messages write it (the
/// format of TensorView::shape_string, for shapes of any rank).
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace dsaib
