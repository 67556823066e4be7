// dsaib_bench: the floor micro-benchmarks, sm_90a only.
//   a. fp32 scatter-add rate: rows of D floats (D = 64 or 128) added into rows of an
//      fp32 (R, D) table chosen by a hash of the row-add index, three ways (float4
//      atomicAdd, scalar atomicAdd, cp.reduce.async.bulk add.f32); payload values made in
//      registers; rate = bytes added / time. Each way is checked once: exact column sums.
//   b. cuBLAS bf16 GEMM rate (cublasGemmEx, bf16 in/out, fp32 compute), a few entries
//      checked against a host dot product of the same bf16 data.
//   c. the key gather's ids (the gather itself: gather_floor.cu).
//   d. cuBLAS bf16 GEMM rate at a given shape, batched (the attention target's per-row
//      GEMM, Hq x topk x Dqk).
//   e. cuBLASLt float8 e4m3 GEMM rate (TN, the layout Hopper's fp8 GEMMs take; fp32
//      compute, bf16 out), checked as b.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cuda/ptx>
#include <string>
#include <vector>

#include "bench_core.hpp"
#include "cuda_check.hpp"

namespace dsaib::bench {
namespace {

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw Error(ErrorCode::cuda_error, "bench",
                std::string(what) + " failed: " + cublasGetStatusName(s) + " (" + cublasGetStatusString(s) + ")");
  }
}

constexpr int kAtomicThreads = 256;   // float4 / scalar kernels
constexpr int kBulkWarps = 4;         // bulk kernel: 128 threads
constexpr int kBulkRowsPerGroup = 8;  // rows staged and issued per group
constexpr int kBulkStages = 4;        // staging ring per warp: up to 4 groups in flight

template <int RowFloats>
constexpr int bulk_smem_bytes() {  // 64 KiB at D128, 32 KiB at D64
  return kBulkWarps * kBulkStages * kBulkRowsPerGroup * RowFloats * 4;
}

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

// A warp adds 32 / (RowFloats/4) rows per step: lanes [j*RowFloats/4, (j+1)*RowFloats/4) own row j.
// This thread's place in that pattern, shared by the float4 and gather ways.
template <int RowFloats>
struct Float4RowLanes {
  static constexpr uint32_t kLanesPerRow = RowFloats / 4;
  static constexpr uint32_t kRowsPerStep = 32 / kLanesPerRow;
  uint32_t sub, col4;     // row within the step, float4 column within the row
  uint32_t warp, n_warps;  // this warp and all warps of the grid
  uint32_t n_steps;       // warp steps of n_adds row-adds
  float4 v;               // the payload of columns 4 col4 .. 4 col4 + 3
  __device__ explicit Float4RowLanes(uint32_t n_adds) {
    const uint32_t lane = threadIdx.x & 31u;
    sub = lane / kLanesPerRow;
    col4 = lane % kLanesPerRow;
    warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    n_warps = (gridDim.x * blockDim.x) >> 5;
    n_steps = n_adds / kRowsPerStep;
    v = make_float4(value_of_column(4 * col4), value_of_column(4 * col4 + 1), value_of_column(4 * col4 + 2),
                    value_of_column(4 * col4 + 3));
  }
};

template <int RowFloats>
__global__ void __launch_bounds__(kAtomicThreads) scatter_float4_kernel(float* __restrict__ table, uint32_t rows,
                                                                         uint32_t n_adds, uint32_t seed) {
  const Float4RowLanes<RowFloats> t(n_adds);
#pragma unroll 4
  for (uint32_t s = t.warp; s < t.n_steps; s += t.n_warps) {
    const uint32_t i = s * t.kRowsPerStep + t.sub;
    float4* dst = reinterpret_cast<float4*>(table + static_cast<size_t>(row_of(i, seed, rows)) * RowFloats) + t.col4;
    atomicAdd(dst, t.v);
  }
}

