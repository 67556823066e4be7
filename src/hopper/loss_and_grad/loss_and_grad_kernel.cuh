// The sm_90a loss-and-gradient kernel (LossAndGradConfig, tile_config.cuh):
// the P-free backward's four roles, whose producer and dK role also run the
// loss forward's pass over the CTA's next row, so that the forward's gathers
// and GEMM1 run beside the backward's instead of in a launch of their own.
//
//   warpgroup 0 : LossAndGradProducer (loss_and_grad_producer.cuh): per step,
//                 the backward blocks of row r_{n-1} and the forward blocks of
//                 r_n in turn
//   warpgroup 1 : ScoreMma (score_mma.cuh): the P-free backward's, its row's LSE
//                 and G from the dK role (stats_full) instead of the producer
//   warpgroup 2 : DkMma (dk_mma.cuh): GEMM2 of each backward block, then a
//                 forward block (GEMM1 with keys as M, head sum, row
//                 statistics); after the step, r_n's LSE, target mass and loss
//                 term (ForwardScore::finish_row, forward_score.cuh), and its
//                 LSE and G for the score role
//   warpgroup 3 : ScatterReduce (scatter_reduce.cuh), unchanged
//
// The mbarrier contracts are the backward's, plus forward_full / forward_empty
// (the forward blocks' ring of K stages) and stats_full (LossAndGradStorage,
// shared_storage.cuh).
// Outputs: the forward's (IndexerKLForwardParams: row_lse, row_target_mass,
// loss_terms, with z_scratch) and the backward's (params.in). The row terms
// are summed by the loss forward's fixed-order kernel after this one.
#pragma once

#include "hopper/indexer_backward/indexer_backward_kernel.cuh"
#include "hopper/loss_and_grad/dk_forward_steps.cuh"
#include "hopper/loss_and_grad/loss_and_grad_producer.cuh"
#include "hopper/loss_and_grad/loss_and_grad_storage.cuh"

namespace dsaib::hopper {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1)
    indexer_kl_loss_and_grad_kernel(const __grid_constant__ IndexerKLForwardParams fp) {
  static_assert(kFusesForward<Config>, "a LossAndGradConfig");
  const IndexerParams& p = fp.in;
  extern __shared__ uint8_t smem_raw[];
  SharedStorage<Config>& ss = shared_storage_at_1024<SharedStorage<Config>>(smem_raw);
  const BackwardPipelines<Config> pipes(ss);
  // The forward blocks' stages: the producer fills, the dK role empties.
  const MbarrierPipeline<Config::kForwardStages> f_pipe{ss.fused.forward_full, ss.fused.forward_empty, 6u};
  if (threadIdx.x == 0) {
    pipes.init();
    f_pipe.init({Config::kProducerThreads, Config::kDkThreads});
    for (int s = 0; s < Config::kStagesQ; ++s) cuda::ptx::mbarrier_init(&ss.fused.stats_full[s], 1);
  }
  init_barriers_fence_and_sync();
  const auto& k_pipe = pipes.k;
  const auto& q_pipe = pipes.q;
  const auto& dk_pipe = pipes.dk;
  const auto& a_pipe = pipes.a;

  constexpr int kEntry = Config::kEntryRegisters;
  const int warpgroup = threadIdx.x / Config::kThreadsPerWarpgroup;
  if (warpgroup == Config::kProducerWarpgroup) {
    set_role_registers<Config::kProducerRegisters, kEntry>();
    LossAndGradProducer<Config>{{p, ss, k_pipe, q_pipe}, f_pipe}.run();
  } else if (warpgroup == Config::kScoreWarpgroup) {
    set_role_registers<Config::kScoreRegisters, kEntry>();
    ScoreMma<Config>{p, ss, k_pipe, q_pipe, a_pipe}.run();
  } else if (warpgroup == Config::kDkWarpgroup) {
    set_role_registers<Config::kDkRegisters, kEntry>();
    DkMma<Config>{p, ss, q_pipe, a_pipe, dk_pipe, f_pipe, &fp}.run();
  } else {
    set_role_registers<Config::kScatterRegisters, kEntry>();
    ScatterReduce<Config>{p, ss, dk_pipe}.run();
  }
}

}  // namespace dsaib::hopper
