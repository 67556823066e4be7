// dK role (warpgroup 2): per block, GEMM2 dK_blk = A^T Q from sA[b], then the
// block staged row-contiguous for the scatter role; after its last task, the
// end marker that stops the scatter role.
#pragma once

#include <cute/tensor.hpp>

#include "hopper/common/kernel_params.hpp"
#include "hopper/common/problem_device.cuh"
#include "hopper/common/shared_storage.cuh"
#include "hopper/common/warpgroup_gemm.cuh"

namespace dsaib::hopper {

template <class Config>
struct DkMma {
  static constexpr int kD = Config::kHeadDim;
  static constexpr int kBlock = Config::kBlockKeys;

  const IndexerParams& p;
  SharedStorage<Config>& ss;
  MbarrierPipeline<Config::kStagesQ> q_pipe;     // this role reads Q stages (with the score role)
  MbarrierPipeline<Config::kABuffers> a_pipe;    // consumes sA
  MbarrierPipeline<Config::kDkBuffers> dk_pipe;  // and fills the staging buffers
  // The loss-and-gradient kernel: this role also runs the forward blocks.
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
    // Accumulator value i is key row r0 + 8*((i/2)%2), column c0 + (i%2) + 8*(i/4):
    // warp w holds key rows 16w..16w+15 whole.
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

      // Staged so that the scatter role's reds cover whole key rows (tile_config.cuh).
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

  /// The loss-and-gradient kernel's steps: GEMM2 of row r_{n-1}'s backward
  /// blocks and row r_n's forward blocks, in the producer's order. Defined in
  /// loss_and_grad/dk_forward_steps.cuh; the backward's kernels never instantiate it.
  template <class DkBlock>
  __device__ void run_forward_steps(DkBlock&& dk_block, PipelineState<Config::kStagesQ>& q_state, int tid, int lane,
                                    int warp);
};

}  // namespace dsaib::hopper
