// dK role (warpgroup 2, kDkRegisters): per task, for each block whose A the
// score role (score_mma.cuh) put in sA[b],
//   GEMM2 dK_blk = A^T Q (every A term)
// then the dK block is staged row-contiguous in shared memory for the scatter
// role (scatter_reduce.cuh), which adds it into the global fp32 dK
// accumulator. After its last task this role stages an end marker.
#pragma once

#include <cute/tensor.hpp>

#include "hopper/forward_score.cuh"
#include "hopper/problem_device.cuh"
#include "hopper/shared_storage.cuh"
#include "hopper/warpgroup_gemm.cuh"

namespace dsaib::hopper {

template <class Config>
struct DkMma {
  static constexpr int kD = Config::kHeadDim;
  static constexpr int kBlock = Config::kBlockKeys;

  const IndexerBackwardParams& p;
  SharedStorage<Config>& ss;
  MbarrierPipeline<Config::kStagesQ> q_pipe;     // this role reads Q stages (with the score role)
  MbarrierPipeline<Config::kABuffers> a_pipe;    // consumes sA
  MbarrierPipeline<Config::kDkBuffers> dk_pipe;  // and fills the staging buffers
  // The loss-and-gradient kernels (LossAndGradConfig): this role also runs the
  // forward blocks, from their ring of K stages, and writes the forward's outputs.
  MbarrierPipeline<kForwardStagesOf<Config>> f_pipe{};
  const IndexerKLForwardParams* fp = nullptr;

  __device__ void run() {
    using namespace cute;
    const int tid = threadIdx.x - Config::kDkWarpgroup * Config::kThreadsPerWarpgroup;  // 0..127
    const int lane = tid % 32;
    const int warp = tid / 32;

    Tensor sQt = make_tensor(make_smem_ptr(ss.q), typename Config::SmemLayoutQt{});   // (D, 64 heads, stage)
    Tensor sA = make_tensor(make_smem_ptr(ss.a), typename Config::SmemLayoutA{});     // (64 keys, 64 heads, term, buf)
    typename Config::TiledMmaDK mma_dk;
    auto thr_dk = mma_dk.get_thread_slice(tid);
    Tensor tDKrA = thr_dk.partition_fragment_A(sA);  // (MMA, M, K, term, buf)
    Tensor tDKrQt = thr_dk.partition_fragment_B(sQt);
    Tensor tDKrDK = partition_fragment_C(mma_dk, Shape<Int<kBlock>, Int<kD>>{});
    static_assert(decltype(size(tDKrDK))::value == kBlock * kD / 128, "one m64 tile per warpgroup");
    // Accumulator value i of a thread is key row r0 + 8*((i/2)%2), column
    // c0 + (i%2) + 8*(i/4): warp w holds key rows 16w..16w+15 whole.
    const int r0 = warp * 16 + lane / 4;
    const int c0 = 2 * (lane % 4);

    auto q_state = make_consumer_start_state<Config::kStagesQ>();
    auto a_state = make_consumer_start_state<Config::kABuffers>();
    auto dk_state = make_producer_start_state<Config::kDkBuffers>();

    // One block: GEMM2 from sA[b] and Q stage qs, then its dK staged for the scatter role.
    auto dk_block = [&](int qs) {
      a_pipe.consumer_wait(a_state);  // A of block blk in sA[b], its key rows in a_key_row[b]
      const int b = a_state.index;
      warpgroup_gemm<true>(mma_dk, tDKrA(_, _, _, 0, b), tDKrQt(_, _, _, qs), tDKrDK);  // GEMM2: dK_blk = A^T Q
      if constexpr (Config::kSplitA) warpgroup_gemm<false>(mma_dk, tDKrA(_, _, _, 1, b), tDKrQt(_, _, _, qs), tDKrDK);
      const int32_t key_row = lane < 16 ? ss.a_key_row[b][16 * warp + lane] : -1;
      warpgroup_wait<0>();
      a_pipe.consumer_release(a_state);  // GEMM2 reads of sA[b] and this thread's read of a_key_row[b] are done
      a_state.advance();

      // dK staging: warp w writes its key rows 16w..16w+15 to the same rows
      // of dk_stage[buf], and the scatter role reads them back
      // row-contiguous: one float4 red per lane covers kLanesPerRow*16 B of
      // one key row (a whole 512-B row at D=128) instead of 32 B of each of
      // 16 rows (the L2 adds whole rows at ~3.5 TB/s and the
      // fragment pattern at ~2.2 TB/s). RAW and WAR on buffer buf: dk_full /
      // dk_empty (contract blocks in shared_storage.cuh): every dK-role
      // thread arrives after its stores, every scatter thread after its loads.
      const int buf = dk_state.index;
      dk_pipe.producer_acquire(dk_state);  // the scatter role has read buffer buf
      CUTE_UNROLL
      for (int j = 0; j < kD / 8; ++j) {
        *reinterpret_cast<float2*>(&ss.dk_stage[buf][r0][c0 + 8 * j]) = make_float2(tDKrDK(4 * j), tDKrDK(4 * j + 1));
        *reinterpret_cast<float2*>(&ss.dk_stage[buf][r0 + 8][c0 + 8 * j]) = make_float2(tDKrDK(4 * j + 2), tDKrDK(4 * j + 3));
      }
      if (lane < 16) ss.dk_key_row[buf][16 * warp + lane] = key_row;
      if (tid == 0) ss.dk_end[buf] = 0;
      dk_pipe.producer_commit(dk_state);  // every dK-role thread, after its stores
      dk_state.advance();
    };

    if constexpr (!kFusesForward<Config>) {
      for (int64_t task = blockIdx.x; task < p.num_tasks; task += gridDim.x) {
        q_pipe.consumer_wait(q_state);
        const int qs = q_state.index;
        const int num_blocks = ss.num_blocks[qs];
        for (int blk = 0; blk < num_blocks; ++blk) dk_block(qs);
        q_pipe.consumer_release(q_state);  // GEMM2 reads of q[qs] were waited for
        q_state.advance();
      }
    } else {
      run_forward_steps(dk_block, q_state, tid, lane, warp);
    }
    // The end marker: the scatter role exits.
    dk_pipe.producer_acquire(dk_state);
    if (tid == 0) ss.dk_end[dk_state.index] = 1;
    dk_pipe.producer_commit(dk_state);
  }

