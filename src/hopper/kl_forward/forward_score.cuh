// The loss forward's score role (docs/kl-forward.md, "The cuda kernel"): per
// block GEMM1 with keys as M, the next block's GEMM1 issued before this one's
// head sum; each key's logit into the row's running statistics in slot order,
// whatever the grid. A row's LSE, loss term and target mass come from the
// statistics, unless a slot is clipped or |LSE| is large: then one pass over
// its slots. Every reduction has a fixed order: bitwise reproducible.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cute/tensor.hpp>
#include <cuda/ptx>

#include "hopper/common/kernel_params.hpp"
#include "hopper/common/row_running_stats.cuh"
#include "hopper/kl_forward/row_softmax_finish.cuh"
#include "hopper/kl_forward/forward_shared_storage.cuh"
#include "hopper/common/problem_device.cuh"
#include "hopper/common/producer_gather.cuh"
#include "hopper/common/warpgroup_gemm.cuh"

namespace dsaib::hopper {

/// Storage: the shared memory with row_stats / row_part (ForwardSharedStorage, or
/// LossAndGradStorage in the loss-and-gradient kernel's dK role). kWarpgroup: the
/// warpgroup that runs the role. kBatch: slots per thread per batch of a slot pass.
template <class Config, class Storage = ForwardSharedStorage<Config>, int kWarpgroup = Config::kScoreWarpgroup,
          int kBatch = 16>
struct ForwardScore {
  using Element = typename Config::Element;
  static constexpr int kBlock = Config::kBlockKeys;
  static constexpr int kN = Config::kHeadTile;  // heads, as wgmma N
  static constexpr int kThreads = Config::kScoreThreads;
  static constexpr int kWarps = kThreads / 32;
  using Finish = RowSoftmaxFinish<Storage, kThreads, kWarpgroup, kBatch>;

  const IndexerKLForwardParams& fp;
  Storage& ss;
  MbarrierPipeline<Config::kStagesK> k_pipe;
  MbarrierPipeline<Config::kStagesQ> q_pipe;

