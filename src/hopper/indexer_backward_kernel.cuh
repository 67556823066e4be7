// The fused, warp-specialized sm_90a indexer backward kernel: roles and
// pipeline setup. Roles live in producer_gather.cuh, score_mma.cuh, dk_mma.cuh
// and scatter_reduce.cuh.
//
//   warpgroup 0 : ProducerGather  (Q/w loads, stage 1, compaction, K gather; kProducerRegisters)
//   warpgroup 1 : ScoreMma        (GEMM1, dW, A -> sA, GEMM3 dQ, epilogue; kScoreRegisters)
//   warpgroup 2 : DkMma           (GEMM2 dK from sA, dK staging, end marker; kDkRegisters)
//   warpgroup 3 : ScatterReduce   (dK scatter-add from the staging double buffer; kScatterRegisters)
// Every kernel (both head dims, one or two A terms) has the four roles.
// Persistent: CTA b takes tasks b, b + gridDim.x, ... (task = row * head_groups + group).
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "hopper/dk_mma.cuh"
#include "hopper/producer_gather.cuh"
#include "hopper/scatter_reduce.cuh"
#include "hopper/score_mma.cuh"

namespace dsaib::hopper {

/// setmaxnreg to kRegisters from the entry limit: .dec below it, .inc above it.
template <int kRegisters, int kEntry>
__device__ __forceinline__ void set_role_registers() {
  if constexpr (kRegisters < kEntry) cutlass::arch::warpgroup_reg_dealloc<kRegisters>();
  else if constexpr (kRegisters > kEntry) cutlass::arch::warpgroup_reg_alloc<kRegisters>();
}

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
  // The dK role fills dk_stage, the scatter role empties it.
  const MbarrierPipeline<Config::kDkBuffers> dk_pipe{ss.dk_full, ss.dk_empty, 3u};
  // The score role fills sA, the dK role empties it.
  const MbarrierPipeline<Config::kABuffers> a_pipe{ss.a_full, ss.a_empty, 4u};
  if (threadIdx.x == 0) {
    k_pipe.init({Counts::kKFullArrivals, Counts::kKEmptyArrivals});
    q_pipe.init({Counts::kQFullArrivals, Counts::kQEmptyArrivals});
    dk_pipe.init({Counts::kDkFullArrivals, Counts::kDkEmptyArrivals});
    a_pipe.init({Counts::kAFullArrivals, Counts::kAEmptyArrivals});
  }
  init_barriers_fence_and_sync();

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
