// dsaib_bench: the fp32 scatter-add floor, sm_90a only. Rows of D floats (D = 64 or 128)
// added into rows of an fp32 (R, D) table chosen by a hash of the row-add index, three ways
// (float4 atomicAdd, scalar atomicAdd, cp.reduce.async.bulk add.f32); payload values made in
// registers; rate = bytes added / time. Each way is checked once: exact column sums.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cuda/ptx>
#include <string>
#include <vector>

#include "bench_core.hpp"
#include "bench_hash.cuh"
#include "cuda_check.hpp"

namespace dsaib::bench {
namespace {

constexpr int kAtomicThreads = 256;   // float4 / scalar kernels
constexpr int kBulkWarps = 4;         // bulk kernel: 128 threads
constexpr int kBulkRowsPerGroup = 8;  // rows staged and issued per group
constexpr int kBulkStages = 4;        // staging ring per warp: up to 4 groups in flight

template <int RowFloats>
constexpr int bulk_smem_bytes() {  // 64 KiB at D128, 32 KiB at D64
  return kBulkWarps * kBulkStages * kBulkRowsPerGroup * RowFloats * 4;
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

}  // namespace

std::vector<ScatterResult> measure_scatter(const ScatterConfig& c, const std::vector<ScatterWay>& ways) {
  if (c.iters < 1 || c.warmup < 0) throw Error(ErrorCode::invalid_argument, "iters", "iters >= 1, warmup >= 0");
  switch (c.row_floats) {
    case 64: return measure_scatter_rows<64>(c, ways);
    case 128: return measure_scatter_rows<128>(c, ways);
  }
  throw Error(ErrorCode::invalid_argument, "row_floats",
              "scatter rows of 64 or 128 floats (D), got " + std::to_string(c.row_floats));
}

}  // namespace dsaib::bench
