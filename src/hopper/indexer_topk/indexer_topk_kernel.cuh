// The sm_90a top-k forward's selection kernel (docs/indexer-topk.md, "The
// sm_90a kernel"). Persistent: CTA b takes tasks b, b + gridDim.x, ... (in
// reverse, heaviest first). Roles:
//   warpgroup 0:    TopkProducer (topk_producer.cuh): ranges, Q and weights, key tiles
//   warpgroups 1-2: TopkScore (topk_score.cuh): each half of the task's rows: GEMM, head sum, selection
// Shared memory and its mbarrier contracts: topk_shared_storage.cuh. Its
// output, each row's selection unordered, is put in order by
// topk_order_kernel.cuh.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "hopper/indexer_topk/topk_producer.cuh"
#include "hopper/indexer_topk/topk_score.cuh"

namespace dsaib::hopper {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) indexer_topk_kernel(const __grid_constant__ IndexerTopkParams p) {
  extern __shared__ uint8_t smem_raw[];
  using Storage = TopkSharedStorage<Config>;
  Storage& ss = shared_storage_at_1024<Storage>(smem_raw);
  // Wait-timeout codes (pipeline.cuh): 21 = K ring, 22 = Q ring.
  const MbarrierPipeline<Config::kStagesK> k_pipe{ss.k_full, ss.k_empty, 21u};
  const MbarrierPipeline<Config::kStagesQ> q_pipe{ss.q_full, ss.q_empty, 22u};
  if (threadIdx.x == 0) {
    k_pipe.init({Config::kProducerThreads, Config::kScoreThreads});  // both score warpgroups take every tile
    q_pipe.init({Config::kProducerThreads, Config::kScoreThreads});
  }
  init_barriers_fence_and_sync();
  const int warpgroup = threadIdx.x / Config::kThreadsPerWarpgroup;
  if (warpgroup == Config::kProducerWarpgroup) {
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
    TopkProducer<Config>{p, ss, k_pipe, q_pipe}.run();
  } else {
    cutlass::arch::warpgroup_reg_alloc<Config::kScoreRegisters>();
    TopkScore<Config>{p, ss, k_pipe, q_pipe, warpgroup - 1}.run();
  }
}

}  // namespace dsaib::hopper
