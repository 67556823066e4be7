// The fused, warp-specialized sm_90a indexer backward kernel: roles and
// pipeline setup. Roles live in producer_gather.cuh and consumer_mma.cuh.
//
//   warpgroup 0 : ProducerGather  (Q/w loads, stage 1, compaction, K gather; kProducerRegisters)
//   warpgroup 1 : ConsumerMma     (GEMM1-3, dW, A, dK reduce, epilogue; kConsumerRegisters)
// Persistent: CTA b takes tasks b, b + gridDim.x, ... (task = row * head_groups + group).
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "hopper/consumer_mma.cuh"
#include "hopper/producer_gather.cuh"

namespace dsaib::hopper {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) indexer_backward_kernel(const __grid_constant__ IndexerBackwardParams p) {
  extern __shared__ uint8_t smem_raw[];
  auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  SharedStorage<Config>& ss = *reinterpret_cast<SharedStorage<Config>*>(base);

  using Counts = KernelBarrierCounts<Config>;
  const MbarrierPipeline<Config::kStagesK> k_pipe{ss.k_full, ss.k_empty, 1u};
  const MbarrierPipeline<Config::kStagesQ> q_pipe{ss.q_full, ss.q_empty, 2u};
  if (threadIdx.x == 0) {
    k_pipe.init({Counts::kFullArrivals, Counts::kEmptyArrivals});
    q_pipe.init({Counts::kFullArrivals, Counts::kEmptyArrivals});
  }
  init_barriers_fence_and_sync();

  const int warpgroup = threadIdx.x / Config::kThreadsPerWarpgroup;
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
    ProducerGather<Config>{p, ss, k_pipe, q_pipe}.run();
  } else {
    cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegisters>();
    ConsumerMma<Config>{p, ss, k_pipe, q_pipe}.run();
  }
}

}  // namespace dsaib::hopper
