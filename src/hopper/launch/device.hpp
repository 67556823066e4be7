// The cuda side of the launch layer: the device's properties, queried once per
// call, and the one place a call's workspace is taken from the caller or
// allocated on the stream.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "hopper/launch/launch_plan.hpp"

namespace dsaib::hopper {

/// SMs, L2 bytes and the persisting L2 set-aside of the current device, for the
/// plans of one call (ctas_per_sm 1: with_ctas_per_sm sets a kernel's). The
/// set-aside is read per call: the application may change it between calls (a
/// CUDA graph keeps the choice made at capture); it only tunes a cache hint, so
/// a failed query of it counts as none.
DeviceProperties query_device_properties();

inline DeviceProperties with_ctas_per_sm(DeviceProperties device, int ctas_per_sm) {
  device.ctas_per_sm = ctas_per_sm;
  return device;
}

/// A call's workspace of `bytes`: the caller's when it holds them (the entry
/// points checked its size and alignment), else stream-ordered memory of its
/// own, freed on the stream by release() after the call's launches (or, when an
/// error left release() unreached, by the destructor). Nothing for 0 bytes.
class CallWorkspace {
 public:
  CallWorkspace(void* caller, std::size_t caller_bytes, std::size_t bytes, cudaStream_t stream, const char* what);
  CallWorkspace(const CallWorkspace&) = delete;
  CallWorkspace& operator=(const CallWorkspace&) = delete;
  ~CallWorkspace();

  char* data() const { return base_; }
  template <class T>
  T* at(std::size_t offset) const {
    return reinterpret_cast<T*>(base_ + offset);
  }
  /// Frees owned memory on the stream (checked).
  void release();

 private:
  char* base_ = nullptr;
  bool owned_ = false;
  cudaStream_t stream_ = nullptr;
  const char* what_ = "";
};

}  // namespace dsaib::hopper
