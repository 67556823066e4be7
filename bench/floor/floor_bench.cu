// dsa-floor-bench: the repo's own measurement of the hardware floor of the
// indexer backward (issue 4, "Floor ratio"). On the GPU, with CUDA events,
// warm-up launches and the median of many timed launches, it measures
//   a. the fp32 scatter-add rate: 512-byte rows (128 floats) added into random
//      rows of an fp32 (R, 128) table, for several table sizes, three ways:
//        float4  atomicAdd(float4*) per thread (RED.E.ADD.F32x4), a warp per row
//        scalar  atomicAdd(float) per thread, a warp per row (4 per lane)
//        bulk    cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 of
//                512 B from shared memory: each warp restages a group of rows in
//                smem (fence.proxy.async), lane 0 issues one bulk reduce per row,
//                and a ring of staging buffers keeps several groups in flight
//                (cp.async.bulk.wait_group.read before a buffer is rewritten);
//      the payload values are made in registers (no source read), the rows by a
//      hash of the row-add index; rate = bytes added / time;
//   b. the bf16 GEMM rate of cuBLAS (cublasGemmEx, bf16 in/out, fp32 compute,
//      8192^3 by default, random non-zero data);
//   c. the derived floor per query row of the backward:
//        max(topk*D*4 B / scatter rate (best way, table size matching S_kv*D*4 B),
//            6*H*D*topk FLOP / GEMM rate).
// Every scatter way and the GEMM are checked for correctness once (exact column
// sums of the table; a few GEMM entries against a host dot product).
//
//   dsa-floor-bench [--json FILE] [--iters N] [--warmup N] [--tables 2,8,32,512]
//                   [--payload-mib 1024] [--gemm-size 8192] [--seed N]
// Exit codes: 0 ok, 1 a CUDA/cuBLAS error or a failed check, 2 bad arguments,
// 77 no sm_90 GPU.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda/ptx>
#include <sstream>
#include <string>
#include <vector>

namespace {

#define CK(call) check_cuda((call), #call, __FILE__, __LINE__)
#define CKB(call) check_cublas((call), #call, __FILE__, __LINE__)

void check_cuda(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", file, line, what, cudaGetErrorName(e), cudaGetErrorString(e));
    std::exit(1);
  }
}

void check_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", file, line, what, cublasGetStatusName(s),
                 cublasGetStatusString(s));
    std::exit(1);
  }
}

constexpr int kRowFloats = 128;                // one dK row at D = 128
constexpr int kRowBytes = kRowFloats * 4;      // 512 B
constexpr int kAtomicThreads = 256;            // float4 / scalar kernels
constexpr int kBulkWarps = 4;                  // bulk kernel: 128 threads
constexpr int kBulkRowsPerGroup = 8;           // rows staged and issued per group (4 KiB)
constexpr int kBulkStages = 4;                 // staging ring per warp: 16 KiB, up to 4 groups in flight
constexpr int kBulkSmemBytes = kBulkWarps * kBulkStages * kBulkRowsPerGroup * kRowBytes;  // 64 KiB

__host__ __device__ inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Row of row-add i: a hash mapped onto [0, rows) by a multiply-high.
__device__ __forceinline__ uint32_t row_of(uint32_t i, uint32_t seed, uint32_t rows) {
  return static_cast<uint32_t>((static_cast<uint64_t>(mix32(i ^ seed)) * rows) >> 32);
}

// Value added into column c by every row-add: 1 + (c & 3) (integers, so the
// column sums of a check run are exact).
__host__ __device__ inline float value_of_column(int c) { return 1.0f + static_cast<float>(c & 3); }

__global__ void __launch_bounds__(kAtomicThreads) scatter_float4_kernel(float* __restrict__ table, uint32_t rows,
                                                                         uint32_t n_adds, uint32_t seed) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t n_warps = (gridDim.x * blockDim.x) >> 5;
  const float4 v = make_float4(value_of_column(4 * lane), value_of_column(4 * lane + 1), value_of_column(4 * lane + 2),
                               value_of_column(4 * lane + 3));
#pragma unroll 4
  for (uint32_t i = warp; i < n_adds; i += n_warps) {
    float4* dst = reinterpret_cast<float4*>(table + static_cast<size_t>(row_of(i, seed, rows)) * kRowFloats) + lane;
    atomicAdd(dst, v);
  }
}

