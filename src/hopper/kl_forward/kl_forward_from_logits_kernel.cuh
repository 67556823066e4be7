// The loss forward from the top-k's logits (docs/kl-forward.md, "From the
// top-k's logits"): z_i = sm_scale * topk_logits_i, so no key is gathered and
// no GEMM runs; a row costs reading its ids, logits and targets. One warpgroup
// per CTA and one query row per CTA at a time, persistent. Each thread adds its
// slots (tid + 128 j, in order) to its running statistics; the row then ends
// as in the loss forward's kernel (row_softmax_finish.cuh): fixed reduction
// trees, so the outputs are bitwise the same for every grid.
#pragma once

#include <cstdint>

#include "hopper/common/kernel_params.hpp"
#include "hopper/common/problem_device.cuh"
#include "hopper/common/row_running_stats.cuh"
#include "hopper/kl_forward/row_softmax_finish.cuh"

namespace dsaib::hopper {

/// One warpgroup per CTA; slots per thread per batch of loads (every load of a
/// batch is issued before the first is used).
struct LogitsForwardConfig {
  static constexpr int kThreads = 128;
  static constexpr int kBatch = 16;
};

/// The CTA's shared memory: the row end's per-warp parts, private to its one
/// warpgroup (NamedBarrierId::kForwardScoreSync).
struct LogitsForwardStorage {
  RowRunningStats row_stats[2][LogitsForwardConfig::kThreads / 32];
  double row_part[LogitsForwardConfig::kThreads / 32][3];
};

/// A row's logits by slot as the row end reads them: the same f32 product
/// sm_scale * topk_logits[i] that the statistics were formed from (rounded
/// on its own, never fused into a later add: the cpu backend's product).
struct ScaledLogits {
  const float* logits;
  float sm_scale;
  __device__ __forceinline__ float operator[](int64_t i) const { return __fmul_rn(sm_scale, logits[i]); }
};

__global__ void __launch_bounds__(LogitsForwardConfig::kThreads)
    indexer_kl_forward_from_logits_kernel(const __grid_constant__ IndexerKLForwardParams fp) {
  constexpr int kThreads = LogitsForwardConfig::kThreads, kBatch = LogitsForwardConfig::kBatch;
  using Finish = RowSoftmaxFinish<LogitsForwardStorage, kThreads, 0, kBatch>;
  __shared__ LogitsForwardStorage ss;
  const IndexerParams& p = fp.in;
  const int tid = threadIdx.x;
  const float eps = eps_exp_minus_100();
  uint32_t n = 0;  // rows so far (the row end's parity)
  for (int64_t row = blockIdx.x; row < p.num_q_rows; row += gridDim.x, ++n) {
    const RowSequence seq = row_sequence(p, row);
    const int32_t* ids = p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride);
    const float* attn =
        p.attn_score + batched_offset(row, p.q_rows_per_batch, p.attn_score_batch_stride, p.attn_score_row_stride);
    const ScaledLogits z_row{fp.topk_logits + batched_offset(row, p.q_rows_per_batch, fp.topk_logits_batch_stride,
                                                             fp.topk_logits_row_stride),
                             p.sm_scale};
    RowRunningStats st{-INFINITY, 0.0f, INFINITY, 0.0, 0.0, 0};
    for (int base = tid; base < p.topk; base += kThreads * kBatch) {
      int32_t id[kBatch];
      float target[kBatch], z[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = base + j * kThreads;
        id[j] = i < p.topk ? ids[i] : -1;
        target[j] = i < p.topk ? attn[i] : 0.0f;
      }
      bool valid[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        valid[j] = key_row_of(p, seq, id[j]) >= 0;  // an invalid slot's logit is never read
        z[j] = valid[j] ? z_row[base + j * kThreads] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (valid[j]) Finish::add_logit(z[j], max_keeping_nan(target[j], eps), st);
      }
    }
    Finish{fp, ss}.finish_row(row, st, n, z_row, eps);
  }
}

}  // namespace dsaib::hopper
