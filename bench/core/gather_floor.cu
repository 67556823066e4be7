// dsaib_bench: the key-gather floor, sm_90a only. Per query row of a (S, topk) id table,
// its valid slots' key rows (row_bytes = D*2 bytes each, D a multiple of 64 up to 576)
// brought into the SM, three ways, each at a few depths and CTA counts; the floor is
// the fastest that passed its check:
//   vector    per warp, 16-byte ld.global.cg per lane into registers (a 256-byte row is
//             16 lanes, so a warp instruction reads two rows at D 128), `depth` loads per
//             lane issued before the first is used; 256 threads per CTA
//   cp.async  per warp, 16-byte cp.async.cg per lane into a shared-memory ring of `depth`
//             512-byte stages, one commit group per warp step, at most depth - 1 groups
//             pending when the next is issued; 256 threads per CTA
//   bulk      per warp, one cp.async.bulk (global -> shared, no tensor map) per row into a
//             ring of `depth` stages of up to 32 rows, each stage completing on its own
//             mbarrier (expect_tx of its bytes); 128 threads per CTA
// Work: the slots of each row in units of 64, numbered segment-major (unit u of segment s
// is row lo(s) + u, where lo(s) = 64 s for causal ids, whose row t has min(t+1, topk)
// valid slots, and 0 for random ids), so that no unit is empty; warp g of W takes units
// g, g + W, ... and loads the next unit's 64 ids (two coalesced 128-byte reads) before it
// gathers the current one, so id reads never wait in front of the key reads. Every way
// sums the 32-bit words it read (its shared-memory copies in a check launch), and the
// sum is compared with a plain reference over the same ids.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cuda/ptx>
#include <string>
#include <vector>

#include "bench_core.hpp"
#include "cuda_check.hpp"

namespace dsaib::bench {
namespace {

constexpr uint32_t kFull = 0xffffffffu;
constexpr uint32_t kUnitSlots = 64;         // slots per unit of work (two id batches of 32)
constexpr int kWarpThreads = 256;           // vector and cp.async ways
constexpr int kBulkThreads = 128;           // bulk way
constexpr uint32_t kRingStageBytes = 512;   // one warp step of 16 bytes per lane
constexpr uint32_t kBulkStageBudget = 8192; // bytes of one bulk stage (rows per stage: a power of 2 up to 32)
constexpr uint32_t kWaitPolls = 1u << 20;   // an mbarrier wait gives up (and flags it) after this many polls

struct GatherParams {
  const uint8_t* keys;    // (seq, row_bytes)
  const int32_t* ids;     // (seq, topk), -1 beyond a causal row's valid slots
  uint32_t seq, topk;
  uint32_t row_bytes;     // D * 2, a multiple of 128
  uint32_t chunks;        // row_bytes / 16
  uint32_t causal;
  uint32_t check;         // nonzero: read back what was copied (the cp.async and bulk ways)
  uint32_t rows_per_stage;  // bulk way
  uint32_t max_slots;     // valid slots of a full row: min(topk, seq)
  uint32_t* warp_sums;    // per warp: the sum of the words it read (stored by lane 0)
  unsigned int* gave_up;  // set when an mbarrier wait gave up
};

// The units of one warp, segment-major: unit (seg, row) covers slots
// [64 seg, min(64 seg + 64, n(row))) of row `row`.
struct UnitCursor {
  uint32_t seg = 0, row = 0;
  bool valid = false;