// The register-scatter pattern of a wgmma accumulator (the fused kernel's dK
// before staging): a warp owns 16 rows; instruction j adds columns
// [8j, 8j + 8) of all 16 rows, lanes 2m and 2m+1 holding 4 columns each of row m.
template <int RowFloats>
__global__ void __launch_bounds__(kAtomicThreads) scatter_fragment_kernel(float* __restrict__ table, uint32_t rows,
                                                                           uint32_t n_adds, uint32_t seed) {
  constexpr uint32_t kRowsPerGroup = 16;
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t sub = lane / 2, half = lane & 1u;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t n_warps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t n_groups = n_adds / kRowsPerGroup;
  for (uint32_t g = warp; g < n_groups; g += n_warps) {
    float* dst = table + static_cast<size_t>(row_of(g * kRowsPerGroup + sub, seed, rows)) * RowFloats + 4 * half;
#pragma unroll
    for (int j = 0; j < RowFloats / 8; ++j) {
      const int c = 8 * j + 4 * static_cast<int>(half);
      atomicAdd(reinterpret_cast<float4*>(dst + 8 * j),
                make_float4(value_of_column(c), value_of_column(c + 1), value_of_column(c + 2), value_of_column(c + 3)));
    }
  }
}

__global__ void fill_ones_bf16_kernel(__nv_bfloat16* p, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn(1.0f);
}

// The float4 way with a key read before each add (ScatterWay::gather_float4): lane
// col4 of a row reads 4 bf16 (8 B) of the row's key from `keys` (a (rows, D) bf16
// table of 1.0; L2 only, as the fused op's cp.async.cg gathers) and adds them to its
// 4 payload values, so the add depends on the read. kUnroll steps per warp: their
// reads are issued before their adds, to keep several reads in flight.
template <int RowFloats>
__global__ void __launch_bounds__(kAtomicThreads) gather_scatter_float4_kernel(float* __restrict__ table,
                                                                                const uint2* __restrict__ keys,
                                                                                uint32_t rows, uint32_t n_adds,
                                                                                uint32_t seed) {
  constexpr uint32_t kUnroll = 4;
  const Float4RowLanes<RowFloats> t(n_adds);
  for (uint32_t s0 = t.warp * kUnroll; s0 < t.n_steps; s0 += t.n_warps * kUnroll) {
    uint32_t row[kUnroll];
    uint2 k[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      row[u] = row_of((s0 + u) * t.kRowsPerStep + t.sub, seed, rows);
      k[u] = s0 + u < t.n_steps ? __ldcg(keys + static_cast<size_t>(row[u]) * t.kLanesPerRow + t.col4)
                                : make_uint2(0, 0);
    }
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      if (s0 + u >= t.n_steps) break;
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&k[u].x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&k[u].y));
      float4* dst = reinterpret_cast<float4*>(table + static_cast<size_t>(row[u]) * RowFloats) + t.col4;
      atomicAdd(dst, make_float4(t.v.x + lo.x, t.v.y + lo.y, t.v.z + hi.x, t.v.w + hi.y));
    }
  }
}

// A warp per row, RowFloats/32 scalar adds per lane (column j*32 + lane has the value of column lane).
template <int RowFloats>
__global__ void __launch_bounds__(kAtomicThreads) scatter_scalar_kernel(float* __restrict__ table, uint32_t rows,
                                                                         uint32_t n_adds, uint32_t seed) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t n_warps = (gridDim.x * blockDim.x) >> 5;
  const float v = value_of_column(static_cast<int>(lane));
#pragma unroll 2
  for (uint32_t i = warp; i < n_adds; i += n_warps) {
    float* dst = table + static_cast<size_t>(row_of(i, seed, rows)) * RowFloats + lane;
#pragma unroll
    for (int j = 0; j < RowFloats / 32; ++j) atomicAdd(dst + 32 * j, v);
  }
}

