// The fused, warp-specialized sm_90a indexer backward kernel: roles and
// pipeline setup. Roles live in producer_gather.cuh, consumer_mma.cuh and
// scatter_reduce.cuh.
//
//   warpgroup 0 : ProducerGather  (Q/w loads, stage 1, compaction, K gather; kProducerRegisters)
//   warpgroup 1 : ConsumerMma     (GEMM1-3, dW, A, dK staging, epilogue; kConsumerRegisters)
//   warpgroup 2 : ScatterReduce   (dK scatter-add from the staging double buffer; kScatterRegisters)
// Every kernel has the three roles (since v24). The split-A kernels raise their
// consumer to 232 registers with setmaxnreg and lower their scatter role to 144
// (v24 at D=128, v26 at D=64; tile_config.cuh).
// Persistent: CTA b takes tasks b, b + gridDim.x, ... (task = row * head_groups + group).
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "hopper/consumer_mma.cuh"
#include "hopper/producer_gather.cuh"
#include "hopper/scatter_reduce.cuh"

namespace dsaib::hopper {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) indexer_backward_kernel(const __grid_constant__ IndexerBackwardParams p) {
  extern __shared__ uint8_t smem_raw[];
  // Align to 1024 B (128-byte swizzle atoms) by an offset from smem_raw, so the
  // compiler still knows the pointer is shared memory (STS/LDS, not generic ST/LD).
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* base = smem_raw + ((1024u - (smem_addr & 1023u)) & 1023u);
  SharedStorage<Config>& ss = *reinterpret_cast<SharedStorage<Config>*>(base);

  using Counts = KernelBarrierCounts<Config>;
  const MbarrierPipeline<Config::kStagesK> k_pipe{ss.k_full, ss.k_empty, 1u};
  const MbarrierPipeline<Config::kStagesQ> q_pipe{ss.q_full, ss.q_empty, 2u};
  // The consumer fills dk_stage, the scatter role empties it.
  const MbarrierPipeline<Config::kDkBuffers> dk_pipe{ss.dk_full, ss.dk_empty, 3u};
  if (threadIdx.x == 0) {
    k_pipe.init({Counts::kFullArrivals, Counts::kEmptyArrivals});
    q_pipe.init({Counts::kFullArrivals, Counts::kEmptyArrivals});
    dk_pipe.init({Counts::kDkFullArrivals, Counts::kDkEmptyArrivals});
  }
  init_barriers_fence_and_sync();

  const int warpgroup = threadIdx.x / Config::kThreadsPerWarpgroup;
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
    ProducerGather<Config>{p, ss, k_pipe, q_pipe}.run();
  } else if (warpgroup == 1) {
    if constexpr (Config::kConsumerRegisters > Config::kEntryRegisters) cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegisters>();
    ConsumerMma<Config>{p, ss, k_pipe, q_pipe, dk_pipe}.run();
  } else {
    if constexpr (Config::kScatterRegisters < Config::kEntryRegisters) cutlass::arch::warpgroup_reg_dealloc<Config::kScatterRegisters>();
    ScatterReduce<Config>{p, ss, dk_pipe}.run();
  }
}

}  // namespace dsaib::hopper