  __device__ void run() {
    using namespace cute;
    const IndexerParams& p = fp.in;
    const int tid = threadIdx.x - kWarpgroup * Config::kThreadsPerWarpgroup;  // 0..127
    const int lane = tid % 32;
    const int warp = tid / 32;
    const float eps = eps_exp_minus_100();

    Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});  // (heads, D, stage)
    Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Config::SmemLayoutK{});  // (64 keys, D, stage)
    typename Config::TiledMmaS mma_s;
    auto thr_s = mma_s.get_thread_slice(tid);
    Tensor tSsK = thr_s.partition_fragment_A(sK);  // (MMA, M, K, stage) descriptors
    Tensor tSsQ = thr_s.partition_fragment_B(sQ);  // (MMA, N, K, stage) descriptors
    Tensor acc0 = partition_fragment_C(mma_s, Shape<Int<kBlock>, Int<kN>>{});
    Tensor acc1 = partition_fragment_C(mma_s, Shape<Int<kBlock>, Int<kN>>{});
    // wgmma accumulator: value v is key r0 + 8 * ((v / 2) % 2), head c0 + (v % 2) + 8 * (v / 4).
    static_assert(decltype(size(acc0))::value == kN / 2, "one m64 tile: N/2 values per thread");
    const int r0 = warp * 16 + lane / 4;
    const int c0 = 2 * (lane % 4);
    const int quad = lane % 4;
    const int my_key = r0 + 8 * (quad & 1);  // quad lanes 0 and 1; lanes 2 and 3 take none

    float* z_row = fp.z_scratch + static_cast<int64_t>(blockIdx.x) * fp.z_stride;
    auto k_state = make_consumer_start_state<Config::kStagesK>();
    auto q_state = make_consumer_start_state<Config::kStagesQ>();
    uint32_t n = 0;  // rows so far

    for (int64_t row = blockIdx.x; row < p.num_tasks; row += gridDim.x, ++n) {
      q_pipe.consumer_wait(q_state);
      const int qs = q_state.index;
      // w sm_scale of head c0 + 8 (k / 2) + k % 2: in registers with one CTA an
      // SM, else read from shared memory at each block (three CTAs an SM leave 80
      // registers a thread, which the held weights would exceed)
      constexpr bool kWeightsInRegisters = Config::kCtasPerSm == 1;
      const float* w_row = &ss.w_scaled[qs][c0];
      float w[kN / 4];
      CUTE_UNROLL
      for (int k = 0; k < kN / 4; ++k) w[k] = kWeightsInRegisters ? w_row[8 * (k / 2) + k % 2] : 0.0f;
      auto weight = [&](int k) { return kWeightsInRegisters ? w[k] : w_row[8 * (k / 2) + k % 2]; };

      RowRunningStats st{-INFINITY, 0.0f, INFINITY, 0.0, 0.0, 0};
      // GEMM1 of the block after k_state's into `acc`.
      auto issue_next = [&](auto& acc) {
        auto next = k_state;
        next.advance();
        k_pipe.consumer_wait(next);
        warpgroup_gemm<true>(mma_s, tSsK(_, _, _, next.index), tSsQ(_, _, _, qs), acc);
      };
      // k_state's block, its GEMM1 waited for: free the stage, add its keys.
      auto consume = [&](auto& acc) {
        warpgroup_fence_operand(acc);
        const int ks = k_state.index;
        const int slot = quad < 2 ? ss.key_slot[ks][my_key] : -1;
        const float target = quad < 2 ? ss.key_target[ks][my_key] : 0.0f;
        k_pipe.consumer_release(k_state);  // GEMM1's reads of k[ks] and this thread's of key_slot / key_target
        k_state.advance();

        add_block(acc, weight, quad, slot, target, st, z_row);
      };
      // Whether k_state's block (waited for) ends the row: warp-uniform as ptxas
      // sees it, so the wgmma issues below are not on a divergent path.
      auto ends_row = [&] { return __shfl_sync(0xffffffffu, ss.block_last[k_state.index], 0) != 0; };
      // Two accumulators, so the next GEMM1 runs under this head sum; pairs, with
      // no branch around the wgmma issues (ptxas would serialise them). Every row
      // has a block; the producer marks its last.
      k_pipe.consumer_wait(k_state);
      warpgroup_gemm<true>(mma_s, tSsK(_, _, _, k_state.index), tSsQ(_, _, _, qs), acc0);
      while (true) {
        if (ends_row()) {
          warpgroup_wait<0>();
          consume(acc0);
          break;
        }
        issue_next(acc1);
        warpgroup_wait<1>();
        consume(acc0);
        if (ends_row()) {
          warpgroup_wait<0>();
          consume(acc1);
          break;
        }
        issue_next(acc0);
        warpgroup_wait<1>();
        consume(acc1);
      }
      q_pipe.consumer_release(q_state);  // every GEMM1 of the row retired; w_scaled read
      q_state.advance();
      finish_row(row, st, n, z_row, eps);
    }
  }

  /// A block's keys from its accumulator: each key's z over the thread's heads,
  /// then its quad's; quad lanes 0 and 1 add their key to `st` and z_row[slot].
  /// w(k): w sm_scale of head c0 + 8 (k / 2) + k % 2.
  template <class Accumulator, class Weight>
  __device__ static void add_block(const Accumulator& acc, Weight&& w, int quad, int slot, float target,
                                   RowRunningStats& st, float* z_row) {
    // relu with NaN kept (torch's relu): a NaN logit makes the row's sum, LSE and loss NaN
    float zp[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    CUTE_UNROLL
    for (int v = 0; v < kN / 2; ++v) zp[(v / 2) % 2][(v / 4) % 2] += w((v / 4) * 2 + v % 2) * relu_keeping_nan(acc(v));
    float z0 = zp[0][0] + zp[0][1], z1 = zp[1][0] + zp[1][1];
    z0 += __shfl_xor_sync(0xffffffffu, z0, 1);
    z1 += __shfl_xor_sync(0xffffffffu, z1, 1);
    z0 += __shfl_xor_sync(0xffffffffu, z0, 2);
    z1 += __shfl_xor_sync(0xffffffffu, z1, 2);
    if (slot >= 0) {  // tail entries (slot -1) are zero-filled keys, not slots
      const float z = (quad & 1) ? z1 : z0;
      z_row[slot] = z;
      Finish::add_logit(z, target, st);
    }
  }

  /// The row's LSE, target mass and loss term from the threads' statistics.
  __device__ void finish_row(int64_t row, RowRunningStats st, uint32_t n, const float* z_row, float eps) {
    Finish{fp, ss}.finish_row(row, st, n, z_row, eps);
  }
};

}  // namespace dsaib::hopper
