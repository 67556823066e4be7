// The warp-specialised sm_90a indexer backward kernel (docs/hopper-kernel.md):
// barrier setup and the role split. Persistent: CTA b takes tasks b, b + gridDim.x, ...
//   warpgroup 0: ProducerGather (common/producer_gather.cuh)  2: DkMma (dk_mma.cuh)
//   warpgroup 1: ScoreMma (score_mma.cuh)                      3: ScatterReduce (scatter_reduce.cuh)
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "hopper/indexer_backward/dk_mma.cuh"
#include "hopper/common/producer_gather.cuh"
#include "hopper/indexer_backward/scatter_reduce.cuh"
#include "hopper/indexer_backward/score_mma.cuh"

namespace dsaib::hopper {

/// setmaxnreg to kRegisters from the entry limit: .dec below it, .inc above it.
template <int kRegisters, int kEntry>
__device__ __forceinline__ void set_role_registers() {
  if constexpr (kRegisters < kEntry) cutlass::arch::warpgroup_reg_dealloc<kRegisters>();
  else if constexpr (kRegisters > kEntry) cutlass::arch::warpgroup_reg_alloc<kRegisters>();
}

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) indexer_backward_kernel(const __grid_constant__ IndexerParams p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage<Config>& ss = shared_storage_at_1024<SharedStorage<Config>>(smem_raw);
  const BackwardPipelines<Config> pipes(ss);
  if (threadIdx.x == 0) pipes.init();
  init_barriers_fence_and_sync();
  const auto& k_pipe = pipes.k;
  const auto& q_pipe = pipes.q;
  const auto& dk_pipe = pipes.dk;
  const auto& a_pipe = pipes.a;

  constexpr int kEntry = Config::kEntryRegisters;
  const int warpgroup = threadIdx.x / Config::kThreadsPerWarpgroup;
  if (warpgroup == Config::kProducerWarpgroup) {
    set_role_registers<Config::kProducerRegisters, kEntry>();
    ProducerGather<Config>{p, ss, k_pipe, q_pipe}.run();
  } else if (warpgroup == Config::kScoreWarpgroup) {
    set_role_registers<Config::kScoreRegisters, kEntry>();
    ScoreMma<Config>{p, ss, k_pipe, q_pipe, a_pipe}.run();
  } else if (warpgroup == Config::kDkWarpgroup) {
    set_role_registers<Config::kDkRegisters, kEntry>();
    DkMma<Config>{p, ss, q_pipe, a_pipe, dk_pipe}.run();
  } else {
    set_role_registers<Config::kScatterRegisters, kEntry>();
    ScatterReduce<Config>{p, ss, dk_pipe}.run();
  }
}

}  // namespace dsaib::hopper