__global__ void __launch_bounds__(kAtomicThreads) scatter_scalar_kernel(float* __restrict__ table, uint32_t rows,
                                                                         uint32_t n_adds, uint32_t seed) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t n_warps = (gridDim.x * blockDim.x) >> 5;
  const float v = value_of_column(static_cast<int>(lane));  // column j*32 + lane has the same value for all j
#pragma unroll 2
  for (uint32_t i = warp; i < n_adds; i += n_warps) {
    float* dst = table + static_cast<size_t>(row_of(i, seed, rows)) * kRowFloats + lane;
#pragma unroll
    for (int j = 0; j < kRowFloats / 32; ++j) atomicAdd(dst + 32 * j, v);
  }
}

__global__ void __launch_bounds__(kBulkWarps * 32) scatter_bulk_kernel(float* __restrict__ table, uint32_t rows,
                                                                        uint32_t n_adds, uint32_t seed) {
  extern __shared__ __align__(128) float smem[];
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp_in_block = threadIdx.x >> 5;
  const uint32_t warp = blockIdx.x * kBulkWarps + warp_in_block;
  const uint32_t n_warps = gridDim.x * kBulkWarps;
  const uint32_t n_groups = n_adds / kBulkRowsPerGroup;
  float* ring = smem + static_cast<size_t>(warp_in_block) * kBulkStages * kBulkRowsPerGroup * kRowFloats;
  const float4 v = make_float4(value_of_column(4 * lane), value_of_column(4 * lane + 1), value_of_column(4 * lane + 2),
                               value_of_column(4 * lane + 3));
  uint32_t stage = 0;
  for (uint32_t g = warp; g < n_groups; g += n_warps) {
    float* buf = ring + stage * kBulkRowsPerGroup * kRowFloats;
    // The group that last read this buffer was committed kBulkStages groups ago:
    // allow kBulkStages - 1 newer ones to stay in flight.
    if (lane == 0) cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<kBulkStages - 1>{});
    __syncwarp();
    // Restage the group's rows (as a fused kernel restages every dK block).
#pragma unroll
    for (int r = 0; r < kBulkRowsPerGroup; ++r) reinterpret_cast<float4*>(buf + r * kRowFloats)[lane] = v;
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // generic-proxy smem writes -> async proxy
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kBulkRowsPerGroup; ++r) {
        const uint32_t row = row_of(g * kBulkRowsPerGroup + r, seed, rows);
        cuda::ptx::cp_reduce_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, cuda::ptx::op_add,
                                        table + static_cast<size_t>(row) * kRowFloats, buf + r * kRowFloats,
                                        static_cast<uint32_t>(kRowBytes));
      }
      cuda::ptx::cp_async_bulk_commit_group();
    }
    stage = stage + 1 == kBulkStages ? 0 : stage + 1;
  }
  // Every reduce complete (not just read) before the CTA's smem goes away.
  if (lane == 0) cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
  __syncwarp();
}

// Random non-zero bf16: magnitude in [0.25, 1), random sign; reproducible on the host.
__host__ __device__ inline float gemm_value(uint64_t i, uint32_t salt) {
  const uint32_t u = mix32(static_cast<uint32_t>(i) ^ mix32(static_cast<uint32_t>(i >> 32) + salt));
  const float mag = 0.25f + 0.75f * static_cast<float>(u >> 8) * (1.0f / 16777216.0f);
  return (u & 1u) ? -mag : mag;
}

__global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, uint32_t salt) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn(gemm_value(i, salt));
}