template <int RowFloats>
__global__ void __launch_bounds__(kBulkWarps * 32) scatter_bulk_kernel(float* __restrict__ table, uint32_t rows,
                                                                        uint32_t n_adds, uint32_t seed) {
  extern __shared__ __align__(128) float smem[];
  constexpr int kGroupFloat4s = kBulkRowsPerGroup * RowFloats / 4;
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp_in_block = threadIdx.x >> 5;
  const uint32_t warp = blockIdx.x * kBulkWarps + warp_in_block;
  const uint32_t n_warps = gridDim.x * kBulkWarps;
  const uint32_t n_groups = n_adds / kBulkRowsPerGroup;
  float* ring = smem + static_cast<size_t>(warp_in_block) * kBulkStages * kBulkRowsPerGroup * RowFloats;
  uint32_t stage = 0;
  for (uint32_t g = warp; g < n_groups; g += n_warps) {
    float* buf = ring + stage * kBulkRowsPerGroup * RowFloats;
    // The group that last read this buffer was committed kBulkStages groups ago:
    // allow kBulkStages - 1 newer ones to stay in flight.
    if (lane == 0) cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<kBulkStages - 1>{});
    __syncwarp();
    // Restage the group's rows (as a fused kernel restages every dK block).
#pragma unroll
    for (int k = 0; k < kGroupFloat4s / 32; ++k) {
      const int q = k * 32 + static_cast<int>(lane);
      const int c = 4 * (q % (RowFloats / 4));
      reinterpret_cast<float4*>(buf)[q] =
          make_float4(value_of_column(c), value_of_column(c + 1), value_of_column(c + 2), value_of_column(c + 3));
    }
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // generic-proxy smem writes -> async proxy
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kBulkRowsPerGroup; ++r) {
        const uint32_t row = row_of(g * kBulkRowsPerGroup + r, seed, rows);
        cuda::ptx::cp_reduce_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, cuda::ptx::op_add,
                                        table + static_cast<size_t>(row) * RowFloats, buf + r * RowFloats,
                                        static_cast<uint32_t>(RowFloats * 4));
      }
      cuda::ptx::cp_async_bulk_commit_group();
    }
    stage = stage + 1 == kBulkStages ? 0 : stage + 1;
  }
  // Every reduce complete (not just read) before the CTA's smem goes away.
  if (lane == 0) cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
  __syncwarp();
}

struct Launch {
  int grid, block, smem;
};

template <int RowFloats>
Launch launch_shape(ScatterWay w, int sms) {
  int per_sm = 0;
  Launch l{};
  // The three atomic kernels: kAtomicThreads threads, no shared memory.
  auto atomic_launch = [&](auto kernel) {
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kAtomicThreads, 0),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    return Launch{sms * per_sm, kAtomicThreads, 0};
  };
  switch (w) {
    case ScatterWay::float4_atomic:
      l = atomic_launch(scatter_float4_kernel<RowFloats>);
      break;
    case ScatterWay::float4_fragment:
      l = atomic_launch(scatter_fragment_kernel<RowFloats>);
      break;
    case ScatterWay::gather_float4:
      l = atomic_launch(gather_scatter_float4_kernel<RowFloats>);
      break;
    case ScatterWay::scalar_atomic:
      l = atomic_launch(scatter_scalar_kernel<RowFloats>);
      break;
    case ScatterWay::bulk_reduce:
      check_cuda(cudaFuncSetAttribute(scatter_bulk_kernel<RowFloats>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      bulk_smem_bytes<RowFloats>()),
                 "cudaFuncSetAttribute");
      check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, scatter_bulk_kernel<RowFloats>,
                                                               kBulkWarps * 32, bulk_smem_bytes<RowFloats>()),
                 "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
      l = {sms * per_sm, kBulkWarps * 32, bulk_smem_bytes<RowFloats>()};
      break;
  }
  if (per_sm < 1) {
    throw Error(ErrorCode::internal, "bench", std::string("scatter kernel ") + scatter_way_name(w) +
                                                  " cannot be resident (occupancy 0)");
  }
  return l;
}

template <int RowFloats>
void launch_scatter(ScatterWay w, const Launch& l, float* table, uint32_t rows, uint32_t n_adds, uint32_t seed,
                    cudaStream_t s, const void* keys = nullptr) {
  switch (w) {
    case ScatterWay::gather_float4:
      gather_scatter_float4_kernel<RowFloats>
          <<<l.grid, l.block, 0, s>>>(table, static_cast<const uint2*>(keys), rows, n_adds, seed);
      break;
    case ScatterWay::float4_atomic:
      scatter_float4_kernel<RowFloats><<<l.grid, l.block, 0, s>>>(table, rows, n_adds, seed);
      break;
    case ScatterWay::float4_fragment:
      scatter_fragment_kernel<RowFloats><<<l.grid, l.block, 0, s>>>(table, rows, n_adds, seed);
      break;
    case ScatterWay::scalar_atomic:
      scatter_scalar_kernel<RowFloats><<<l.grid, l.block, 0, s>>>(table, rows, n_adds, seed);
      break;
    case ScatterWay::bulk_reduce:
      scatter_bulk_kernel<RowFloats><<<l.grid, l.block, l.smem, s>>>(table, rows, n_adds, seed);
      break;
  }
  check_cuda(cudaGetLastError(), "scatter kernel launch");
}

