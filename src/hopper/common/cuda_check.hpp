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

/// Sets `kernel`'s dynamic shared-memory limit to `smem` bytes and returns its
/// resident CTAs per SM at `threads` threads
/// (cudaOccupancyMaxActiveBlocksPerMultiprocessor), at least one: else
/// Error(cuda_error) naming `name`, as for a failed CUDA call.
template <class Kernel>
int resident_ctas_per_sm(Kernel kernel, int threads, int smem, const char* name) {
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             (std::string("cudaFuncSetAttribute(") + name + ")").c_str());
  int blocks_per_sm = 0;
  cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, smem),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  if (blocks_per_sm < 1) {
    throw Error(ErrorCode::cuda_error, name,
                std::string(name) + ": expected at least one resident CTA per SM, got 0 (shared memory " +
                    std::to_string(smem) + " bytes)");
  }
  return blocks_per_sm;
}

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