float host_bf16_round(float f) {  // round to nearest even, as __float2bfloat16_rn for finite values
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

float host_bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

struct Stats {
  double median_ms = 0, min_ms = 0, max_ms = 0;
};

Stats stats_of(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  Stats s;
  const size_t n = ms.size();
  s.median_ms = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  s.min_ms = ms.front();
  s.max_ms = ms.back();
  return s;
}

struct ScatterResult {
  double table_mib;
  uint64_t rows;
  std::string way;
  uint64_t payload_bytes;
  int grid, block;
  Stats t;
  double tbps;
  bool check_ok;
};

struct GemmResult {
  int m, n, k;
  Stats t;
  double tflops;
  bool check_ok;
  double max_rel_err;
};

struct FloorCase {
  std::string name;
  int64_t heads, dim, topk, seq_kv;
};

struct FloorResult {
  FloorCase c;
  double dk_table_mib, rate_table_mib;
  std::string way;
  double scatter_tbps, scatter_ns, gemm_ns, floor_ns;
  bool approx;  // rows are not 512 B, or the table matched is not the case's size
};

struct Options {
  std::string json;
  int iters = 25;
  int warmup = 3;
  std::vector<double> tables_mib = {2, 8, 32, 512};
  double payload_mib = 1024;
  int gemm_size = 8192;
  uint32_t seed = 12345;
};

enum class Way { float4_atomic, scalar_atomic, bulk_reduce };
const char* way_name(Way w) {
  switch (w) {
    case Way::float4_atomic: return "float4";
    case Way::scalar_atomic: return "scalar";
    case Way::bulk_reduce: return "bulk";
  }
  return "?";
}

struct Launch {
  int grid, block, smem;
};

Launch launch_shape(Way w, int sms) {
  int per_sm = 0;
  Launch l{};
  switch (w) {
    case Way::float4_atomic:
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, scatter_float4_kernel, kAtomicThreads, 0));
      l = {sms * per_sm, kAtomicThreads, 0};
      break;
    case Way::scalar_atomic:
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, scatter_scalar_kernel, kAtomicThreads, 0));
      l = {sms * per_sm, kAtomicThreads, 0};
      break;
    case Way::bulk_reduce:
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, scatter_bulk_kernel, kBulkWarps * 32, kBulkSmemBytes));
      l = {sms * per_sm, kBulkWarps * 32, kBulkSmemBytes};
      break;
  }
  if (per_sm < 1) {
    std::fprintf(stderr, "kernel %s cannot be resident (occupancy 0)\n", way_name(w));
    std::exit(1);
  }
  return l;
}

void launch_scatter(Way w, const Launch& l, float* table, uint32_t rows, uint32_t n_adds, uint32_t seed,
                    cudaStream_t s) {
  switch (w) {
    case Way::float4_atomic: scatter_float4_kernel<<<l.grid, l.block, 0, s>>>(table, rows, n_adds, seed); break;
    case Way::scalar_atomic: scatter_scalar_kernel<<<l.grid, l.block, 0, s>>>(table, rows, n_adds, seed); break;
    case Way::bulk_reduce: scatter_bulk_kernel<<<l.grid, l.block, l.smem, s>>>(table, rows, n_adds, seed); break;
  }
  CK(cudaGetLastError());
}

// Column sums of a zeroed table after one launch must be n_adds * value_of_column(c), exactly.
bool check_scatter(Way w, const Launch& l, float* d_table, uint64_t rows, uint32_t n_adds, uint32_t seed,
                   cudaStream_t s) {
  const size_t elems = rows * kRowFloats;
  CK(cudaMemsetAsync(d_table, 0, elems * 4, s));
  launch_scatter(w, l, d_table, static_cast<uint32_t>(rows), n_adds, seed, s);
  CK(cudaStreamSynchronize(s));
  std::vector<float> h(elems);
  CK(cudaMemcpy(h.data(), d_table, elems * 4, cudaMemcpyDeviceToHost));
  std::vector<double> col(kRowFloats, 0.0);
  for (uint64_t r = 0; r < rows; ++r)
    for (int c = 0; c < kRowFloats; ++c) col[c] += h[r * kRowFloats + c];
  for (int c = 0; c < kRowFloats; ++c) {
    const double want = static_cast<double>(n_adds) * value_of_column(c);
    if (col[c] != want) {
      std::fprintf(stderr, "scatter check (%s, %llu rows): column %d sums to %.1f, want %.1f\n", way_name(w),
                   (unsigned long long)rows, c, col[c], want);
      return false;
    }
  }
  return true;
}

