// Named (bar.sync) barriers of the sm_90a kernel: one scoped enum, with the
// number of participating threads beside each. IDs are offset past CUTLASS's
// reserved ones by cutlass::arch::NamedBarrier.
#pragma once

#include <cutlass/arch/barrier.h>

namespace dsaib::hopper {

enum class NamedBarrierId : uint32_t {
  /// The producer warpgroup: stage-1 partial sums / counts and the compacted
  /// slot list are complete (or fully consumed) before the next step.
  kProducerSync = 1,
  /// The loss forward's score warpgroup (forward_score.cuh): the per-warp row
  /// statistics of a row (and its logits in the z scratch row) are complete, and
  /// a pass over its slots has read them and written its per-warp sums.
  kForwardScoreSync = 2,
  /// The P-free backward's score warpgroup (score_mma.cuh, PFreeConfig):
  /// the per-warp partial logits of a key block, then the block's gs, are complete.
  kPFreeScoreSync = 3,
  /// The attention target's two consumer warpgroups (attention_target_consumer.cuh):
  /// a row's per-warp partial sums of U, and its unnormalised T in global memory,
  /// are complete before the row's final pass reads them.
  kTargetConsumerSync = 4,
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
