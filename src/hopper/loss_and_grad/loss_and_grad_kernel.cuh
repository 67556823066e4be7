// The sm_90a loss-and-gradient kernel (docs/hopper-kernel.md §15): the P-free
// backward whose producer and dK role also run the loss forward's pass over the
// CTA's next row, so that the forward's gathers and GEMM1 run under the
// backward's dK reductions instead of in a launch of their own.
//   warpgroup 0: LossAndGradProducer (loss_and_grad_producer.cuh)
//   warpgroup 1: ScoreMma, its row's LSE and G from the dK role (stats_full)
//   warpgroup 2: DkMma with run_forward_steps (dk_forward_steps.cuh)
//   warpgroup 3: ScatterReduce
// Barrier contracts beyond the backward's: loss_and_grad_storage.cuh.
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
  // The loss forward's blocks pad where this kernel's forward chunks end, so that
  // both give a row's keys to the same threads (forward_tile_config.cuh).
  static_assert(ForwardTileConfig<Config::kHeadDim, 64>::kBlockPadSlots == Config::kSlotChunk,
                "the loss forward pads its blocks at this kernel's chunks");
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
