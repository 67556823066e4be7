// dsaib_bench: statistics, the device probe, the floor formula, names.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "bench_core.hpp"
#include "cuda_check.hpp"

namespace dsaib::bench {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw Error(ErrorCode::cuda_error, "bench",
                std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
}

Stats stats_of(std::vector<float> ms) {
  Stats s;
  if (ms.empty()) return s;
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  s.median_ms = n % 2 ? ms[n / 2] : 0.5 * (static_cast<double>(ms[n / 2 - 1]) + ms[n / 2]);
  s.min_ms = ms.front();
  s.max_ms = ms.back();
  s.runs = static_cast<int>(n);
  return s;
}

DeviceInfo probe_device() {
  DeviceInfo d;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  cudaDriverGetVersion(&d.driver_version);
  cudaRuntimeGetVersion(&d.runtime_version);
  if (e != cudaSuccess || count == 0) {
    d.reason = e == cudaSuccess || e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver
                   ? std::string("no CUDA device visible")
                   : std::string("no CUDA device visible (") + cudaGetErrorName(e) + ")";
    cudaGetLastError();  // clear the error the failed query left
    return d;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    d.reason = "cannot query device 0";
    cudaGetLastError();
    return d;
  }
  d.name = prop.name;
  d.cc_major = prop.major;
  d.cc_minor = prop.minor;
  d.sm_count = prop.multiProcessorCount;
  d.l2_bytes = prop.l2CacheSize;
  if (prop.major != 9 || prop.minor != 0) {
    d.reason = "device 0 (" + d.name + ") is sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
               ", the benchmark kernels are built for sm_90a only";
    return d;
  }
  if (cudaSetDevice(0) != cudaSuccess) {
    d.reason = "cannot use device 0";
    cudaGetLastError();
    return d;
  }
  size_t persisting = 0;
  if (cudaDeviceGetLimit(&persisting, cudaLimitPersistingL2CacheSize) == cudaSuccess) {
    d.l2_persisting_bytes = static_cast<int64_t>(persisting);
  } else {
    cudaGetLastError();
  }
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
    d.free_bytes = free_b;
    d.total_bytes = total_b;
  }
  d.usable = true;
  return d;
}

const char* scatter_way_name(ScatterWay w) {
  switch (w) {
    case ScatterWay::float4_atomic: return "float4";
    case ScatterWay::scalar_atomic: return "scalar";
    case ScatterWay::bulk_reduce: return "bulk";
    case ScatterWay::float4_fragment: return "fragment";
    case ScatterWay::gather_float4: return "gather";
  }
  return "?";
}

const ScatterResult& fastest(const std::vector<ScatterResult>& results) {
  if (results.empty()) throw Error(ErrorCode::internal, "bench", "fastest: no scatter measurement");
  return *std::max_element(results.begin(), results.end(),
                           [](const ScatterResult& a, const ScatterResult& b) { return a.tbps < b.tbps; });
}

/// ns to add `slots` rows of D fp32 values at `tbps` (0 without a rate): the
/// reduce term of both floors.
static double reduce_ns(double slots, int64_t dim, double tbps) {
  const double bytes = slots * static_cast<double>(dim) * 4.0;
  return tbps > 0 ? bytes / (tbps * 1e3) : 0.0;  // 1 TB/s = 1e3 B/ns
}

double traffic_floor_ns_per_row(double slots, int64_t dim, double key_read_scatter_tbps) {
  return reduce_ns(slots, dim, key_read_scatter_tbps);
}

Floor floor_per_row(double slots, int64_t heads, int64_t dim, double scatter_tbps, double gemm_tflops) {
  Floor f;
  const double flops = 6.0 * static_cast<double>(heads) * static_cast<double>(dim) * slots;
  f.scatter_ns = reduce_ns(slots, dim, scatter_tbps);
  f.gemm_ns = gemm_tflops > 0 ? flops / (gemm_tflops * 1e3) : 0.0;       // 1 TFLOP/s = 1e3 FLOP/ns
  f.ns = std::max(f.scatter_ns, f.gemm_ns);
  f.bound = f.scatter_ns >= f.gemm_ns ? "scatter" : "gemm";
  return f;
}

