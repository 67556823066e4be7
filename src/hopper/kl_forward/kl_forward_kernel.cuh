// The sm_90a loss forward kernel (docs/kl-forward.md). Two roles, one
// warpgroup each:
//
//   warpgroup 0 : ProducerGather without stage 1 (producer_gather.cuh, shared
//                 with the backward): Q/w loads, compaction of the valid slots,
//                 K gather into kStagesK stages; each gathered key carries its
//                 slot and its T~ = max(T, eps).
//   warpgroup 1 : ForwardScore (forward_score.cuh): GEMM1 with wgmma, keys as M
//                 and heads as N (S^T = K Q^T, both operands in shared memory), so
//                 the weighted relu head sum z of a key stays within a thread and
//                 its quad; the row's running max / sum of exp and the sums of
//                 T~ z and T~ as the blocks arrive; per row LSE, the target mass
//                 and the loss term, and P or a clipped row by a pass over its slots.
//
// One task = one query row with ALL its heads (kHeadTile 64 for H <= 64, 128
// above), since z sums over every head. Persistent: CTA b takes rows b,
// b + gridDim.x, ... A row's logits also go to the CTA's z scratch row (global
// memory, indexed by slot) for that pass; per-row loss terms go to a
// workspace that a second kernel sums in a fixed order.
//
// Tile choices: forward_tile_config.cuh; shared memory and its mbarrier
// contracts: forward_shared_storage.cuh; parameters: IndexerKLForwardParams
// (common/kernel_params.hpp).
#pragma once

#include "hopper/common/producer_gather.cuh"
#include "hopper/kl_forward/forward_score.cuh"

namespace dsaib::hopper {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1)
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
    ProducerGather<Config, Storage, false>{p.in, ss, k_pipe, q_pipe}.run();
  } else {
    ForwardScore<Config>{p, ss, k_pipe, q_pipe}.run();
  }
}

}  // namespace dsaib::hopper
