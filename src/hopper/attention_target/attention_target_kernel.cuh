// The sm_90a attention target kernel (docs/hopper-kernel.md §14): persistent,
// one query row per task. Warpgroup 0: AttentionTargetProducer; warpgroups 1-2:
// AttentionTargetConsumer. Barrier contracts: attention_target_tile_config.cuh.
#pragma once

#include "hopper/attention_target/attention_target_consumer.cuh"

namespace dsaib::hopper {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1)
    attention_target_kernel(const __grid_constant__ AttentionTargetParams p) {
  extern __shared__ uint8_t smem_raw[];
  using Storage = AttentionTargetStorage<Config>;
  Storage& ss = shared_storage_at_1024<Storage>(smem_raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < Config::kStagesK; ++s) {
      cuda::ptx::mbarrier_init(&ss.k_full[s], 2 * Config::kProducerThreads);
      cuda::ptx::mbarrier_init(&ss.k_empty[s], Config::kThreadsPerWarpgroup);
    }
    for (int s = 0; s < Config::kStagesQ; ++s) {
      cuda::ptx::mbarrier_init(&ss.q_full[s], 2 * Config::kProducerThreads);
      cuda::ptx::mbarrier_init(&ss.q_empty[s], Config::kConsumerThreads);
    }
  }
  init_barriers_fence_and_sync();
  const int wg = threadIdx.x / Config::kThreadsPerWarpgroup;
  if (wg == Config::kProducerWarpgroup) {
    AttentionTargetProducer<Config>{p, ss}.run();
  } else {
    AttentionTargetConsumer<Config>{p, ss}.run(wg - 1);
  }
}

}  // namespace dsaib::hopper
