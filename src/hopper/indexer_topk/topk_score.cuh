// Score role of the top-k forward (warpgroups 1 and 2; docs/indexer-topk.md,
// "The sm_90a kernel"). Each warpgroup owns half of the task's rows and takes
// every K tile of the task against them, so that a row's candidates, bound and
// cuts live in one warpgroup and its bound follows the whole row. Per tile: the
// GEMM I^T (64 keys, the warpgroup's rows x heads) = K Q^T into one of two
// accumulators, the next tile's GEMM issued into the other before this one's
// ReLU and weighted head sum in registers (two quad shuffles); then every
// visible key whose rank key reaches the row's admission bound is appended to
// the row's candidate buffer (global memory, each CTA its own). A buffer that
// could overflow on the next tile is cut (candidate_select.cuh) to at most
// halfway between topk and that size, its topk largest keys among them, which
// raises the bound. At the task's end each row's topk largest keys are written,
// unordered, for the ordering kernel.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cute/tensor.hpp>

#include "hopper/common/kernel_params.hpp"
#include "hopper/common/problem_device.cuh"
#include "hopper/common/warpgroup_gemm.cuh"
#include "hopper/indexer_topk/candidate_select.cuh"
#include "hopper/indexer_topk/topk_rank_key.cuh"
#include "hopper/indexer_topk/topk_shared_storage.cuh"

namespace dsaib::hopper {

template <class Config>
struct TopkScore {
  using Storage = TopkSharedStorage<Config>;
  static constexpr int kRows = Config::kWgRows;  // this warpgroup's rows of a task
  static constexpr int kN = Config::kWgN;        // their columns (rows x heads)
  static constexpr int kBlock = Config::kBlockKeys;
  static constexpr int kHeadTile = Config::kHeadTile;
  static constexpr int kThreads = Config::kThreadsPerWarpgroup;
  static constexpr int kStagesK = Config::kStagesK;
  static constexpr bool kE4m3 = Config::kElementBytes == 1;  // float8 inputs: index_k_scale may scale the logits

  const IndexerTopkParams& p;
  Storage& ss;
  MbarrierPipeline<Config::kStagesK> k_pipe;
  MbarrierPipeline<Config::kStagesQ> q_pipe;
  int wg;  // 0 or 1: which score warpgroup, and which half of the task's rows

  __device__ void select_sync() const {
    cutlass::arch::NamedBarrier::sync(kThreads, static_cast<uint32_t>(NamedBarrierId::kTopkSelectSync0) + wg);
  }

  /// Candidate buffer `half` of this warpgroup's row j of this CTA.
  __device__ unsigned long long* buffer(int j, int half) const {
    const int64_t part = ((static_cast<int64_t>(blockIdx.x) * Config::kScoreWarpgroups + wg) * kRows + j) * 2 + half;
    return p.candidates + part * p.candidate_capacity;
  }

  /// A for_each over the n entries at src, read from the L2 on every call
  /// (kSelectBatch loads in flight), for CandidateSelect's passes.
  __device__ static auto entries_in_l2(const unsigned long long* src, int n, int tid) {
    return [=](auto&& f) { for_each_entry<kThreads, Config::kSelectBatch>(n, tid, [&](int e) { return src[e]; }, f); };
  }

  /// A row's visible keys, held in registers for a task: [begin, end) in keys
  /// from the task's tile_base.
  struct RowRange {
    int32_t begin, end;
  };

  __device__ static PipelineState<kStagesK> k_state_of(int64_t g) {
    return {static_cast<uint32_t>(g % kStagesK), static_cast<uint32_t>((g / kStagesK) & 1)};
  }

