// GPU test helpers: device copies of a generated problem and of outputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "support/test_support.hpp"

namespace dsaib::test {

/// True when a compute-capability-9.0 device is visible (GPU tests skip otherwise).
bool gpu_available();

/// Throws std::runtime_error naming `what` on a CUDA error.
void check_cuda(cudaError_t status, const char* what);

/// A device buffer (cudaMalloc'd, freed on destruction).
struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n);
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), bytes(o.bytes) { o.ptr = nullptr; o.bytes = 0; }
  ~DeviceBuffer();
  std::vector<unsigned char> to_host() const;
};

/// A device tensor holding a host tensor's bytes, with a cuda view of them.
struct DeviceTensor {
  DeviceBuffer buffer;
  TensorView view;  // absent if the host tensor is empty
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& host);
  DeviceTensor(DType dtype, const std::vector<int64_t>& shape);
  /// Copies the device bytes into a host tensor of the same dtype and shape.
  HostTensor to_host() const;
  void fill_bytes(unsigned char byte);
  void fill(double value);  // converted to the dtype
};

struct DeviceProblem {
  DeviceTensor index_q, weights, index_k, topk_indices, attn_score, index_score, cu_seqlens_q, cu_seqlens_k;
  explicit DeviceProblem(const GeneratedProblem& p);
  IndexerInputs inputs() const;
};

struct DeviceOutputs {
  DeviceTensor d_index_q, d_weights, d_index_k;
  DeviceOutputs(const GeneratedProblem& p, DType dq, DType dw, DType dk);
  IndexerBackwardOutputs views() const;
  void poison();  // NaN everywhere
};

/// Runs the cuda backend on `p` (synchronously), returns host copies of the outputs.
OutputBuffers run_cuda(const GeneratedProblem& p, const IndexerOptions& options, DType dq, DType dw, DType dk);

/// FNV-1a hash of a tensor's bytes.
uint64_t hash_bytes(const HostTensor& t);

}  // namespace dsaib::test