std::vector<ScatterResult> run_scatter(const Options& o, int sms, cudaStream_t s) {
  std::vector<ScatterResult> out;
  const uint64_t payload = static_cast<uint64_t>(o.payload_mib * 1024.0 * 1024.0);
  const uint32_t n_adds = static_cast<uint32_t>(payload / kRowBytes / kBulkRowsPerGroup * kBulkRowsPerGroup);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaFuncSetAttribute(scatter_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmemBytes));
  for (double mib : o.tables_mib) {
    const uint64_t rows = std::max<uint64_t>(1, static_cast<uint64_t>(mib * 1024.0 * 1024.0) / kRowBytes);
    float* d_table = nullptr;
    CK(cudaMalloc(&d_table, rows * kRowBytes));
    for (Way w : {Way::float4_atomic, Way::scalar_atomic, Way::bulk_reduce}) {
      const Launch l = launch_shape(w, sms);
      ScatterResult r;
      r.table_mib = mib;
      r.rows = rows;
      r.way = way_name(w);
      r.payload_bytes = static_cast<uint64_t>(n_adds) * kRowBytes;
      r.grid = l.grid;
      r.block = l.block;
      r.check_ok = check_scatter(w, l, d_table, rows, n_adds, o.seed, s);
      for (int i = 0; i < o.warmup; ++i)
        launch_scatter(w, l, d_table, static_cast<uint32_t>(rows), n_adds, o.seed + 1 + i, s);
      CK(cudaStreamSynchronize(s));
      std::vector<float> ms;
      for (int i = 0; i < o.iters; ++i) {
        CK(cudaEventRecord(e0, s));
        launch_scatter(w, l, d_table, static_cast<uint32_t>(rows), n_adds, o.seed + 100 + i, s);
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float t = 0;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
      }
      r.t = stats_of(ms);
      r.tbps = static_cast<double>(r.payload_bytes) / (r.t.median_ms * 1e-3) / 1e12;
      out.push_back(r);
      std::fprintf(stderr, "  scatter %7.1f MiB %-6s %8.3f ms  %6.3f TB/s  check %s\n", mib, r.way.c_str(),
                   r.t.median_ms, r.tbps, r.check_ok ? "ok" : "FAIL");
    }
    CK(cudaFree(d_table));
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return out;
}

