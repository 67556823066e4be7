// The dK role's steps in the loss-and-gradient kernel, DkMma::run_forward_steps:
// step n runs GEMM2 of the backward blocks of the CTA's row r_{n-1} and the loss
// forward's blocks of r_n (GEMM1 with keys as M, head sum, row statistics) in
// the producer's order, then r_n's outputs and its LSE and G for the score role.
// The dK accumulator is dead between blocks: the forward's takes its registers.
#pragma once

#include <cute/tensor.hpp>
#include <cuda/ptx>

#include "hopper/indexer_backward/dk_mma.cuh"
#include "hopper/kl_forward/forward_score.cuh"
#include "hopper/loss_and_grad/loss_and_grad_storage.cuh"

namespace dsaib::hopper {

template <class Config>
template <class DkBlock>
__device__ void DkMma<Config>::run_forward_steps(DkBlock&& dk_block, PipelineState<Config::kStagesQ>& q_state, int tid,
                                                 int lane, int warp) {
  using namespace cute;
  static_assert(Config::kDkThreads == Config::kScoreThreads, "the forward's row statistics over 128 threads");
  // Slot passes in batches of 4 slots per thread: this role has 112 registers.
  using Forward = ForwardScore<Config, LossAndGradStorage<Config>, Config::kDkWarpgroup, 4>;
  Forward fwd{*fp, ss.fused, MbarrierPipeline<Config::kStagesK>{}, q_pipe};
  constexpr int kN = Config::kHeadTile;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});  // (heads, D, stage)
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Config::SmemLayoutK{});  // (64 keys, D, stage)
  typename Config::TiledMmaForwardS mma_f;
  auto thr_f = mma_f.get_thread_slice(tid);
  Tensor tFsK = thr_f.partition_fragment_A(sK);  // (MMA, M, K, stage) descriptors
  Tensor tFsQ = thr_f.partition_fragment_B(sQ);  // (MMA, N, K, stage) descriptors
  Tensor acc_f = partition_fragment_C(mma_f, Shape<Int<kBlock>, Int<kN>>{});
  static_assert(decltype(size(acc_f))::value == kN / 2, "one m64 tile: N/2 values per thread");
  // wgmma m64nNk16 accumulator: value v is key r0 + 8 * ((v / 2) % 2), head c0 + (v % 2) + 8 * (v / 4)
  const int r0 = warp * 16 + lane / 4;
  const int c0 = 2 * (lane % 4);
  const int quad = lane % 4;
  const int my_key = r0 + 8 * (quad & 1);  // quad lanes 0 and 1; lanes 2 and 3 take none
  const float eps = eps_exp_minus_100();
  const float c = loss_scale(p);
  float* z_row = fp->z_scratch + static_cast<int64_t>(blockIdx.x) * fp->z_stride;
  auto f_state = make_consumer_start_state<Config::kForwardStages>();
  RowRunningStats st{};
  int f_qs = 0;
  auto forward_block = [&] {
    const int fs = f_state.index;
    f_pipe.consumer_wait(f_state);
    warpgroup_gemm<true>(mma_f, tFsK(_, _, _, Config::kStagesK + fs), tFsQ(_, _, _, f_qs), acc_f);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_f);
    const int slot = quad < 2 ? ss.fused.key_slot[fs][my_key] : -1;
    const float target = quad < 2 ? ss.fused.key_target[fs][my_key] : 0.0f;
    f_pipe.consumer_release(f_state);  // GEMM1's reads of the stage and this thread's of key_slot / key_target
    f_state.advance();
    const float* w_smem = ss.w_scaled[f_qs];
    Forward::add_block(acc_f, [&](int k) { return w_smem[c0 + 8 * (k / 2) + k % 2]; }, quad, slot, target, st, z_row);
  };

  bool backward_row = false;
  int b_blocks = 0;
  PipelineState<Config::kStagesQ> b_q{};
  for (uint32_t n = 0;; ++n) {
    const int64_t f_task = blockIdx.x + static_cast<int64_t>(n) * gridDim.x;
    const bool forward_row = f_task < p.num_tasks;
    if (!forward_row && !backward_row) break;
    int f_blocks = 0;
    const auto f_q = q_state;
    const int nb = backward_row ? b_blocks : 0;
    // The producer's order: the backward's first block before the forward row's Q stage.
    const int early = min(nb, 1);
    for (int i = 0; i < early; ++i) dk_block(b_q.index);
    if (forward_row) {
      q_pipe.consumer_wait(q_state);
      f_qs = q_state.index;
      // warp-uniform as ptxas sees it, so the wgmma issues below are not on a divergent path
      f_blocks = __shfl_sync(0xffffffffu, ss.num_blocks[f_qs], 0);
      q_state.advance();
    }
    st = RowRunningStats{-INFINITY, 0.0f, INFINITY, 0.0, 0.0, 0};
    const int both = min(nb, f_blocks);
    for (int i = 0; i < both; ++i) {
      if (i >= early) dk_block(b_q.index);
      forward_block();
    }
    for (int i = max(both, early); i < nb; ++i) dk_block(b_q.index);
    // every GEMM2 of the row was waited for: the producer may reload its Q stage
    if (backward_row) q_pipe.consumer_release(b_q);
    for (int i = both; i < f_blocks; ++i) forward_block();
    if (forward_row) {
      fwd.finish_row(f_task, st, n, z_row, eps);
      if (tid == 0) {
        // this thread wrote them in finish_row
        ss.p_free.row_lse[f_qs] = fp->row_lse[f_task];
        ss.p_free.row_g[f_qs] = -c * fp->row_target_mass[f_task];
        (void)cuda::ptx::mbarrier_arrive(&ss.fused.stats_full[f_qs]);
      }
    }
    backward_row = forward_row;
    b_blocks = f_blocks;
    b_q = f_q;
  }
}

}  // namespace dsaib::hopper