  __device__ static uint32_t lo(const GatherParams& p, uint32_t s) { return p.causal ? s * kUnitSlots : 0u; }
  __device__ static uint32_t segments(const GatherParams& p) { return (p.max_slots + kUnitSlots - 1) / kUnitSlots; }
  __device__ void settle(const GatherParams& p) {
    const uint32_t nseg = segments(p);
    while (valid && row >= p.seq) {
      const uint32_t excess = row - p.seq;
      ++seg;
      if (seg >= nseg || lo(p, seg) >= p.seq) {
        valid = false;
        break;
      }
      row = lo(p, seg) + excess;
    }
  }
  __device__ void start(const GatherParams& p, uint32_t u) {
    seg = 0;
    row = lo(p, 0) + u;
    valid = p.seq > 0 && p.topk > 0;
    settle(p);
  }
  __device__ void advance(const GatherParams& p, uint32_t by) {
    row += by;
    settle(p);
  }
  /// Valid slots of this unit, 1..64.
  __device__ uint32_t slots(const GatherParams& p) const {
    const uint32_t n = p.causal ? min(row + 1, p.max_slots) : p.max_slots;
    return min(kUnitSlots, n - seg * kUnitSlots);
  }
};

/// The 64 ids of a unit: lane l holds slot l in `a` and slot 32 + l in `b` (0 where invalid).
struct UnitIds {
  int32_t a = 0, b = 0;
  uint32_t n = 0;
};

__device__ __forceinline__ UnitIds load_unit_ids(const GatherParams& p, const UnitCursor& u, uint32_t lane) {
  UnitIds r;
  if (!u.valid) return r;
  r.n = u.slots(p);
  const int32_t* at = p.ids + static_cast<size_t>(u.row) * p.topk + u.seg * kUnitSlots;
  r.a = lane < r.n ? __ldg(at + lane) : 0;
  r.b = lane + 32 < r.n ? __ldg(at + 32 + lane) : 0;
  return r;
}

__device__ __forceinline__ uint32_t word_sum(uint4 v) { return v.x + v.y + v.z + v.w; }

/// The warp's sum into its own entry (no atomics: a launch of thousands of warps would queue
/// on one address).
__device__ __forceinline__ void store_warp_sum(const GatherParams& p, uint32_t warp, uint32_t lane, uint32_t sum) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFull, sum, o);
  if (lane == 0) p.warp_sums[warp] = sum;
}

/// One warp's pass over its units: `gather(ids)` runs on each unit while the next unit's ids load.
template <typename Gather>
__device__ __forceinline__ void for_each_unit(const GatherParams& p, uint32_t warp, uint32_t warps, uint32_t lane,
                                              Gather&& gather) {
  UnitCursor cur;
  cur.start(p, warp);
  UnitIds ids = load_unit_ids(p, cur, lane);
  while (cur.valid) {
    UnitCursor next = cur;
    next.advance(p, warps);
    const UnitIds next_ids = load_unit_ids(p, next, lane);
    gather(ids);
    cur = next;
    ids = next_ids;
  }
}

/// Slot and 16-byte chunk of lane `lane` at warp step k of a batch of 32 slots.
template <int Chunks>
__device__ __forceinline__ void step_place(uint32_t k, uint32_t lane, uint32_t chunks, uint32_t* slot,
                                           uint32_t* chunk) {
  const uint32_t c = k * 32 + lane;
  const uint32_t n = Chunks ? static_cast<uint32_t>(Chunks) : chunks;
  *slot = c / n;
  *chunk = c - *slot * n;
}

// ---- vector: 16-byte loads into registers
template <int Chunks, int Depth>
__global__ void __launch_bounds__(kWarpThreads, 1) gather_vector_kernel(GatherParams p) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, warps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t chunks = Chunks ? static_cast<uint32_t>(Chunks) : p.chunks;
  uint32_t sum = 0;
  for_each_unit(p, warp, warps, lane, [&](const UnitIds& u) {
#pragma unroll 1
    for (uint32_t half = 0; half < 2; ++half) {
      const uint32_t base = half * 32;
      if (base >= u.n) break;
      const int32_t batch = half ? u.b : u.a;
#pragma unroll 1
      for (uint32_t k0 = 0; k0 < chunks; k0 += Depth) {
        uint4 v[Depth];
#pragma unroll
        for (int i = 0; i < Depth; ++i) {
          uint32_t slot, chunk;
          step_place<Chunks>(k0 + i, lane, chunks, &slot, &chunk);
          const int32_t id = __shfl_sync(kFull, batch, slot & 31u);
          const bool ok = k0 + i < chunks && base + slot < u.n;
          v[i] = ok ? __ldcg(reinterpret_cast<const uint4*>(p.keys + static_cast<size_t>(id) * p.row_bytes) + chunk)
                    : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < Depth; ++i) sum += word_sum(v[i]);
      }
    }
  });
  store_warp_sum(p, warp, lane, sum);
}

