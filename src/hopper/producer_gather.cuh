// Producer role (warp 0 of warpgroup 0): per task, load Q and w, run stage 1
// (score gradient), then gather the row's valid keys into K stages.
//
// Stage 1 (docs/math.md): over the row's valid slots
//   g_i = -c * max(T_i, eps) * [P_i >= eps],  G = sum g_i,  gs_i = g_i - P_i * G
// Invalid slots are dropped here (compaction): consumers only see valid keys,
// in slot order, 64 per block, the last block padded with key_row -1 / gs 0 /
// zero-filled K rows.
#pragma once

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <cuda/ptx>

#include "hopper/problem_device.cuh"
#include "hopper/shared_storage.cuh"

namespace dsaib::hopper {

template <class Config>
struct ProducerGather {
  using Element = typename Config::Element;
  static constexpr int kD = Config::kHeadDim;
  static constexpr int kChunksPerRow = kD / 8;  // 16-byte chunks
  static constexpr int kBlock = Config::kBlockKeys;

  const IndexerBackwardParams& p;
  SharedStorage<Config>& ss;
  MbarrierPipeline<Config::kStagesK> k_pipe;
  MbarrierPipeline<Config::kStagesQ> q_pipe;

  __device__ static void copy16(const void* src, Element* dst, bool pred) {
    using Chunk = cute::uint128_t;
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(*reinterpret_cast<const Chunk*>(src),
                                                       *reinterpret_cast<Chunk*>(dst), pred);
  }

  __device__ static float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
  }

  __device__ void run() {
    const int lane = threadIdx.x % 32;
    const float grad_loss = p.grad_loss_ptr ? *p.grad_loss_ptr : p.grad_loss_value;
    const float c = grad_loss * p.loss_coeff_over_n;
    const float eps = eps_exp_minus_100();

    cute::Tensor sQ = cute::make_tensor(cute::make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});
    cute::Tensor sK = cute::make_tensor(cute::make_smem_ptr(ss.k), typename Config::SmemLayoutK{});

    auto k_state = make_producer_start_state<Config::kStagesK>();
    auto q_state = make_producer_start_state<Config::kStagesQ>();

    for (int64_t task = blockIdx.x; task < p.num_tasks; task += gridDim.x) {
      const int64_t row = task / p.head_groups;
      const int h0 = static_cast<int>(task % p.head_groups) * Config::kHeadTile;
      const int nh = min(Config::kHeadTile, p.heads - h0);
      const RowSequence seq = row_sequence(p, row);
      const int32_t* ids = p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride);
      const float* attn = p.attn_score + batched_offset(row, p.q_rows_per_batch, p.attn_batch_stride, p.attn_row_stride);
      const float* pred = p.index_score + batched_offset(row, p.q_rows_per_batch, p.pred_batch_stride, p.pred_row_stride);

      // ---- Q tile and weights of this task
      q_pipe.producer_acquire(q_state);
      const int qs = q_state.index;
      const uint16_t* q_row = p.index_q + batched_offset(row, p.q_rows_per_batch, p.q_batch_stride, p.q_row_stride);
      for (int chunk = lane; chunk < Config::kHeadTile * kChunksPerRow; chunk += 32) {
        const int hh = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
        const bool in_range = hh < nh;  // padded heads: zero-filled, nothing read
        const uint16_t* src = in_range ? q_row + (h0 + hh) * p.q_head_stride + col : p.index_q;
        copy16(src, &sQ(hh, col, qs), in_range);
      }
      cute::cp_async_fence();
      const int64_t w_off = batched_offset(row, p.q_rows_per_batch, p.w_batch_stride, p.w_row_stride);
      for (int hh = lane; hh < Config::kHeadTile; hh += 32) {
        float w = 0.0f;
        if (hh < nh) {
          w = p.weights_f32 ? static_cast<const float*>(p.weights)[w_off + h0 + hh]
                            : __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p.weights)[w_off + h0 + hh]) << 16);
        }
        ss.w_scaled[qs][hh] = w * p.sm_scale;
      }

      // ---- stage 1: G and the number of valid slots
      float g_sum = 0.0f;
      int valid_count = 0;
      for (int base = 0; base < p.topk; base += 32) {
        const int i = base + lane;
        bool valid = false;
        if (i < p.topk) {
          valid = key_row_of(p, seq, ids[i]) >= 0;
          if (valid && pred[i] >= eps) g_sum += -c * fmaxf(attn[i], eps);
        }
        valid_count += __popc(__ballot_sync(0xffffffffu, valid));
      }
      const float G = warp_sum(g_sum);
      const int num_blocks = (valid_count + kBlock - 1) / kBlock;
      if (lane == 0) ss.num_blocks[qs] = num_blocks;

      cute::cp_async_wait<0>();                            // this lane's Q copies landed
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared); // ...and are visible to wgmma
      q_pipe.producer_commit(q_state);                     // every lane arrives (count 32)
      q_state.advance();

      // ---- gathered key blocks; the commit of block j waits until block j+1 is issued
      int cursor = 0;
      bool pending = false;
      PipelineState<Config::kStagesK> pending_state{};
      for (int blk = 0; blk < num_blocks; ++blk) {
        k_pipe.producer_acquire(k_state);
        const int ks = k_state.index;
        int filled = 0;
        while (filled < kBlock && cursor < p.topk) {
          const int i = cursor + lane;
          int64_t kr = -1;
          if (i < p.topk) kr = key_row_of(p, seq, ids[i]);
          const unsigned ballot = __ballot_sync(0xffffffffu, kr >= 0);
          const int pos = filled + __popc(ballot & ((1u << lane) - 1u));
          if (kr >= 0 && pos < kBlock) {
            const float P = pred[i];
            const float g = P >= eps ? -c * fmaxf(attn[i], eps) : 0.0f;
            ss.gs[ks][pos] = g - P * G;
            ss.key_row[ks][pos] = static_cast<int32_t>(kr);
          }
          const int n = __popc(ballot);
          if (filled + n <= kBlock) {
            cursor += 32;
            filled += n;
          } else {
            // stop after the (kBlock - filled)-th valid lane
            unsigned m = ballot;
            for (int skip = kBlock - filled - 1; skip > 0; --skip) m &= m - 1;
            cursor += __ffs(m);  // index of that lane + 1
            filled = kBlock;
          }
        }
        for (int pos = filled + lane; pos < kBlock; pos += 32) {
          ss.gs[ks][pos] = 0.0f;
          ss.key_row[ks][pos] = -1;
        }
        __syncwarp();  // key_row entries written by other lanes are read below
        for (int chunk = lane; chunk < kBlock * kChunksPerRow; chunk += 32) {
          const int r = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
          const int32_t kr = ss.key_row[ks][r];
          const uint16_t* src = kr >= 0 ? key_row_ptr(p, kr) + col : p.index_k;
          copy16(src, &sK(r, col, ks), kr >= 0);
        }
        cute::cp_async_fence();
        if (pending) {
          cute::cp_async_wait<1>();  // all but the block just issued have landed
          cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
          k_pipe.producer_commit(pending_state);
        }
        pending = true;
        pending_state = k_state;
        k_state.advance();
      }
      if (pending) {
        cute::cp_async_wait<0>();
        cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
        k_pipe.producer_commit(pending_state);
      }
    }
  }
};

}  // namespace dsaib::hopper
