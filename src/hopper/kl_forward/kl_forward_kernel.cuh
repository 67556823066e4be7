// The sm_90a loss forward kernel (docs/kl-forward.md). One task = one query row
// with all its heads, since z sums over every head; persistent. Two roles:
//   warpgroup 0: ProducerGather without stage 1 (common/producer_gather.cuh)
//   warpgroup 1: ForwardScore (forward_score.cuh)
// Shared memory and its mbarrier contracts: forward_shared_storage.cuh.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "hopper/common/producer_gather.cuh"
#include "hopper/kl_forward/forward_score.cuh"

namespace dsaib::hopper {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, Config::kCtasPerSm)
    indexer_kl_forward_kernel(const __grid_constant__ IndexerKLForwardParams p) {
  extern __shared__ uint8_t smem_raw[];
  using Storage = ForwardSharedStorage<Config>;
  Storage& ss = shared_storage_at_1024<Storage>(smem_raw);
  const MbarrierPipeline<Config::kStagesK> k_pipe{ss.k_full, ss.k_empty, 1u};
  const MbarrierPipeline<Config::kStagesQ> q_pipe{ss.q_full, ss.q_empty, 2u};
  if (threadIdx.x == 0) {
    k_pipe.init({Config::kProducerThreads, Config::kScoreThreads});
    q_pipe.init({Config::kProducerThreads, Config::kScoreThreads});
  }
  init_barriers_fence_and_sync();
  if (threadIdx.x / Config::kThreadsPerWarpgroup == Config::kProducerWarpgroup) {
    if constexpr (Config::kProducerRegisters > 0) cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
    ProducerGather<Config, Storage, false>{p.in, ss, k_pipe, q_pipe}.run();
  } else {
    if constexpr (Config::kScoreRegisters > 0) cutlass::arch::warpgroup_reg_alloc<Config::kScoreRegisters>();
    ForwardScore<Config>{p, ss, k_pipe, q_pipe}.run();
  }
}

}  // namespace dsaib::hopper