  /// The loss-and-gradient kernels' steps (loss_and_grad_kernel.cuh): step n
  /// runs GEMM2 of the backward blocks of the CTA's row r_{n-1} and the forward
  /// blocks of r_n, in the producer's order (loss_and_grad_producer.cuh):
  /// backward block 0, forward block 0, backward block 1, ... A forward block:
  /// GEMM1 S^T = K Q^T (keys as M, both operands in shared memory), the head
  /// sum and the row statistics (ForwardScore::add_block); after the step,
  /// r_n's LSE, target mass and loss term (ForwardScore::finish_row), and its
  /// LSE and G = -c * mass for the score role's backward of it (stats_full).
  /// The dK accumulator is dead between blocks, so the forward's accumulator
  /// takes no registers of it.
  template <class DkBlock>
  __device__ void run_forward_steps(DkBlock&& dk_block, PipelineState<Config::kStagesQ>& q_state, int tid, int lane,
                                    int warp) {
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
    RowStatistics st{};
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
      // The producer's order (loss_and_grad_producer.cuh): the backward's first
      // block comes before the forward row's Q stage.
      const int early = min(nb, 1);
      for (int i = 0; i < early; ++i) dk_block(b_q.index);
      if (forward_row) {
        q_pipe.consumer_wait(q_state);
        f_qs = q_state.index;
        // warp-uniform as ptxas sees it, so the wgmma issues below are not on a divergent path
        f_blocks = __shfl_sync(0xffffffffu, ss.num_blocks[f_qs], 0);
        q_state.advance();
      }
      st = RowStatistics{-INFINITY, 0.0f, INFINITY, 0.0, 0.0, 0};
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
          ss.recompute_p.row_lse[f_qs] = fp->row_lse[f_task];
          ss.recompute_p.row_g[f_qs] = -c * fp->row_target_mass[f_task];
          (void)cuda::ptx::mbarrier_arrive(&ss.fused.stats_full[f_qs]);
        }
      }
      backward_row = forward_row;
      b_blocks = f_blocks;
      b_q = f_q;
    }
  }
};

}  // namespace dsaib::hopper