ForwardFloor forward_floor_per_row(double gather_ns, double slots, int64_t heads, int64_t dim, double gemm_tflops) {
  ForwardFloor f;
  const double flops = 2.0 * static_cast<double>(heads) * static_cast<double>(dim) * slots;
  f.gather_ns = gather_ns;
  f.gemm_ns = gemm_tflops > 0 ? flops / (gemm_tflops * 1e3) : 0.0;  // 1 TFLOP/s = 1e3 FLOP/ns
  f.ns = std::max(f.gather_ns, f.gemm_ns);
  f.bound = f.gather_ns >= f.gemm_ns ? "gather" : "gemm";
  return f;
}

double topk_floor_ns_per_row(double visible_keys_per_row, int64_t heads, int64_t dim, double gemm_tflops) {
  const double flops = 2.0 * static_cast<double>(heads) * static_cast<double>(dim) * visible_keys_per_row;
  return gemm_tflops > 0 ? flops / (gemm_tflops * 1e3) : 0.0;  // 1 TFLOP/s = 1e3 FLOP/ns
}

StepFloor step_floor_per_row(double slots, int64_t heads, int64_t dim, double scatter_tbps, double gemm_tflops,
                             double gather_ns) {
  StepFloor f;
  const double flops = 8.0 * static_cast<double>(heads) * static_cast<double>(dim) * slots;
  f.scatter_ns = reduce_ns(slots, dim, scatter_tbps);
  f.gemm_ns = gemm_tflops > 0 ? flops / (gemm_tflops * 1e3) : 0.0;
  f.gather_ns = gather_ns;
  f.ns = std::max({f.scatter_ns, f.gemm_ns, f.gather_ns});
  f.bound = f.ns == f.scatter_ns ? "scatter" : f.ns == f.gemm_ns ? "gemm" : "gather";
  return f;
}

int sustained_launches(double sustained_ms, double launch_ms) {
  if (!std::isfinite(sustained_ms) || sustained_ms < 0) {
    throw Error(ErrorCode::invalid_argument, "sustained_ms",
                "a finite number of milliseconds >= 0, got " + std::to_string(sustained_ms));
  }
  if (!(launch_ms > 0) || !std::isfinite(launch_ms)) {
    throw Error(ErrorCode::invalid_argument, "launch_ms",
                "a positive, finite launch time, got " + std::to_string(launch_ms));
  }
  const double n = std::ceil(sustained_ms / launch_ms);
  if (n >= kSustainedMaxLaunches) return kSustainedMaxLaunches;
  return std::max(kSustainedMinLaunches, static_cast<int>(n));
}

int auto_input_sets(uint64_t set_bytes, int64_t l2_bytes, uint64_t free_bytes) {
  constexpr int kMinSets = 2, kMaxSets = 64;
  const double target = 2.0 * static_cast<double>(std::max<int64_t>(l2_bytes, 1));
  const double per_set = static_cast<double>(std::max<uint64_t>(set_bytes, 1));
  int n = static_cast<int>(std::clamp(std::ceil(target / per_set), double(kMinSets), double(kMaxSets)));
  if (free_bytes > 0) {
    while (n > 1 && static_cast<double>(n) * per_set > 0.5 * static_cast<double>(free_bytes)) --n;
  }
  return n;
}

std::string rotation_method() {
  return "each case keeps N input sets (index_q, weights, index_k, topk_indices, attn_score, index_score and "
         "their own outputs): device copies of one generated set at different addresses; launch i (warm-up and "
         "timed) uses set i mod N, so consecutive launches touch different memory and a set is reused only after "
         "the other N-1 went through L2. Automatic N = clamp(ceil(2*L2 / set_bytes), 2, 64), lowered until all "
         "sets fit in half of the free device memory (--input-sets overrides; 1 = no rotation). The fp32 dK "
         "workspace (B*S_kv*D*4 B) is one buffer shared by the sets and zeroed by every launch.";
}

}  // namespace dsaib::bench