// ---- cp.async: 16-byte copies into a ring of 512-byte stages per warp
template <int Chunks, int Depth>
__global__ void __launch_bounds__(kWarpThreads) gather_ring_kernel(GatherParams p) {
  extern __shared__ __align__(128) uint8_t ring_smem[];
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, warps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t chunks = Chunks ? static_cast<uint32_t>(Chunks) : p.chunks;
  uint8_t* ring = ring_smem + (threadIdx.x >> 5) * Depth * kRingStageBytes + lane * 16;
  const uint32_t ring0 = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  uint32_t step = 0, sum = 0;
  for_each_unit(p, warp, warps, lane, [&](const UnitIds& u) {
#pragma unroll 1
    for (uint32_t half = 0; half < 2; ++half) {
      const uint32_t base = half * 32;
      if (base >= u.n) break;
      const int32_t batch = half ? u.b : u.a;
#pragma unroll 1
      for (uint32_t k = 0; k < chunks; ++k) {
        uint32_t slot, chunk;
        step_place<Chunks>(k, lane, chunks, &slot, &chunk);
        const int32_t id = __shfl_sync(kFull, batch, slot);
        const bool ok = base + slot < u.n;
        const uint8_t* src = p.keys + static_cast<size_t>(ok ? id : 0) * p.row_bytes + chunk * 16;
        const uint32_t stage = step % Depth;
        // Invalid slots copy nothing and zero-fill their 16 bytes (source size 0).
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(ring0 + stage * kRingStageBytes),
                     "l"(src), "r"(ok ? 16 : 0)
                     : "memory");
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        if (p.check) {
          // Read back this copy once it has landed (each lane reads only its own 16 bytes).
          asm volatile("cp.async.wait_group 0;\n" ::: "memory");
          sum += word_sum(*reinterpret_cast<const uint4*>(ring + stage * kRingStageBytes));
        } else {
          asm volatile("cp.async.wait_group %0;\n" ::"n"(Depth - 1) : "memory");
        }
        ++step;
      }
    }
  });
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  store_warp_sum(p, warp, lane, sum);
}

// ---- bulk: one cp.async.bulk per row into a ring of mbarrier-guarded stages per warp
__device__ __forceinline__ bool wait_phase(uint64_t* bar, uint32_t parity) {
  for (uint32_t polls = 0; polls < kWaitPolls; ++polls) {
    if (cuda::ptx::mbarrier_try_wait_parity(bar, parity)) return true;
  }
  return false;
}

__host__ __device__ constexpr uint32_t bulk_bars_bytes(int depth) { return (kBulkThreads / 32) * depth * 8 <= 128 ? 128 : 256; }