// Column sums of a zeroed table after one launch must be n_adds * value_of_column(c), exactly
// (n_adds * (value_of_column(c) + 1) for the gather way, whose keys are all 1.0).
template <int RowFloats>
bool check_scatter(ScatterWay w, const Launch& l, float* d_table, uint64_t rows, uint32_t n_adds, uint32_t seed,
                   cudaStream_t s, const void* keys) {
  const size_t elems = rows * RowFloats;
  check_cuda(cudaMemsetAsync(d_table, 0, elems * 4, s), "cudaMemsetAsync");
  launch_scatter<RowFloats>(w, l, d_table, static_cast<uint32_t>(rows), n_adds, seed, s, keys);
  check_cuda(cudaStreamSynchronize(s), "scatter check launch");
  std::vector<float> h(elems);
  check_cuda(cudaMemcpy(h.data(), d_table, elems * 4, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  std::vector<double> col(RowFloats, 0.0);
  for (uint64_t r = 0; r < rows; ++r)
    for (int c = 0; c < RowFloats; ++c) col[c] += h[r * RowFloats + c];
  const double key = w == ScatterWay::gather_float4 ? 1.0 : 0.0;  // the gather way adds its key (all 1.0)
  for (int c = 0; c < RowFloats; ++c) {
    if (col[c] != static_cast<double>(n_adds) * (value_of_column(c) + key)) return false;
  }
  return true;
}

template <int RowFloats>
std::vector<ScatterResult> measure_scatter_rows(const ScatterConfig& c, const std::vector<ScatterWay>& ways) {
  constexpr uint64_t kRowBytes = RowFloats * 4;
  const uint64_t rows = std::max<uint64_t>(1, c.table_bytes / kRowBytes);
  if (rows > 0xffffffffull) throw Error(ErrorCode::invalid_argument, "table_bytes", "scatter table over 2^32 rows");
  // whole groups for every way: 8 rows (bulk) and 16 rows (fragment)
  const uint64_t adds = c.payload_bytes / kRowBytes / 16 * 16;
  if (adds == 0 || adds > 0xffffffffull) {
    throw Error(ErrorCode::invalid_argument, "payload_bytes", "scatter payload must be 16 rows to 2^32 rows");
  }
  const uint32_t n_adds = static_cast<uint32_t>(adds);
  int dev = 0, sms = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  DeviceBuffer table(rows * kRowBytes);
  Timer timer;
  // The gather way's key table: (rows, D) bf16.
  const bool gathers = std::find(ways.begin(), ways.end(), ScatterWay::gather_float4) != ways.end();
  DeviceBuffer keys(gathers ? rows * RowFloats * 2 : 0);
  if (gathers) {  // every key value 1.0, so the check proves each add used its key
    fill_ones_bf16_kernel<<<1024, 256, 0, timer.stream>>>(keys.as<__nv_bfloat16>(), keys.bytes / 2);
    check_cuda(cudaGetLastError(), "fill kernel launch");
  }
  std::vector<ScatterResult> out;
  for (ScatterWay w : ways) {
    const Launch l = launch_shape<RowFloats>(w, sms);
    ScatterResult r;
    r.table_bytes = rows * kRowBytes;
    r.rows = rows;
    r.row_floats = RowFloats;
    r.way = w;
    r.payload_bytes = static_cast<uint64_t>(n_adds) * kRowBytes;
    r.grid = l.grid;
    r.block = l.block;
    r.check_ok = check_scatter<RowFloats>(w, l, table.as<float>(), rows, n_adds, c.seed, timer.stream, keys.ptr);
    for (int i = 0; i < c.warmup; ++i)
      launch_scatter<RowFloats>(w, l, table.as<float>(), static_cast<uint32_t>(rows), n_adds, c.seed + 1 + i,
                                timer.stream, keys.ptr);
    check_cuda(cudaStreamSynchronize(timer.stream), "scatter warm-up");
    std::vector<float> ms;
    for (int i = 0; i < c.iters; ++i) {
      ms.push_back(timer.time([&] {
        launch_scatter<RowFloats>(w, l, table.as<float>(), static_cast<uint32_t>(rows), n_adds, c.seed + 100 + i,
                                  timer.stream, keys.ptr);
      }));
    }
    r.t = stats_of(ms);
    r.tbps = static_cast<double>(r.payload_bytes) / (r.t.median_ms * 1e-3) / 1e12;
    out.push_back(r);
  }
  return out;
}

// ---- the key-gather floor's ids (gather_floor.cu)
// ids of row t: its first n = min(t + 1, topk) (causal) or topk (random) slots hold
// hashed keys of [0, t] or [0, S); the rest -1. Distinctness does not matter to the rate.
__global__ void key_gather_ids_kernel(int32_t* ids, uint32_t seq, uint32_t topk, bool causal, uint32_t seed) {
  const uint64_t n = static_cast<uint64_t>(seq) * topk;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t t = static_cast<uint32_t>(i / topk), slot = static_cast<uint32_t>(i % topk);
    const uint32_t avail = causal ? t + 1 : seq;
    ids[i] = slot < avail ? static_cast<int32_t>(row_of(static_cast<uint32_t>(i), seed, avail)) : -1;
  }
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

__global__ void fill_e4m3_kernel(__nv_fp8_e4m3* p, size_t n, uint32_t salt) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = __nv_fp8_e4m3(gemm_value(i, salt));
}

float host_e4m3_round(float f) { return static_cast<float>(__nv_fp8_e4m3(f)); }

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

/// Checks one bf16 entry of a GEMM's output (at device address `got_at`) against a host
/// dot product of x(kk) y(kk) over kk < k (the operands as the GEMM read them): clears
/// g.check_ok unless the relative error is <= 1e-2 of max(|dot|, the norm of its terms),
/// and raises g.max_rel_err.
template <class X, class Y>
void check_gemm_entry(GemmResult& g, int k, const __nv_bfloat16* got_at, X&& x, Y&& y) {
  double ref = 0, scale = 0;
  for (int kk = 0; kk < k; ++kk) {
    const double t = static_cast<double>(x(kk)) * static_cast<double>(y(kk));
    ref += t;
    scale += t * t;
  }
  uint16_t got_bits = 0;
  check_cuda(cudaMemcpy(&got_bits, got_at, 2, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  const double got = host_bf16_to_float(got_bits);
  const double rel = std::fabs(got - ref) / std::max(std::fabs(ref), std::sqrt(scale));
  g.max_rel_err = std::max(g.max_rel_err, rel);
  if (!(rel <= 1e-2)) g.check_ok = false;
}

/// Entry p (0..7) of a GEMM check: hashed indices below rows and cols.
int hashed_row(int p, int rows) { return static_cast<int>(mix32(17u * p + 1u) % static_cast<uint32_t>(rows)); }
int hashed_col(int p, int cols) { return static_cast<int>(mix32(31u * p + 7u) % static_cast<uint32_t>(cols)); }

/// The GEMM floors' timing after their check: `warmup` untimed launches of gemm(), then
/// `iters` timed ones; g.t and g.tflops (`flop` per launch).
template <class Gemm>
void time_gemm(GemmResult& g, Timer& timer, Gemm&& gemm, double flop, int iters, int warmup, const char* what) {
  for (int i = 0; i < warmup; ++i) gemm();
  check_cuda(cudaStreamSynchronize(timer.stream), what);
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) ms.push_back(timer.time(gemm));
  g.t = stats_of(ms);
  g.tflops = flop / (g.t.median_ms * 1e-3) / 1e12;
}

/// A cuBLAS handle on a stream, with its workspace; destroyed on scope exit.
struct Cublas {
  cublasHandle_t h = nullptr;
  DeviceBuffer ws{64ull << 20};
  explicit Cublas(cudaStream_t s) {
    check_cublas(cublasCreate(&h), "cublasCreate");
    check_cublas(cublasSetStream(h, s), "cublasSetStream");
    check_cublas(cublasSetWorkspace(h, ws.ptr, ws.bytes), "cublasSetWorkspace");
  }
  Cublas(const Cublas&) = delete;
  Cublas& operator=(const Cublas&) = delete;
  ~Cublas() {
    if (h) cublasDestroy(h);
  }
};

__global__ void fill_f32_kernel(float* p, size_t n, float value) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

__global__ void spin_kernel(uint64_t ns) {
  const uint64_t t0 = cuda::ptx::get_sreg_globaltimer();
  while (cuda::ptx::get_sreg_globaltimer() - t0 < ns) __nanosleep(1000);
}

}  // namespace

void gpu_spin(cudaStream_t s, double us) {
  if (!(us > 0)) return;
  spin_kernel<<<1, 1, 0, s>>>(static_cast<uint64_t>(us * 1e3));
  check_cuda(cudaGetLastError(), "spin kernel launch");
}

std::vector<ScatterResult> measure_scatter(const ScatterConfig& c, const std::vector<ScatterWay>& ways) {
  if (c.iters < 1 || c.warmup < 0) throw Error(ErrorCode::invalid_argument, "iters", "iters >= 1, warmup >= 0");
  switch (c.row_floats) {
    case 64: return measure_scatter_rows<64>(c, ways);
    case 128: return measure_scatter_rows<128>(c, ways);
  }
  throw Error(ErrorCode::invalid_argument, "row_floats",
              "scatter rows of 64 or 128 floats (D), got " + std::to_string(c.row_floats));
}

GemmResult measure_gemm(int size, int iters, int warmup, GemmLayout layout) {
  if (size < 64 || iters < 1 || warmup < 0) {
    throw Error(ErrorCode::invalid_argument, "gemm", "GEMM size >= 64, iters >= 1, warmup >= 0");
  }
  const int n = size;
  GemmResult g;
  g.m = g.n = g.k = n;
  g.layout = layout;
  const size_t elems = static_cast<size_t>(n) * n;
  DeviceBuffer A(elems * 2), B(elems * 2), C(elems * 2);
  Timer timer;
  const uint32_t salt_a = 0xA11CEu, salt_b = 0xB0Bu;
  fill_bf16_kernel<<<1024, 256, 0, timer.stream>>>(A.as<__nv_bfloat16>(), elems, salt_a);
  check_cuda(cudaGetLastError(), "fill kernel launch");
  fill_bf16_kernel<<<1024, 256, 0, timer.stream>>>(B.as<__nv_bfloat16>(), elems, salt_b);
  check_cuda(cudaGetLastError(), "fill kernel launch");
  Cublas blas(timer.stream);
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major C (n x n) = op(A) op(B), every leading dimension n. op T: A stored (k x m),
  // B stored (n x k); op N: A stored (m x k), B stored (k x n).
  const bool ta = layout == GemmLayout::tn || layout == GemmLayout::tt;
  const bool tb = layout == GemmLayout::nt || layout == GemmLayout::tt;
  auto gemm = [&]() {
    check_cublas(cublasGemmEx(blas.h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, n, n, n, &alpha,
                              A.ptr, CUDA_R_16BF, n, B.ptr, CUDA_R_16BF, n, &beta, C.ptr, CUDA_R_16BF, n,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  };
  // Element (i, kk) of op(A) and (kk, j) of op(B) in their storage.
  auto a_at = [&](int i, int kk) { return ta ? static_cast<uint64_t>(i) * n + kk : static_cast<uint64_t>(kk) * n + i; };
  auto b_at = [&](int kk, int j) { return tb ? static_cast<uint64_t>(kk) * n + j : static_cast<uint64_t>(j) * n + kk; };
  // Check a few entries against a host dot product of the same (bf16-rounded) data.
  gemm();
  check_cuda(cudaStreamSynchronize(timer.stream), "GEMM check launch");
  g.check_ok = true;
  for (int p = 0; p < 8; ++p) {
    const int i = hashed_row(p, n), j = hashed_col(p, n);
    check_gemm_entry(g, n, C.as<__nv_bfloat16>() + static_cast<size_t>(j) * n + i,
                     [&](int kk) { return host_bf16_round(gemm_value(a_at(i, kk), salt_a)); },
                     [&](int kk) { return host_bf16_round(gemm_value(b_at(kk, j), salt_b)); });
  }
  time_gemm(g, timer, gemm, 2.0 * n * static_cast<double>(n) * n, iters, warmup, "GEMM warm-up");
  return g;
}

/// A cuBLASLt handle and the descriptors of one fp8 GEMM; destroyed on scope exit.
struct CublasLtE4m3 {
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  CublasLtE4m3() = default;
  CublasLtE4m3(const CublasLtE4m3&) = delete;
  CublasLtE4m3& operator=(const CublasLtE4m3&) = delete;
  ~CublasLtE4m3() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
    if (h) cublasLtDestroy(h);
  }
};

GemmResult measure_gemm_e4m3(int size, int iters, int warmup) {
  if (size < 64 || size % 16 != 0 || iters < 1 || warmup < 0) {
    throw Error(ErrorCode::invalid_argument, "gemm", "e4m3 GEMM size >= 64 and a multiple of 16, iters >= 1, warmup >= 0");
  }
  const int n = size;
  GemmResult g;
  g.m = g.n = g.k = n;
  g.layout = GemmLayout::tn;
  g.e4m3 = true;
  const size_t elems = static_cast<size_t>(n) * n;
  DeviceBuffer A(elems), B(elems), C(elems * 2);
  Timer timer;
  const uint32_t salt_a = 0xA11CEu, salt_b = 0xB0Bu;
  fill_e4m3_kernel<<<1024, 256, 0, timer.stream>>>(A.as<__nv_fp8_e4m3>(), elems, salt_a);
  check_cuda(cudaGetLastError(), "fill kernel launch");
  fill_e4m3_kernel<<<1024, 256, 0, timer.stream>>>(B.as<__nv_fp8_e4m3>(), elems, salt_b);
  check_cuda(cudaGetLastError(), "fill kernel launch");
  // Column-major C (n x n, bf16) = A^T B: A stored (k x m), B stored (k x n), every
  // leading dimension n; no scales (1).
  CublasLtE4m3 lt;
  check_cublas(cublasLtCreate(&lt.h), "cublasLtCreate");
  check_cublas(cublasLtMatmulDescCreate(&lt.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  check_cublas(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t), "TRANSA");
  check_cublas(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn), "TRANSB");
  check_cublas(cublasLtMatrixLayoutCreate(&lt.a, CUDA_R_8F_E4M3, n, n, n), "cublasLtMatrixLayoutCreate (A)");
  check_cublas(cublasLtMatrixLayoutCreate(&lt.b, CUDA_R_8F_E4M3, n, n, n), "cublasLtMatrixLayoutCreate (B)");
  check_cublas(cublasLtMatrixLayoutCreate(&lt.c, CUDA_R_16BF, n, n, n), "cublasLtMatrixLayoutCreate (C)");
  DeviceBuffer ws(64ull << 20);
  cublasLtMatmulPreference_t pref = nullptr;
  check_cublas(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const size_t ws_bytes = ws.bytes;
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                           sizeof ws_bytes);
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(lt.h, lt.op, lt.a, lt.b, lt.c, lt.c, pref, 1, &heuristic, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  check_cublas(st, "cublasLtMatmulAlgoGetHeuristic");
  if (found < 1) throw Error(ErrorCode::internal, "gemm", "cuBLASLt offers no e4m3 GEMM for this device");
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&]() {
    check_cublas(cublasLtMatmul(lt.h, lt.op, &alpha, A.ptr, lt.a, B.ptr, lt.b, &beta, C.ptr, lt.c, C.ptr, lt.c,
                                &heuristic.algo, ws.ptr, ws.bytes, timer.stream),
                 "cublasLtMatmul");
  };
  gemm();
  check_cuda(cudaStreamSynchronize(timer.stream), "GEMM check launch");
  g.check_ok = true;
  for (int p = 0; p < 8; ++p) {
    const int i = hashed_row(p, n), j = hashed_col(p, n);
    check_gemm_entry(g, n, C.as<__nv_bfloat16>() + static_cast<size_t>(j) * n + i,
                     [&](int kk) { return host_e4m3_round(gemm_value(static_cast<uint64_t>(i) * n + kk, salt_a)); },
                     [&](int kk) { return host_e4m3_round(gemm_value(static_cast<uint64_t>(j) * n + kk, salt_b)); });
  }
  time_gemm(g, timer, gemm, 2.0 * n * static_cast<double>(n) * n, iters, warmup, "GEMM warm-up");
  return g;
}

std::vector<GemmResult> measure_gemm_layouts(int size, int iters, int warmup) {
  std::vector<GemmResult> out;
  for (GemmLayout l : kAllGemmLayouts) out.push_back(measure_gemm(size, iters, warmup, l));
  return out;
}

const GemmResult& fastest(const std::vector<GemmResult>& results) {
  const GemmResult* best = nullptr;
  for (const GemmResult& r : results) {
    if (r.check_ok && (!best || r.tflops > best->tflops)) best = &r;
  }
  if (!best) throw Error(ErrorCode::internal, "bench", "GEMM: no layout passed its check");
  return *best;
}

const char* gemm_layout_name(GemmLayout l) {
  switch (l) {
    case GemmLayout::tn: return "TN";
    case GemmLayout::nn: return "NN";
    case GemmLayout::nt: return "NT";
    case GemmLayout::tt: return "TT";
  }
  return "?";
}

GemmResult measure_gemm_batched(int m, int n, int k, int batch, int iters, int warmup) {
  if (m < 1 || n < 1 || k < 1 || batch < 1 || iters < 1 || warmup < 0) {
    throw Error(ErrorCode::invalid_argument, "gemm", "batched GEMM: m, n, k, batch >= 1, iters >= 1, warmup >= 0");
  }
  GemmResult g;
  g.m = m, g.n = n, g.k = k, g.batch = batch;
  // Per entry b: C_b (n x m, column-major: m columns of n) = B^T A_b with B (n keys x k)
  // shared by every entry and A_b (m heads x k) its own: "TN" with the keys as cuBLAS's M.
  const size_t a_elems = static_cast<size_t>(m) * k * batch, b_elems = static_cast<size_t>(n) * k;
  const size_t c_elems = static_cast<size_t>(m) * n * batch;
  DeviceBuffer A(a_elems * 2), B(b_elems * 2), C(c_elems * 2);
  Timer timer;
  const uint32_t salt_a = 0xA11CEu, salt_b = 0xB0Bu;
  fill_bf16_kernel<<<1024, 256, 0, timer.stream>>>(A.as<__nv_bfloat16>(), a_elems, salt_a);
  check_cuda(cudaGetLastError(), "fill kernel launch");
  fill_bf16_kernel<<<1024, 256, 0, timer.stream>>>(B.as<__nv_bfloat16>(), b_elems, salt_b);
  check_cuda(cudaGetLastError(), "fill kernel launch");
  Cublas blas(timer.stream);
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&]() {
    check_cublas(cublasGemmStridedBatchedEx(blas.h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, B.ptr, CUDA_R_16BF, k, 0,
                                            A.ptr, CUDA_R_16BF, k, static_cast<long long>(m) * k, &beta, C.ptr,
                                            CUDA_R_16BF, n, static_cast<long long>(m) * n, batch, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT),
                 "cublasGemmStridedBatchedEx");
  };
  gemm();
  check_cuda(cudaStreamSynchronize(timer.stream), "batched GEMM check launch");
  g.check_ok = true;
  for (int p = 0; p < 8; ++p) {
    const int key = hashed_row(p, n), head = hashed_col(p, m);
    const int b = p % 2 == 0 ? 0 : batch - 1;
    check_gemm_entry(g, k, C.as<__nv_bfloat16>() + (static_cast<size_t>(b) * m + head) * n + key,
                     [&](int kk) { return host_bf16_round(gemm_value((static_cast<uint64_t>(b) * m + head) * k + kk, salt_a)); },
                     [&](int kk) { return host_bf16_round(gemm_value(static_cast<uint64_t>(key) * k + kk, salt_b)); });
  }
  time_gemm(g, timer, gemm, 2.0 * m * static_cast<double>(n) * k * batch, iters, warmup, "batched GEMM warm-up");
  return g;
}

void fill_device_bf16(void* p, uint64_t n, uint32_t salt, void* stream) {
  fill_bf16_kernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<__nv_bfloat16*>(p), n, salt);
  check_cuda(cudaGetLastError(), "fill kernel launch");
}

void fill_device_e4m3(void* p, uint64_t n, uint32_t salt, void* stream) {
  fill_e4m3_kernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<__nv_fp8_e4m3*>(p), n, salt);
  check_cuda(cudaGetLastError(), "fill kernel launch");
}

void fill_device_f32(float* p, uint64_t n, float value, void* stream) {
  fill_f32_kernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(p, n, value);
  check_cuda(cudaGetLastError(), "fill kernel launch");
}

void fill_device_gather_ids(int32_t* ids, int64_t seq, int64_t topk, bool causal, uint32_t seed, void* stream) {
  key_gather_ids_kernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      ids, static_cast<uint32_t>(seq), static_cast<uint32_t>(topk), causal, seed);
  check_cuda(cudaGetLastError(), "ids kernel launch");
}

}  // namespace dsaib::bench
