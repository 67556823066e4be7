// Named (bar.sync) barriers of the sm_90a kernels, in one scoped enum; CUTLASS's
// NamedBarrier offsets the ids past its reserved ones.
#pragma once

#include <cutlass/arch/barrier.h>

namespace dsaib::hopper {

enum class NamedBarrierId : uint32_t {
  /// A producer warpgroup: partial sums, counts and the slot list complete (or consumed).
  kProducerSync = 1,
  /// The loss forward's score warpgroup (forward_score.cuh): a row's per-warp
  /// statistics and logits complete, or a slot pass's reads and sums done.
  kForwardScoreSync = 2,
  /// The P-free score warpgroup (score_mma.cuh): a block's partial logits, then its gs.
  kPFreeScoreSync = 3,
  /// The attention target's consumers (attention_target_consumer.cuh): a row's
  /// partial sums of U and its U stores complete before its final pass.
  kTargetConsumerSync = 4,
  /// The top-k forward's score warpgroups (indexer_topk/topk_score.cuh): one
  /// warpgroup's appends, counts and radix passes over its own rows' candidate
  /// buffers (5 + warpgroup: 5 and 6).
  kTopkSelectSync0 = 5,
  kTopkSelectSync1 = 6,
};

template <class Config>
struct NamedBarrierThreads {
  static constexpr uint32_t kProducerSync = Config::kProducerThreads;
};

template <class Config>
__device__ inline void producer_sync() {
  cutlass::arch::NamedBarrier::sync(NamedBarrierThreads<Config>::kProducerSync,
                                    static_cast<uint32_t>(NamedBarrierId::kProducerSync));
}

}  // namespace dsaib::hopper