GemmResult run_gemm(const Options& o, cudaStream_t s) {
  const int n = o.gemm_size;
  GemmResult g{n, n, n, {}, 0, false, 0};
  const size_t elems = static_cast<size_t>(n) * n;
  __nv_bfloat16 *A = nullptr, *B = nullptr, *C = nullptr;
  CK(cudaMalloc(&A, elems * 2));
  CK(cudaMalloc(&B, elems * 2));
  CK(cudaMalloc(&C, elems * 2));
  const uint32_t salt_a = 0xA11CEu, salt_b = 0xB0Bu;
  fill_bf16_kernel<<<1024, 256, 0, s>>>(A, elems, salt_a);
  CK(cudaGetLastError());
  fill_bf16_kernel<<<1024, 256, 0, s>>>(B, elems, salt_b);
  CK(cudaGetLastError());
  cublasHandle_t h;
  CKB(cublasCreate(&h));
  CKB(cublasSetStream(h, s));
  void* ws = nullptr;
  const size_t ws_bytes = 64ull << 20;
  CK(cudaMalloc(&ws, ws_bytes));
  CKB(cublasSetWorkspace(h, ws, ws_bytes));
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major C (m x n) = A^T B with A stored (k x m), B stored (k x n): "TN".
  auto gemm = [&]() {
    CKB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, A, CUDA_R_16BF, n, B, CUDA_R_16BF, n, &beta, C,
                     CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  // Check a few entries against a host dot product of the same (bf16-rounded) data.
  gemm();
  CK(cudaStreamSynchronize(s));
  g.check_ok = true;
  for (int p = 0; p < 8; ++p) {
    const int i = static_cast<int>(mix32(17u * p + 1u) % static_cast<uint32_t>(n));
    const int j = static_cast<int>(mix32(31u * p + 7u) % static_cast<uint32_t>(n));
    double ref = 0, scale = 0;
    for (int kk = 0; kk < n; ++kk) {
      const double a = host_bf16_round(gemm_value(static_cast<uint64_t>(i) * n + kk, salt_a));
      const double b = host_bf16_round(gemm_value(static_cast<uint64_t>(j) * n + kk, salt_b));
      ref += a * b;
      scale += (a * b) * (a * b);
    }
    uint16_t got_bits = 0;
    CK(cudaMemcpy(&got_bits, C + static_cast<size_t>(j) * n + i, 2, cudaMemcpyDeviceToHost));
    const double got = host_bf16_to_float(got_bits);
    const double denom = std::max(std::fabs(ref), std::sqrt(scale));
    const double rel = std::fabs(got - ref) / denom;
    g.max_rel_err = std::max(g.max_rel_err, rel);
    if (!(rel <= 1e-2)) {
      std::fprintf(stderr, "gemm check: C[%d,%d] = %.4f, host %.4f (rel %.3g)\n", i, j, got, ref, rel);
      g.check_ok = false;
    }
  }
  for (int i = 0; i < o.warmup; ++i) gemm();
  CK(cudaStreamSynchronize(s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < o.iters; ++i) {
    CK(cudaEventRecord(e0, s));
    gemm();
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  g.t = stats_of(ms);
  g.tflops = 2.0 * n * static_cast<double>(n) * n / (g.t.median_ms * 1e-3) / 1e12;
  std::fprintf(stderr, "  gemm %d^3 %8.3f ms  %7.1f TFLOP/s  check %s (max rel err %.2g)\n", n, g.t.median_ms,
               g.tflops, g.check_ok ? "ok" : "FAIL", g.max_rel_err);
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CKB(cublasDestroy(h));
  CK(cudaFree(ws));
  CK(cudaFree(A));
  CK(cudaFree(B));
  CK(cudaFree(C));
  return g;
}

std::vector<FloorResult> derive_floor(const std::vector<ScatterResult>& sc, const GemmResult& g) {
  const std::vector<FloorCase> cases = {
      {"deepseek S4096", 64, 128, 2048, 4096},   {"deepseek S16384", 64, 128, 2048, 16384},
      {"deepseek S65536", 64, 128, 2048, 65536}, {"topk512 S16384", 64, 128, 512, 16384},
      {"topk1024 S16384", 64, 128, 1024, 16384}, {"H32 S16384", 32, 128, 2048, 16384},
      {"H128 S16384", 128, 128, 2048, 16384},    {"D64 S16384", 64, 64, 2048, 16384},
  };
  std::vector<double> tables;
  for (const auto& r : sc)
    if (std::find(tables.begin(), tables.end(), r.table_mib) == tables.end()) tables.push_back(r.table_mib);
  std::sort(tables.begin(), tables.end());
  std::vector<FloorResult> out;
  if (tables.empty()) return out;
  for (const auto& c : cases) {
    FloorResult f;
    f.c = c;
    f.dk_table_mib = static_cast<double>(c.seq_kv) * c.dim * 4 / (1024.0 * 1024.0);
    // The smallest measured table at least as large as dK (else the largest).
    f.rate_table_mib = tables.back();
    for (double t : tables)
      if (t >= f.dk_table_mib * (1 - 1e-9)) {
        f.rate_table_mib = t;
        break;
      }
    f.scatter_tbps = 0;
    for (const auto& r : sc)
      if (r.table_mib == f.rate_table_mib && r.tbps > f.scatter_tbps) {
        f.scatter_tbps = r.tbps;
        f.way = r.way;
      }
    f.approx = c.dim != kRowFloats || std::fabs(f.rate_table_mib - f.dk_table_mib) > 1e-9;
    const double bytes = static_cast<double>(c.topk) * c.dim * 4;
    const double flops = 6.0 * c.heads * c.dim * c.topk;
    f.scatter_ns = bytes / (f.scatter_tbps * 1e3);  // 1 TB/s = 1e3 B/ns
    f.gemm_ns = flops / (g.tflops * 1e3);           // 1 TFLOP/s = 1e3 FLOP/ns
    f.floor_ns = std::max(f.scatter_ns, f.gemm_ns);
    out.push_back(f);
  }
  return out;
}

std::vector<double> parse_doubles(const std::string& s) {
  std::vector<double> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stod(item));
  return v;
}

void usage(FILE* f) {
  std::fprintf(f,
               "usage: dsa-floor-bench [--json FILE] [--iters N] [--warmup N] [--tables MiB,MiB,...]\n"
               "                       [--payload-mib MiB] [--gemm-size N] [--seed N]\n"
               "Measures on the GPU (sm_90): the fp32 scatter-add rate of 512-B rows into random rows of\n"
               "fp32 (R,128) tables (atomicAdd float4, atomicAdd float, cp.reduce.async.bulk add.f32), the\n"
               "cuBLAS bf16 GEMM rate, and the derived floor per query row of the indexer backward:\n"
               "max(topk*D*4 B / scatter rate, 6*H*D*topk / GEMM rate).\n"
               "  --json FILE       also write the results as JSON\n"
               "  --iters N         timed launches per case, median reported (default 25)\n"
               "  --warmup N        untimed launches first (default 3)\n"
               "  --tables LIST     dK table sizes in MiB (default 2,8,32,512: S_kv 4096, 16384, 65536 at D128, and\n"
               "                    one beyond L2)\n"
               "  --payload-mib M   bytes added per launch (default 1024)\n"
               "  --gemm-size N     GEMM is N x N x N (default 8192)\n"
               "  --seed N          row-hash seed (default 12345)\n"
               "Exit: 0 ok, 1 CUDA/cuBLAS error or failed check, 2 bad arguments, 77 no sm_90 GPU.\n");
}

void write_json(const std::string& path, const cudaDeviceProp& prop, const Options& o,
                const std::vector<ScatterResult>& sc, const GemmResult& g, const std::vector<FloorResult>& fl) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
  std::fprintf(f, "{\n  \"device\": \"%s\", \"sm_count\": %d, \"l2_bytes\": %d, \"iters\": %d, \"warmup\": %d,\n",
               prop.name, prop.multiProcessorCount, prop.l2CacheSize, o.iters, o.warmup);
  std::fprintf(f, "  \"scatter\": [\n");
  for (size_t i = 0; i < sc.size(); ++i) {
    const auto& r = sc[i];
    std::fprintf(f,
                 "    {\"table_mib\": %.3f, \"rows\": %llu, \"way\": \"%s\", \"row_bytes\": %d, \"payload_bytes\": %llu, "
                 "\"grid\": %d, \"block\": %d, \"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, "
                 "\"tbps\": %.4f, \"check\": %s}%s\n",
                 r.table_mib, (unsigned long long)r.rows, r.way.c_str(), kRowBytes,
                 (unsigned long long)r.payload_bytes, r.grid, r.block, r.t.median_ms, r.t.min_ms, r.t.max_ms, r.tbps,
                 r.check_ok ? "true" : "false", i + 1 < sc.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n");
  std::fprintf(f,
               "  \"gemm\": {\"m\": %d, \"n\": %d, \"k\": %d, \"dtype\": \"bf16\", \"compute\": \"fp32\", "
               "\"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, \"tflops\": %.2f, \"check\": %s, "
               "\"max_rel_err\": %.3g},\n",
               g.m, g.n, g.k, g.t.median_ms, g.t.min_ms, g.t.max_ms, g.tflops, g.check_ok ? "true" : "false",
               g.max_rel_err);
  std::fprintf(f, "  \"floor\": [\n");
  for (size_t i = 0; i < fl.size(); ++i) {
    const auto& r = fl[i];
    std::fprintf(f,
                 "    {\"case\": \"%s\", \"heads\": %lld, \"dim\": %lld, \"topk\": %lld, \"seq_kv\": %lld, "
                 "\"dk_table_mib\": %.3f, \"rate_table_mib\": %.3f, \"scatter_way\": \"%s\", \"scatter_tbps\": %.4f, "
                 "\"scatter_ns\": %.2f, \"gemm_ns\": %.2f, \"floor_ns_per_row\": %.2f, \"bound\": \"%s\", "
                 "\"approx\": %s}%s\n",
                 r.c.name.c_str(), (long long)r.c.heads, (long long)r.c.dim, (long long)r.c.topk,
                 (long long)r.c.seq_kv, r.dk_table_mib, r.rate_table_mib, r.way.c_str(), r.scatter_tbps, r.scatter_ns,
                 r.gemm_ns, r.floor_ns, r.scatter_ns >= r.gemm_ns ? "scatter" : "gemm", r.approx ? "true" : "false",
                 i + 1 < fl.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "missing value for %s\n", a.c_str());
      usage(stderr);
      return 2;
    }
    const std::string v = argv[++i];
    try {
      if (a == "--json") o.json = v;
      else if (a == "--iters") o.iters = std::stoi(v);
      else if (a == "--warmup") o.warmup = std::stoi(v);
      else if (a == "--tables") o.tables_mib = parse_doubles(v);
      else if (a == "--payload-mib") o.payload_mib = std::stod(v);
      else if (a == "--gemm-size") o.gemm_size = std::stoi(v);
      else if (a == "--seed") o.seed = static_cast<uint32_t>(std::stoul(v));
      else {
        std::fprintf(stderr, "unknown argument %s\n", a.c_str());
        usage(stderr);
        return 2;
      }
    } catch (const std::exception&) {
      std::fprintf(stderr, "bad value for %s: %s\n", a.c_str(), v.c_str());
      return 2;
    }
  }
  if (o.iters < 1 || o.warmup < 0 || o.payload_mib < 1 || o.payload_mib > 1e6 || o.gemm_size < 64 ||
      o.tables_mib.empty()) {
    std::fprintf(stderr, "bad arguments\n");
    usage(stderr);
    return 2;
  }
  for (double t : o.tables_mib)
    if (!(t > 0) || t * 1024 * 1024 / kRowBytes > 4294967295.0) {
      std::fprintf(stderr, "bad table size %g MiB\n", t);
      return 2;
    }

  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::fprintf(stderr, "no CUDA GPU (%s): nothing to measure\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "device count 0");
    return 77;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0) {
    std::fprintf(stderr, "this binary is built for sm_90a; device 0 is %s (sm_%d%d): nothing to measure\n", prop.name,
                 prop.major, prop.minor);
    return 77;
  }
  CK(cudaSetDevice(0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("dsa-floor-bench on %s (%d SMs, L2 %.0f MiB); median of %d launches after %d warm-ups\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1048576.0, o.iters, o.warmup);
  std::fflush(stdout);

  const auto sc = run_scatter(o, prop.multiProcessorCount, s);
  const auto g = run_gemm(o, s);
  const auto fl = derive_floor(sc, g);

  std::printf("\nfp32 scatter-add of 512-B rows into random rows, TB/s of payload (%.0f MiB added per launch)\n",
              sc.empty() ? 0.0 : sc.front().payload_bytes / 1048576.0);
  std::printf("%10s %9s %9s %9s %9s   %s\n", "table MiB", "rows", "float4", "scalar", "bulk", "check");
  for (size_t i = 0; i + 2 < sc.size(); i += 3) {
    const bool ok = sc[i].check_ok && sc[i + 1].check_ok && sc[i + 2].check_ok;
    std::printf("%10.1f %9llu %9.3f %9.3f %9.3f   %s\n", sc[i].table_mib, (unsigned long long)sc[i].rows, sc[i].tbps,
                sc[i + 1].tbps, sc[i + 2].tbps, ok ? "ok" : "FAIL");
  }
  std::printf("\nbf16 GEMM (cuBLAS, fp32 compute) %d^3: %.1f TFLOP/s (median %.3f ms, min %.3f, max %.3f)  check %s\n",
              g.m, g.tflops, g.t.median_ms, g.t.min_ms, g.t.max_ms, g.check_ok ? "ok" : "FAIL");
  std::printf("\nfloor per query row = max(topk*D*4 B / scatter rate, 6*H*D*topk / GEMM rate)\n");
  std::printf("%-16s %4s %4s %5s %6s %8s %8s %-6s %9s %9s %9s\n", "case", "H", "D", "topk", "S_kv", "dK MiB",
              "rate@MiB", "way", "scat ns", "gemm ns", "floor ns");
  for (const auto& r : fl)
    std::printf("%-16s %4lld %4lld %5lld %6lld %8.1f %8.1f %-6s %9.1f %9.1f %9.1f%s\n", r.c.name.c_str(),
                (long long)r.c.heads, (long long)r.c.dim, (long long)r.c.topk, (long long)r.c.seq_kv, r.dk_table_mib,
                r.rate_table_mib, r.way.c_str(), r.scatter_ns, r.gemm_ns, r.floor_ns, r.approx ? "  (approx)" : "");
  std::printf("(approx: rate measured with 512-B rows into a table of another size than this dK)\n");

  if (!o.json.empty()) write_json(o.json, prop, o, sc, g, fl);
  CK(cudaStreamDestroy(s));
  bool ok = g.check_ok;
  for (const auto& r : sc) ok = ok && r.check_ok;
  if (!ok) {
    std::fprintf(stderr, "a correctness check failed\n");
    return 1;
  }
  return 0;
}
