// dsaib_bench internals: CUDA error checks and a device buffer (not part of bench_core.hpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "bench_core.hpp"
#include "dsaib/error.hpp"

namespace dsaib::bench {

/// Raises dsaib::Error(cuda_error) naming `what` when `e` is not cudaSuccess.
void check_cuda(cudaError_t e, const char* what);

/// Enqueues a one-thread kernel on `s` that spins for `us` microseconds (%globaltimer);
/// touches no memory. Defined in device_fill.cu.
void gpu_spin(cudaStream_t s, double us);

/// Spin before each timed launch (Timer::time), as long as the peers' 3 ms sleep.
constexpr double kGpuPreRollUs = 3000.0;

/// A cudaMalloc'd buffer, freed on scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : bytes(n) {
    if (n > 0) check_cuda(cudaMalloc(&ptr, n), "cudaMalloc");
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), bytes(o.bytes) {
    o.ptr = nullptr;
    o.bytes = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

/// A stream and two timing events, destroyed on scope exit.
struct Timer {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  Timer() {
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaEventCreate(&start), "cudaEventCreate");
    check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  ~Timer() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
  }
  /// Milliseconds of the work `launch` enqueues on `stream`, bracketed by the events.
  /// The stream first runs a kGpuPreRollUs spin (gpu_spin): the start event fires only
  /// after launch()'s host-side work has queued the op behind it, and the GPU is busy,
  /// not idle, when the timed work starts (the cudnn-frontend and TileLang peers' timer,
  /// bench/peers/common.py gpu_time, does the same with a 3 ms sleep). On the H200 the
  /// spin gave ~2% lower times for the op and the floor kernels alike, so the gain is
  /// not from hiding the host's calls alone.
  template <typename Launch>
  float time(Launch&& launch) {
    gpu_spin(stream, kGpuPreRollUs);
    check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
    launch();
    check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return ms;
  }
};

/// Times an op as every op of the bench is timed: cfg.warmup untimed calls of `launch`
/// (one launch of the op on timer.stream per call), then cfg.iters calls timed with
/// Timer::time, then (cfg.sustained_ms > 0) the sustained run; fills r.ms, r.t, the
/// ns_per_row fields (over `rows` query rows) and the sustained fields. op_bench.cpp.
void time_op(Timer& timer, const std::function<void()>& launch, const OpConfig& cfg, int64_t rows, OpResult& r);

/// The attention target's case (BenchOp::target; target_bench.cpp): check_case and run_op_case of it.
void check_target_case(const OpCase& c);
OpResult run_target_case(const OpCase& c, const OpConfig& cfg);

/// The indexer's top-k case (BenchOp::topk; topk_bench.cpp): check_case and run_op_case of it.
void check_topk_case(const OpCase& c);
OpResult run_topk_case(const OpCase& c, const OpConfig& cfg);

}  // namespace dsaib::bench
