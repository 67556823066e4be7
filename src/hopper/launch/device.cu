// The cuda side of the launch layer (device.hpp) and the runtime queries that
// validation uses (api/cuda_backend.hpp).
#include "hopper/launch/device.hpp"

#include <string>

#include "api/cuda_backend.hpp"
#include "hopper/common/cuda_check.hpp"

namespace dsaib::hopper {

DeviceProperties query_device_properties() {
  int device = 0, sms = 0, l2_bytes = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)");
  cuda_check(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device),
             "cudaDeviceGetAttribute(cudaDevAttrL2CacheSize)");
  size_t set_aside = 0;
  if (cudaDeviceGetLimit(&set_aside, cudaLimitPersistingL2CacheSize) != cudaSuccess) {
    (void)cudaGetLastError();
    set_aside = 0;
  }
  DeviceProperties d;
  d.sm_count = sms;
  d.l2_bytes = l2_bytes;
  d.persisting_l2_bytes = static_cast<int64_t>(set_aside);
  return d;
}

CallWorkspace::CallWorkspace(void* caller, std::size_t caller_bytes, std::size_t bytes, cudaStream_t stream,
                             const char* what)
    : stream_(stream), what_(what) {
  if (caller != nullptr && caller_bytes >= bytes) {
    base_ = static_cast<char*>(caller);
  } else if (bytes > 0) {
    void* p = nullptr;
    cuda_check(cudaMallocAsync(&p, bytes, stream), (std::string("cudaMallocAsync (") + what + ")").c_str());
    base_ = static_cast<char*>(p);
    owned_ = true;
  }
}

void CallWorkspace::release() {
  if (!owned_) return;
  owned_ = false;
  cuda_check(cudaFreeAsync(base_, stream_), (std::string("cudaFreeAsync (") + what_ + ")").c_str());
}

CallWorkspace::~CallWorkspace() {
  if (owned_) (void)cudaFreeAsync(base_, stream_);
}

}  // namespace dsaib::hopper

namespace dsaib::detail {
using hopper::cuda_check;

bool cuda_backend_compiled() { return true; }

bool cuda_stream_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

bool cuda_device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  for (int d = 0; d < count; ++d) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) == cudaSuccess && major == 9) return true;
  }
  return false;
}

void cuda_copy_to_host(void* dst, const void* src, std::size_t row_bytes, std::size_t src_pitch, std::size_t rows,
                       void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (rows == 1) {
    cuda_check(cudaMemcpyAsync(dst, src, row_bytes, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync (validation read)");
  } else if (rows > 1) {
    cuda_check(cudaMemcpy2DAsync(dst, row_bytes, src, src_pitch, row_bytes, rows, cudaMemcpyDeviceToHost, s),
               "cudaMemcpy2DAsync (validation read)");
  }
  cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize (validation read)");
}

}  // namespace dsaib::detail