template <int Depth>
__global__ void __launch_bounds__(kBulkThreads) gather_bulk_kernel(GatherParams p) {
  extern __shared__ __align__(128) uint8_t bulk_smem[];
  static_assert((kBulkThreads / 32) * Depth * 8 <= 256, "mbarriers fit in their 256 bytes");
  const uint32_t lane = threadIdx.x & 31u, warp_in_block = threadIdx.x >> 5;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, warps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t rps = p.rows_per_stage, stage_bytes = rps * p.row_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(bulk_smem) + warp_in_block * Depth;
  uint8_t* ring = bulk_smem + bulk_bars_bytes(Depth) + warp_in_block * Depth * stage_bytes;
  if (lane == 0) {
    for (int s = 0; s < Depth; ++s) cuda::ptx::mbarrier_init(&bars[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  __syncwarp();
  uint32_t use = 0, sum = 0, gave_up = 0;
  for_each_unit(p, warp, warps, lane, [&](const UnitIds& u) {
#pragma unroll 1
    for (uint32_t first = 0; first < u.n; first += rps) {
      const uint32_t rows = min(rps, u.n - first);
      const uint32_t stage = use % Depth;
      // The stage's previous copies have landed before it is refilled.
      if (use >= Depth && !wait_phase(&bars[stage], (use / Depth - 1) & 1u)) gave_up = 1;
      if (lane == 0) {
        cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                             &bars[stage], rows * p.row_bytes);
      }
      __syncwarp();
      const uint32_t slot = first + (lane % rps);
      const int32_t id = __shfl_sync(kFull, first < 32 ? u.a : u.b, slot & 31u);  // a stage lies in one batch
      uint8_t* dst = ring + stage * stage_bytes;
      if (lane < rows) {
        cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, dst + lane * p.row_bytes,
                                 p.keys + static_cast<size_t>(id) * p.row_bytes, p.row_bytes, &bars[stage]);
      }
      if (p.check) {
        if (!wait_phase(&bars[stage], (use / Depth) & 1u)) gave_up = 1;
        const uint32_t words = rows * p.chunks;
        for (uint32_t c = lane; c < words; c += 32) sum += word_sum(reinterpret_cast<const uint4*>(dst)[c]);
        __syncwarp();
      }
      ++use;
    }
  });
  // Every copy has landed before the CTA's shared memory goes away.
  for (uint32_t s = 0; s < Depth && s < use; ++s) {
    const uint32_t last = use - 1 - ((use - 1 - s) % Depth);  // the last use of stage (last % Depth)
    if (!wait_phase(&bars[last % Depth], (last / Depth) & 1u)) gave_up = 1;
  }
  store_warp_sum(p, warp, lane, sum);
  if (gave_up) atomicOr(p.gave_up, 1u);
}

// ---- the reference: the same sum of words over every valid slot, plainly
__global__ void key_word_sums_kernel(const uint8_t* keys, uint32_t seq, uint32_t row_bytes, uint32_t* sums) {
  for (uint32_t r = blockIdx.x * blockDim.x + threadIdx.x; r < seq; r += gridDim.x * blockDim.x) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(keys + static_cast<size_t>(r) * row_bytes);
    uint32_t s = 0;
    for (uint32_t i = 0; i < row_bytes / 4; ++i) s += w[i];
    sums[r] = s;
  }
}

__global__ void reference_sum_kernel(const int32_t* ids, const uint32_t* row_sums, uint32_t seq, uint32_t topk,
                                     uint32_t causal, unsigned int* out) {
  const uint64_t n = static_cast<uint64_t>(seq) * topk;
  const uint32_t max_slots = min(topk, seq);
  uint32_t s = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t t = static_cast<uint32_t>(i / topk), slot = static_cast<uint32_t>(i % topk);
    if (slot < (causal ? min(t + 1, max_slots) : max_slots)) s += row_sums[ids[i]];
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
  if ((threadIdx.x & 31u) == 0) atomicAdd(out, s);
}

// ---- variants and launches
struct Variant {
  GatherMethod method;
  int depth;        // vector: loads in flight per lane; cp.async and bulk: ring stages per warp
  int ctas_per_sm;  // 0: as many as fit
};
constexpr Variant kVariants[] = {
    {GatherMethod::vector_loads, 4, 0},   {GatherMethod::vector_loads, 8, 0},   {GatherMethod::vector_loads, 16, 1},
    {GatherMethod::vector_loads, 16, 0},  {GatherMethod::cp_async_ring, 4, 0},  {GatherMethod::cp_async_ring, 8, 1},
    {GatherMethod::cp_async_ring, 8, 0},  {GatherMethod::cp_async_ring, 16, 1}, {GatherMethod::cp_async_ring, 16, 0},
    {GatherMethod::bulk_copy, 2, 0},      {GatherMethod::bulk_copy, 4, 1},      {GatherMethod::bulk_copy, 4, 0},
};

using KernelFn = void (*)(GatherParams);