  __device__ void run() {
    using namespace cute;
    const int tid = threadIdx.x - (Config::kProducerWarpgroup + 1 + wg) * kThreads;  // 0..127
    const int lane = tid % 32, warp = tid / 32;
    TopkSelection<kRows>& sel = ss.sel[wg];

    Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});  // (rows x heads, D, half, stage)
    Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Config::SmemLayoutK{});  // (64 keys, D, stage)
    typename Config::TiledMma mma;
    auto thr = mma.get_thread_slice(tid);
    Tensor tSsK = thr.partition_fragment_A(sK);  // (MMA, M, K, stage) descriptors
    Tensor tSsQ = thr.partition_fragment_B(sQ);  // (MMA, N, K, half, stage) descriptors
    // wgmma accumulator: value v is key r0 + 8 ((v / 2) % 2), column c0 + v % 2 + 8 (v / 4).
    static_assert(decltype(size(partition_fragment_C(mma, Shape<Int<kBlock>, Int<kN>>{})))::value == kN / 2,
                  "one m64 tile: N/2 values per thread");
    const int r0 = warp * 16 + lane / 4;
    const int c0 = 2 * (lane % 4);
    const int quad = lane % 4;

    auto q_state = make_consumer_start_state<Config::kStagesQ>();
    int64_t tiles_before = 0;  // K tiles of this CTA's earlier tasks
    for (int64_t i = blockIdx.x; i < p.num_tasks; i += gridDim.x) {
      const int64_t row0 = (p.num_tasks - 1 - i) * Config::kRows + wg * kRows;  // this warpgroup's first row
      q_pipe.consumer_wait(q_state);
      const int qs = q_state.index;
      // warp-uniform as ptxas sees it, so that the wgmma issues are not on a divergent path
      const int num_tiles = __shfl_sync(0xffffffffu, ss.num_tiles[qs], 0);
      const int64_t tile_base = ss.tile_base[qs];
      if (tid < kRows) {
        sel.count[tid] = 0;
        sel.half[tid] = 0;
        sel.bound[tid] = 0ull;
      }
      RowRange rows[kRows];
      uint32_t halves = 0;  // bit j: row j's current buffer half (it changes only at the row's cuts)
      CUTE_UNROLL
      for (int j = 0; j < kRows; ++j) {
        // key rows are below 2^31, so the differences fit 32 bits
        rows[j].begin = static_cast<int32_t>(ss.key_begin[qs][wg * kRows + j] - tile_base);
        rows[j].end = static_cast<int32_t>(ss.key_end[qs][wg * kRows + j] - tile_base);
      }
      select_sync();
      // Declared per task, so that they are dead during the task's last cuts
      // (finish_row holds a row's buffer in their registers).
      Tensor acc0 = partition_fragment_C(mma, Shape<Int<kBlock>, Int<kN>>{});
      Tensor acc1 = partition_fragment_C(mma, Shape<Int<kBlock>, Int<kN>>{});
      auto issue = [&](auto& acc, int t) {
        const PipelineState<kStagesK> st = k_state_of(tiles_before + t);
        k_pipe.consumer_wait(st);
        warpgroup_gemm<true>(mma, tSsK(_, _, _, st.index), tSsQ(_, _, _, wg, qs), acc);
      };
      // Tile t from `cur`, whose GEMM retired: the next tile's GEMM is issued
      // into `next` and runs under this tile's head sum and appends, which
      // have no divergent branch (a wgmma in flight across one makes ptxas
      // serialise every wgmma); the cuts, which branch, run after it retired.
      auto step = [&](auto& cur, auto& next, int t) {
        if (t + 1 < num_tiles) issue(next, t + 1);
        warpgroup_fence_operand(cur);
        k_pipe.consumer_release(k_state_of(tiles_before + t));  // the GEMM's reads of the stage retired
        add_tile(cur, qs, tile_base, t * kBlock, r0, c0, quad, rows, halves, sel);
        warpgroup_wait<0>();
        warpgroup_fence_operand(next);
        select_sync();  // appends and counts complete
        uint32_t cut_rows = 0;
#pragma unroll 1
        for (int j = 0; j < kRows; ++j) {
          if (sel.count[j] > p.candidate_capacity - kBlock) {
            cut_buffer(j, sel);
            cut_rows |= 1u << j;
          }
        }
        if (cut_rows != 0u) {  // uniform; rows[] indexed by constants only, so it stays in registers
          CUTE_UNROLL
          for (int j = 0; j < kRows; ++j) {
            if (cut_rows & (1u << j)) {
              halves = (halves & ~(1u << j)) | (static_cast<uint32_t>(sel.half[j]) << j);
            }
          }
        }
        // Every warp has read the counts before any warp's next appends change
        // them (nothing else orders a fast warp's next atomics after a slow
        // warp's reads: the next GEMM's issue waits for no other warp).
        select_sync();
      };
      if (num_tiles > 0) {
        issue(acc0, 0);
        warpgroup_wait<0>();
      }
#pragma unroll 1
      for (int t = 0; t < num_tiles; t += 2) {
        step(acc0, acc1, t);
        if (t + 1 < num_tiles) step(acc1, acc0, t + 1);
      }
      tiles_before += num_tiles;
      q_pipe.consumer_release(q_state);  // every GEMM of the task retired; w and ranges read
      q_state.advance();
#pragma unroll 1
      for (int j = 0; j < kRows; ++j) finish_row(row0 + j, j, sel);
    }
  }

  /// The logits of one tile's keys for this warpgroup's rows, and the appends.
  /// tile0: the tile's first key relative to tile_base.
  template <class Accumulator>
  __device__ void add_tile(const Accumulator& acc, int qs, int64_t tile_base, int32_t tile0, int r0, int c0, int quad,
                           const RowRange (&rows)[kRows], uint32_t halves, TopkSelection<kRows>& sel) const {
    float z[kRows][2];
    CUTE_UNROLL
    for (int j = 0; j < kRows; ++j) z[j][0] = z[j][1] = 0.0f;
    const float* w_half = &ss.w[qs][wg * kN];
    CUTE_UNROLL
    for (int m = 0; m < kN / 8; ++m) {
      const float2 w = *reinterpret_cast<const float2*>(&w_half[c0 + 8 * m]);
      constexpr int kColsPerRow = kHeadTile / 8;
      const int j = m / kColsPerRow;
      CUTE_UNROLL
      for (int kk = 0; kk < 2; ++kk) {
        z[j][kk] += w.x * relu_keeping_nan(acc(4 * m + 2 * kk));
        z[j][kk] += w.y * relu_keeping_nan(acc(4 * m + 2 * kk + 1));
      }
    }
    CUTE_UNROLL
    for (int j = 0; j < kRows; ++j) {
      CUTE_UNROLL
      for (int kk = 0; kk < 2; ++kk) {
        z[j][kk] += __shfl_xor_sync(0xffffffffu, z[j][kk], 1);
        z[j][kk] += __shfl_xor_sync(0xffffffffu, z[j][kk], 2);
      }
    }
    if constexpr (kE4m3) {
      // I = index_k_scale[key] * (the head sum of w index_q_scale relu(q . k)): one more f32 rounding
      if (p.index_k_scale != nullptr) {
        CUTE_UNROLL
        for (int kk = 0; kk < 2; ++kk) {
          const int64_t kr = tile_base + tile0 + r0 + 8 * kk;
          const float ks = kr < p.num_k_rows
                               ? p.index_k_scale[batched_offset(kr, p.k_rows_per_batch, p.ks_batch_stride, p.ks_row_stride)]
                               : 1.0f;  // a zero-filled key past the last row: never admitted
          CUTE_UNROLL
          for (int j = 0; j < kRows; ++j) z[j][kk] *= ks;
        }
      }
    }
    // Pair (j, kk) = 2 j + kk goes to quad lane (2 j + kk) % 4, so a thread
    // holds at most one key of each row. The appends of a row are counted once
    // per warp (a ballot, one shared atomic by the lowest admitting lane), not
    // once per key: early in a row nearly every key is admitted, and a shared
    // atomic on one word serialises across the warp's lanes.
    const int lane = threadIdx.x % 32;
    CUTE_UNROLL
    for (int j = 0; j < kRows; ++j) {
      // this thread's key of row j: pair (j, kk) with (2 j + kk) % 4 == quad
      const int kk = (quad - 2 * j) & 3;  // 0 or 1 where the thread holds one, else 2 or 3
      const float zj = kk == 0 ? z[j][0] : z[j][1];
      const int32_t k_rel = tile0 + r0 + 8 * (kk & 1);
      const bool visible = kk < 2 && static_cast<uint32_t>(k_rel - rows[j].begin) <
                                         static_cast<uint32_t>(rows[j].end - rows[j].begin);
      const unsigned long long key = rank_key(zj, static_cast<uint32_t>(tile_base) + static_cast<uint32_t>(k_rel));
      const bool admit = visible && key >= sel.bound[j];
      const uint32_t admitted = __ballot_sync(0xffffffffu, admit);
      if (admitted == 0u) continue;  // warp-uniform: late in a row most tiles admit nothing
      const int leader = __ffs(admitted) - 1;
      int base = 0;
      if (lane == leader) base = atomicAdd(&sel.count[j], __popc(admitted));
      base = __shfl_sync(0xffffffffu, base, leader);
      const int32_t dst = (2 * j + static_cast<int32_t>((halves >> j) & 1u)) * p.candidate_capacity;
      if (admit) buffer(0, 0)[dst + base + __popc(admitted & ((1u << lane) - 1u))] = key;
    }
  }

  /// Cuts row j's buffer (into the other half) to at most keep_at_most keys,
  /// its topk largest among them, and raises its bound. Called by the whole warpgroup after a select_sync().
  __device__ void cut_buffer(int j, TopkSelection<kRows>& sel) const {
    const int tid = threadIdx.x % kThreads;  // recomputed, not kept live across the tile loop
    const int n = sel.count[j];
    const int h = sel.half[j];
    const unsigned long long* src = buffer(j, h);
    unsigned long long* dst = buffer(j, h ^ 1);
    CandidateSelect<kRows> cs{sel, tid};
    auto sync = [&] { select_sync(); };
    auto each = entries_in_l2(src, n, tid);
    // Keys below the cut are out of the row's top-k; the buffer keeps at most
    // halfway between topk and the cut's trigger.
    const int keep_at_most = p.topk + (p.candidate_capacity - kBlock - p.topk) / 2;
    const RadixCut cut = cs.radix_cut(p.topk, keep_at_most, sync, each);
    const int kept = cs.write_kept(cut, sync, each, [&](int pos, unsigned long long key) { dst[pos] = key; });
    if (tid == 0) {
      sel.count[j] = kept;
      sel.half[j] = h ^ 1;
      sel.bound[j] = max(sel.bound[j], cut.prefix);
    }
    select_sync();
  }

  /// The topk largest keys of row j's buffer, unordered, into key_lo / key_hi
  /// of `row`, and their count. A buffer that fits is read into registers once
  /// (the accumulators are dead here); a larger one (topk above about 2K) is
  /// read from the L2 on every pass.
  __device__ void finish_row(int64_t row, int j, TopkSelection<kRows>& sel) const {
    if (row >= p.num_q_rows) return;  // a padded row of the last task (uniform)
    const int tid = threadIdx.x % kThreads;
    const int n = sel.count[j];
    const unsigned long long* src = buffer(j, sel.half[j]);
    uint32_t* lo = p.key_lo + row * p.topk;
    uint32_t* hi = p.key_hi + row * p.topk;
    auto finish = [&](auto&& each) {
      CandidateSelect<kRows> cs{sel, tid};
      auto sync = [&] { select_sync(); };
      const RadixCut cut = n > p.topk ? cs.radix_cut(p.topk, p.topk, sync, each) : RadixCut{};
      const int kept = cs.write_kept(cut, sync, each, [&](int pos, unsigned long long key) {
        lo[pos] = static_cast<uint32_t>(key);
        hi[pos] = static_cast<uint32_t>(key >> 32);
      });
      if (tid == 0) p.row_count[row] = kept;
    };
    using Entries = RegisterEntries<kThreads, Config::kFinishRegisterEntries>;
    if (n <= Entries::kCapacity) {
      Entries entries;
      entries.load(n, tid, [&](int e) { return src[e]; });
      finish([&](auto&& f) { entries.for_each(tid, f); });
    } else {
      finish(entries_in_l2(src, n, tid));
    }
  }
};

}  // namespace dsaib::hopper
