// Producer role of the top-k forward (warpgroup 0): per task, the rows' visible
// key ranges, their Q (rows x heads, zero-filled padding) and weights into a Q
// stage, then the contiguous key tiles that cover the union of the ranges into
// K stages, kCopiesInFlight tiles of copies in flight. Tasks run from the last
// to the first: with causal rows the heaviest come first, so the persistent
// CTAs end together.
#pragma once

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <cuda/ptx>

#include "hopper/indexer_topk/topk_rows.cuh"
#include "hopper/indexer_topk/topk_shared_storage.cuh"

namespace dsaib::hopper {

template <class Config>
struct TopkProducer {
  using Element = typename Config::Element;
  using Storage = TopkSharedStorage<Config>;
  static constexpr int kD = Config::kHeadDim;
  static constexpr int kChunkElements = 16 / Config::kElementBytes;  // elements per 16-byte chunk
  static constexpr int kChunksPerRow = kD / kChunkElements;         // 16-byte chunks per row
  static constexpr int kRows = Config::kRows;
  static constexpr int kThreads = Config::kProducerThreads;
  static constexpr int kBlock = Config::kBlockKeys;
  static constexpr int kTileRowsPerThread = kBlock * kChunksPerRow / kThreads;  // bf16: 8 (D128), 4 (D64); e4m3: 4
  static_assert(kTileRowsPerThread * kThreads == kBlock * kChunksPerRow, "whole tiles");

  const IndexerTopkParams& p;
  Storage& ss;
  MbarrierPipeline<Config::kStagesK> k_pipe;
  MbarrierPipeline<Config::kStagesQ> q_pipe;

  __device__ static void copy16(const void* src, void* dst, bool pred) {
    using Chunk = cute::uint128_t;
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(*reinterpret_cast<const Chunk*>(src),
                                                       *reinterpret_cast<Chunk*>(dst), pred);
  }

  /// The weight of (row, h) as the head sum takes it: e4m3 with index_q_scale,
  /// times that scale (one f32 rounding).
  __device__ float weight(int64_t row, int h) const {
    const int64_t off = batched_offset(row, p.q_rows_per_batch, p.w_batch_stride, p.w_row_stride) + h;
    const float w = weight_value(p.weights, p.weights_f32, off);
    if (p.index_q_scale == nullptr) return w;
    return w * p.index_q_scale[batched_offset(row, p.q_rows_per_batch, p.qs_batch_stride, p.qs_row_stride) + h];
  }

  /// Element `offset` of a bf16 or e4m3 tensor, as the cp.async source.
  __device__ static const Element* element_at(const void* base, int64_t offset) {
    return static_cast<const Element*>(base) + offset;
  }

  /// The task's Q, weights and ranges into Q stage qs; returns the first key row
  /// of its tiles, their count and the end of the union of its rows' ranges.
  __device__ void load_task(int64_t row0, int qs, int tid, int64_t* tile_base, int32_t* num_tiles,
                            int64_t* range_end) {
    // Every thread computes the kRows ranges (a few loads each), so no barrier is needed.
    int64_t lo = INT64_MAX, hi = INT64_MIN;
#pragma unroll 1
    for (int j = 0; j < kRows; ++j) {
      int64_t begin = 0, end = 0;
      if (row0 + j < p.num_q_rows) topk_row_keys(p, row0 + j, &begin, &end);
      if (begin < end) {
        lo = min(lo, begin);
        hi = max(hi, end);
      }
      if (tid == j) {
        ss.key_begin[qs][j] = begin;
        ss.key_end[qs][j] = end;
      }
    }
    const bool any = lo < hi;
    *tile_base = any ? lo : 0;
    *num_tiles = any ? static_cast<int32_t>((hi - lo + kBlock - 1) / kBlock) : 0;
    *range_end = any ? hi : 0;
    if (tid == 0) {
      ss.tile_base[qs] = *tile_base;
      ss.num_tiles[qs] = *num_tiles;
    }
    cute::Tensor sQ = cute::make_tensor(cute::make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});
    for (int chunk = tid; chunk < Config::kN * kChunksPerRow; chunk += kThreads) {
      const int col = chunk / kChunksPerRow, dcol = (chunk % kChunksPerRow) * kChunkElements;
      const int j = col / Config::kHeadTile, h = col % Config::kHeadTile;
      const int64_t row = row0 + j;
      const bool valid = row < p.num_q_rows && h < p.heads;  // padding: zero-filled, nothing read
      const Element* src =
          valid ? element_at(p.index_q, batched_offset(row, p.q_rows_per_batch, p.q_batch_stride, p.q_row_stride) +
                                            h * p.q_head_stride + dcol)
                : element_at(p.index_q, 0);
      copy16(src, &sQ(col % Config::kWgN, dcol, col / Config::kWgN, qs), valid);  // column col: warpgroup col / kWgN
    }
    cute::cp_async_fence();
    for (int col = tid; col < Config::kN; col += kThreads) {
      const int j = col / Config::kHeadTile, h = col % Config::kHeadTile;
      const int64_t row = row0 + j;
      ss.w[qs][col] = (row < p.num_q_rows && h < p.heads) ? weight(row, h) : 0.0f;
    }
  }

