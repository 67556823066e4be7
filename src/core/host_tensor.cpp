#include "dsaib/host_tensor.hpp"

namespace dsaib {

HostTensor::HostTensor(DType dt, std::vector<int64_t> shp) : dtype(dt), shape(std::move(shp)) {
  bytes.assign(static_cast<size_t>(numel()) * dtype_size(dtype), 0);
}

int64_t HostTensor::numel() const {
  for (int64_t s : shape) {
    if (s == 0) return 0;  // before any product: other sizes may be huge
  }
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

TensorView HostTensor::view() const {
  if (empty()) return TensorView{};
  return contiguous_view(const_cast<uint8_t*>(bytes.data()), dtype, shape.data(), static_cast<int32_t>(shape.size()));
}

}  // namespace dsaib
