// CUDA return-code checking for the host side of the cuda backend.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "dsaib/error.hpp"

namespace dsaib::hopper {

/// Throws on a failed CUDA call: out_of_memory for cudaErrorMemoryAllocation
/// (e.g. the dK accumulator's cudaMallocAsync), cuda_error for anything else.
inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    const ErrorCode code = status == cudaErrorMemoryAllocation ? ErrorCode::out_of_memory : ErrorCode::cuda_error;
    throw Error(code, what,
                std::string(what) + ": CUDA error " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
  }
}

/// After a launch: the launch's own error (configuration, resources).
inline void cuda_check_launch(const char* kernel) { cuda_check(cudaGetLastError(), kernel); }

/// Restores the caller's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace dsaib::hopper