  __device__ void run() {
    const int tid = threadIdx.x;  // 0..127 in warpgroup 0
    cute::Tensor sK = cute::make_tensor(cute::make_smem_ptr(ss.k), typename Config::SmemLayoutK{});
    // Thread t copies 16-byte column chunk t % kChunksPerRow of kTileRowsPerThread
    // consecutive key rows: a warp's copy i covers whole rows.
    const int my_col = (tid % kChunksPerRow) * kChunkElements;
    const int my_row0 = (tid / kChunksPerRow) * kTileRowsPerThread;
    auto k_state = make_producer_start_state<Config::kStagesK>();
    auto q_state = make_producer_start_state<Config::kStagesQ>();

    for (int64_t i = blockIdx.x; i < p.num_tasks; i += gridDim.x) {
      const int64_t task = p.num_tasks - 1 - i;
      q_pipe.producer_acquire(q_state);
      const int qs = q_state.index;
      int64_t tile_base, range_end;  // keys at or past range_end are zero-filled
      int32_t num_tiles;
      load_task(task * kRows, qs, tid, &tile_base, &num_tiles, &range_end);
      cute::cp_async_wait<0>();                               // this thread's Q copies landed
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // ...and are visible to wgmma
      q_pipe.producer_commit(q_state);
      q_state.advance();

      // Tile t is committed once tile t + kCopiesInFlight - 1 is issued.
      auto commit_state = k_state;
      for (int32_t t = 0; t < num_tiles; ++t) {
        k_pipe.producer_acquire(k_state);
        const int ks = k_state.index;
        const int64_t first = tile_base + static_cast<int64_t>(t) * kBlock + my_row0;
        // One 64-bit division per tile, not one per row: this thread's rows are
        // consecutive, so the next row is the next in its batch or, past the
        // batch's last row, a later batch's first (a task's rows can span two).
        int64_t batch = first / p.k_rows_per_batch;
        int64_t in_batch = first - batch * p.k_rows_per_batch;
        CUTE_UNROLL
        for (int r = 0; r < kTileRowsPerThread; ++r) {
          const bool valid = first + r < range_end;
          const Element* src = valid ? element_at(p.index_k, batch * p.k_batch_stride + in_batch * p.k_row_stride + my_col)
                                     : element_at(p.index_k, 0);
          copy16(src, &sK(my_row0 + r, my_col, ks), valid);
          if (++in_batch == p.k_rows_per_batch) {
            in_batch = 0;
            ++batch;
          }
        }
        cute::cp_async_fence();
        k_state.advance();
        if (t >= Config::kCopiesInFlight - 1) {
          cute::cp_async_wait<Config::kCopiesInFlight - 1>();
          cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
          k_pipe.producer_commit(commit_state);
          commit_state.advance();
        }
      }
      cute::cp_async_wait<0>();
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
      for (int32_t t = max(num_tiles - (Config::kCopiesInFlight - 1), 0); t < num_tiles; ++t) {
        k_pipe.producer_commit(commit_state);
        commit_state.advance();
      }
    }
  }
};

}  // namespace dsaib::hopper
