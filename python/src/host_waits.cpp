// Counts the CUDA runtime's blocking calls made inside the extension: the
// library's validation reads (a copy of cu_seqlens or of the ids to the host,
// then a stream synchronisation) and the extension's own stream_synchronize.
//
// A CUDA build links the extension with --wrap=NAME for each function below
// (python/CMakeLists.txt, DSAIB_PY_WAIT_CALLS): the linker sends every call of
// NAME from the extension's objects and the static library to __wrap_NAME,
// which counts and calls the runtime's own function (__real_NAME). The calls
// are counted where they are made, whatever the library's code looks like.
// python/tests/test_host_syncs.py checks the list against CMake's, and links
// this file with the CUDA toolkit's static runtime to see each call counted.
#include "host_waits.hpp"

#include <atomic>

namespace dsaib_py {
namespace {
std::atomic<std::uint64_t> g_waits{0};
}  // namespace

#if DSAIB_PY_COUNT_HOST_WAITS
bool counts_host_waits() { return true; }
#else
bool counts_host_waits() { return false; }
#endif

std::uint64_t host_waits() { return g_waits.load(std::memory_order_relaxed); }

}  // namespace dsaib_py

#if DSAIB_PY_COUNT_HOST_WAITS
#include <cuda_runtime.h>

namespace {
void count() { dsaib_py::g_waits.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

extern "C" {
cudaError_t __real_cudaStreamSynchronize(cudaStream_t stream);
cudaError_t __real_cudaDeviceSynchronize();
cudaError_t __real_cudaEventSynchronize(cudaEvent_t event);
cudaError_t __real_cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind);
cudaError_t __real_cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                size_t height, cudaMemcpyKind kind);

cudaError_t __wrap_cudaStreamSynchronize(cudaStream_t stream) {
  count();
  return __real_cudaStreamSynchronize(stream);
}
cudaError_t __wrap_cudaDeviceSynchronize() {
  count();
  return __real_cudaDeviceSynchronize();
}
cudaError_t __wrap_cudaEventSynchronize(cudaEvent_t event) {
  count();
  return __real_cudaEventSynchronize(event);
}
cudaError_t __wrap_cudaMemcpy(void* dst, const void* src, size_t count_bytes, cudaMemcpyKind kind) {
  count();
  return __real_cudaMemcpy(dst, src, count_bytes, kind);
}
cudaError_t __wrap_cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                size_t height, cudaMemcpyKind kind) {
  count();
  return __real_cudaMemcpy2D(dst, dpitch, src, spitch, width, height, kind);
}
}  // extern "C"
#endif