template <int Chunks>
KernelFn vector_kernel(int depth) {
  switch (depth) {
    case 4: return gather_vector_kernel<Chunks, 4>;
    case 8: return gather_vector_kernel<Chunks, 8>;
    case 16: return gather_vector_kernel<Chunks, 16>;
  }
  return nullptr;
}
template <int Chunks>
KernelFn ring_kernel(int depth) {
  switch (depth) {
    case 4: return gather_ring_kernel<Chunks, 4>;
    case 8: return gather_ring_kernel<Chunks, 8>;
    case 16: return gather_ring_kernel<Chunks, 16>;
  }
  return nullptr;
}

/// The kernel of a variant at a row of `chunks` 16-byte chunks (8 and 16: D 64 and 128, compiled
/// for that width; others read the width from the parameters).
KernelFn kernel_of(const Variant& v, uint32_t chunks) {
  switch (v.method) {
    case GatherMethod::vector_loads:
      return chunks == 8 ? vector_kernel<8>(v.depth) : chunks == 16 ? vector_kernel<16>(v.depth) : vector_kernel<0>(v.depth);
    case GatherMethod::cp_async_ring:
      return chunks == 8 ? ring_kernel<8>(v.depth) : chunks == 16 ? ring_kernel<16>(v.depth) : ring_kernel<0>(v.depth);
    case GatherMethod::bulk_copy:
      return v.depth == 2 ? gather_bulk_kernel<2> : v.depth == 4 ? gather_bulk_kernel<4> : nullptr;
  }
  return nullptr;
}

uint32_t bulk_rows_per_stage(uint32_t row_bytes) {
  uint32_t r = 32;
  while (r > 1 && r * row_bytes > kBulkStageBudget) r /= 2;
  return r;
}

struct Shape {
  int block = 0, smem = 0, grid = 0, per_sm = 0;
};

Shape shape_of(const Variant& v, KernelFn k, uint32_t row_bytes, int sms) {
  Shape s;
  switch (v.method) {
    case GatherMethod::vector_loads: s = {kWarpThreads, 0}; break;
    case GatherMethod::cp_async_ring: s = {kWarpThreads, (kWarpThreads / 32) * v.depth * static_cast<int>(kRingStageBytes)}; break;
    case GatherMethod::bulk_copy:
      s = {kBulkThreads, static_cast<int>(bulk_bars_bytes(v.depth) + (kBulkThreads / 32) * v.depth *
                                                                          bulk_rows_per_stage(row_bytes) * row_bytes)};
      break;
  }
  check_cuda(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, s.smem),
             "cudaFuncSetAttribute (key gather)");
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&s.per_sm, k, s.block, s.smem),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor (key gather)");
  if (s.per_sm < 1) {
    throw Error(ErrorCode::internal, "bench", std::string("key gather ") + gather_method_name(v.method) +
                                                  " cannot be resident (occupancy 0)");
  }
  if (v.ctas_per_sm > 0) s.per_sm = std::min(s.per_sm, v.ctas_per_sm);
  s.grid = sms * s.per_sm;
  return s;
}

}  // namespace

const char* gather_method_name(GatherMethod m) {
  switch (m) {
    case GatherMethod::vector_loads: return "vector";
    case GatherMethod::cp_async_ring: return "cp.async";
    case GatherMethod::bulk_copy: return "bulk";
  }
  return "?";
}

std::string gather_variant_name(const KeyGatherResult& r) {
  const std::string d = std::to_string(r.depth);
  const std::string what = r.method == GatherMethod::vector_loads ? d + " loads in flight per lane"
                                                                   : d + " stages per warp";
  return std::string(gather_method_name(r.method)) + ", " + what + ", " + std::to_string(r.block) + " threads x " +
         std::to_string(r.ctas_per_sm) + " CTA" + (r.ctas_per_sm == 1 ? "" : "s") + " per SM";
}

std::vector<KeyGatherResult> measure_key_gather(const KeyGatherConfig& c) {
  if (c.iters < 1 || c.warmup < 0 || c.input_sets < 0) {
    throw Error(ErrorCode::invalid_argument, "iters", "iters >= 1, warmup >= 0, input_sets >= 0");
  }
  if (c.dim < 64 || c.dim > 576 || c.dim % 64 != 0) {
    throw Error(ErrorCode::invalid_argument, "dim",
                "key gather: D a multiple of 64 from 64 to 576, got " + std::to_string(c.dim));
  }
  if (c.seq < 1 || c.topk < 1 || c.seq > (1ll << 30) || c.topk > (1ll << 20) || c.seq * c.topk > (1ll << 36)) {
    throw Error(ErrorCode::invalid_argument, "seq", "key gather: 1 <= seq <= 2^30, 1 <= topk <= 2^20, seq*topk <= 2^36");
  }
  int dev = 0, sms = 0, l2 = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "cudaDeviceGetAttribute");
  size_t free_b = 0, total_b = 0;
  check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const uint32_t seq = static_cast<uint32_t>(c.seq), topk = static_cast<uint32_t>(c.topk);
  const uint32_t row_bytes = static_cast<uint32_t>(c.dim) * 2;
  const uint64_t key_bytes = static_cast<uint64_t>(seq) * row_bytes, id_bytes = static_cast<uint64_t>(seq) * topk * 4;
  const int sets = c.input_sets > 0 ? c.input_sets : auto_input_sets(key_bytes + id_bytes, l2, free_b);

  Timer timer;
  // Input sets: keys of hashed bf16 values (so a wrong row changes the sum), ids of the
  // pattern; set 0 generated, the others device copies of it at other addresses.
  std::vector<DeviceBuffer> keys, ids;
  for (int s = 0; s < sets; ++s) {
    keys.emplace_back(key_bytes);
    ids.emplace_back(id_bytes);
    if (s == 0) {
      fill_device_bf16(keys[0].ptr, key_bytes / 2, 0x6A7Eu, timer.stream);
      fill_device_gather_ids(ids[0].as<int32_t>(), c.seq, c.topk, c.causal, c.seed, timer.stream);
    } else {
      check_cuda(cudaMemcpyAsync(keys[s].ptr, keys[0].ptr, key_bytes, cudaMemcpyDeviceToDevice, timer.stream),
                 "cudaMemcpyAsync (key gather inputs)");
      check_cuda(cudaMemcpyAsync(ids[s].ptr, ids[0].ptr, id_bytes, cudaMemcpyDeviceToDevice, timer.stream),
                 "cudaMemcpyAsync (key gather inputs)");
    }
  }
  // The reference sum over set 0.
  DeviceBuffer row_sums(static_cast<size_t>(seq) * 4), reference(sizeof(unsigned int)), gave_up(sizeof(unsigned int));
  check_cuda(cudaMemsetAsync(reference.ptr, 0, reference.bytes, timer.stream), "cudaMemsetAsync");
  key_word_sums_kernel<<<1024, 256, 0, timer.stream>>>(keys[0].as<uint8_t>(), seq, row_bytes, row_sums.as<uint32_t>());
  check_cuda(cudaGetLastError(), "key gather reference launch");
  reference_sum_kernel<<<2048, 256, 0, timer.stream>>>(ids[0].as<int32_t>(), row_sums.as<uint32_t>(), seq, topk,
                                                       c.causal ? 1u : 0u, reference.as<unsigned int>());
  check_cuda(cudaGetLastError(), "key gather reference launch");
  unsigned int want = 0;
  check_cuda(cudaMemcpyAsync(&want, reference.ptr, sizeof want, cudaMemcpyDeviceToHost, timer.stream),
             "cudaMemcpyAsync D2H");
  check_cuda(cudaStreamSynchronize(timer.stream), "key gather inputs");

  const uint32_t max_slots = std::min(seq, topk);
  double slots = 0;  // valid slots over all rows
  for (int64_t t = 0; t < c.seq; ++t) slots += static_cast<double>(c.causal ? std::min<int64_t>(t + 1, max_slots) : max_slots);

  GatherParams p{};
  p.seq = seq;
  p.topk = topk;
  p.row_bytes = row_bytes;
  p.chunks = row_bytes / 16;
  p.causal = c.causal ? 1u : 0u;
  p.rows_per_stage = bulk_rows_per_stage(row_bytes);
  p.max_slots = max_slots;
  p.gave_up = gave_up.as<unsigned int>();

  std::vector<KeyGatherResult> out;
  for (const Variant& v : kVariants) {
    const KernelFn k = kernel_of(v, p.chunks);
    const Shape sh = shape_of(v, k, row_bytes, sms);
    // A capped variant that runs as many CTAs as the uncapped one is the same measurement.
    const bool same = std::any_of(out.begin(), out.end(), [&](const KeyGatherResult& r) {
      return r.method == v.method && r.depth == v.depth && r.grid == sh.grid;
    });
    if (same) continue;
    const size_t warps = static_cast<size_t>(sh.grid) * (sh.block / 32);
    DeviceBuffer warp_sums(warps * 4);
    int launches = 0;
    auto launch = [&](bool check) {
      GatherParams q = p;
      q.keys = keys[launches % sets].as<uint8_t>();
      q.ids = ids[launches % sets].as<int32_t>();
      q.check = check ? 1u : 0u;
      q.warp_sums = warp_sums.as<uint32_t>();
      ++launches;
      k<<<sh.grid, sh.block, sh.smem, timer.stream>>>(q);
      check_cuda(cudaGetLastError(), "key gather kernel launch");
    };
    KeyGatherResult r;
    r.method = v.method;
    r.depth = v.depth;
    r.ctas_per_sm = sh.per_sm;
    r.grid = sh.grid;
    r.block = sh.block;
    r.smem_bytes = sh.smem;
    r.seq = c.seq;
    r.topk = c.topk;
    r.dim = c.dim;
    r.causal = c.causal;
    r.input_sets = sets;
    r.valid_slots_per_row = slots / static_cast<double>(c.seq);
    // The check launch: set 0, the copies read back; every warp's sum together must be the reference's.
    check_cuda(cudaMemsetAsync(gave_up.ptr, 0, gave_up.bytes, timer.stream), "cudaMemsetAsync");
    launch(true);
    std::vector<uint32_t> sums(warps);
    unsigned int flag = 0;
    check_cuda(cudaMemcpyAsync(sums.data(), warp_sums.ptr, warps * 4, cudaMemcpyDeviceToHost, timer.stream),
               "cudaMemcpyAsync D2H");
    check_cuda(cudaMemcpyAsync(&flag, gave_up.ptr, sizeof flag, cudaMemcpyDeviceToHost, timer.stream),
               "cudaMemcpyAsync D2H");
    check_cuda(cudaStreamSynchronize(timer.stream), "key gather check launch");
    uint32_t got = 0;
    for (uint32_t s : sums) got += s;
    r.check_ok = got == want && flag == 0;
    launches = 0;
    for (int i = 0; i < c.warmup; ++i) launch(false);
    check_cuda(cudaStreamSynchronize(timer.stream), "key gather warm-up");
    std::vector<float> ms;
    for (int i = 0; i < c.iters; ++i) ms.push_back(timer.time([&] { launch(false); }));
    check_cuda(cudaMemcpy(&flag, gave_up.ptr, sizeof flag, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    if (flag != 0) r.check_ok = false;  // a timed launch's wait gave up
    r.t = stats_of(ms);
    r.ns_per_row = r.t.median_ms * 1e6 / static_cast<double>(c.seq);
    r.tbps = slots * row_bytes / (r.t.median_ms * 1e-3) / 1e12;
    out.push_back(r);
  }
  return out;
}

const KeyGatherResult& fastest(const std::vector<KeyGatherResult>& results) {
  const KeyGatherResult* best = nullptr;
  for (const KeyGatherResult& r : results) {
    if (r.check_ok && (!best || r.ns_per_row < best->ns_per_row)) best = &r;
  }
  if (!best) throw Error(ErrorCode::internal, "bench", "key gather: no way passed its check");
  return *best;
}

const KeyGatherResult* fastest_of(const std::vector<KeyGatherResult>& results, GatherMethod m) {
  const KeyGatherResult* best = nullptr;
  for (const KeyGatherResult& r : results) {
    if (r.method == m && r.check_ok && (!best || r.ns_per_row < best->ns_per_row)) best = &r;
  }
  return best;
}

}  // namespace dsaib::bench
