// Score role (warpgroup 1): per block GEMM1 S = Q K^T, dW and the masked A
// (into sA[b] for the dK role's GEMM2), GEMM3 dQ += A K; dQ and dW at the end of
// the task. The P-free kernels first form the block's gs from GEMM1 (recompute_gs).
#pragma once

#include <cute/tensor.hpp>
#include <cuda/ptx>
#include <cutlass/arch/barrier.h>

#include "hopper/indexer_backward/head_sum.cuh"
#include "hopper/common/problem_device.cuh"
#include "hopper/common/shared_storage.cuh"
#include "hopper/common/warpgroup_gemm.cuh"

namespace dsaib::hopper {

template <class Config>
struct ScoreMma {
  using Element = typename Config::Element;
  static constexpr int kD = Config::kHeadDim;
  static constexpr int kBlock = Config::kBlockKeys;

  const IndexerParams& p;
  SharedStorage<Config>& ss;
  MbarrierPipeline<Config::kStagesK> k_pipe;   // this role consumes K stages
  MbarrierPipeline<Config::kStagesQ> q_pipe;   // and Q stages (with the dK role)
  MbarrierPipeline<Config::kABuffers> a_pipe;  // and fills sA for the dK role

  __device__ static void score_sync() {
    cutlass::arch::NamedBarrier::sync(Config::kScoreThreads, static_cast<uint32_t>(NamedBarrierId::kPFreeScoreSync));
  }

  /// The P-free kernels: gs_i = [P_i >= eps] g~_i - P_i G with P_i = exp(z_i - LSE),
  /// over gs[ks], from the block's logits z summed over the heads in a fixed order
  /// (head_sum.cuh, then the 4 warps in order). The f32 LSE's rounding cancels in
  /// P_i G: the forward divided G by the row's sum of P (docs/kl-forward.md).
  template <class Accumulator>
  __device__ void recompute_gs(const Accumulator& tSrS, const float (&w_row)[2], float lse, float G, int ks, int tid) {
    const int lane = tid % 32, warp = tid / 32;
    float col[16];
    CUTE_UNROLL
    for (int j = 0; j < 16; ++j) col[j] = 0.0f;
    CUTE_UNROLL
    for (int v = 0; v < kBlock / 2; ++v) col[(v / 4) * 2 + v % 2] += w_row[(v >> 1) & 1] * relu_keeping_nan(tSrS(v));
    // lane holds the sums over its warp's 16 heads of keys 2 * lane and 2 * lane + 1
    *reinterpret_cast<float2*>(&ss.p_free.z_part[warp][2 * lane]) = warp_head_sums(col, lane);
    score_sync();  // z_part complete
    if (tid < kBlock) {
      float z = 0.0f;
      CUTE_UNROLL
      for (int wi = 0; wi < Config::kScoreThreads / 32; ++wi) z += ss.p_free.z_part[wi][tid];
      const float g = ss.gs[ks][tid];  // g~_i = -c * max(T_i, eps); 0 on tail entries
      const float prob = ss.key_row[ks][tid] >= 0 ? expf(z - lse) : 0.0f;
      ss.gs[ks][tid] = (prob >= eps_exp_minus_100() ? g : 0.0f) - prob * G;
    }
    score_sync();  // gs[ks] complete; z_part read
  }

  __device__ void run() {
    using namespace cute;
    const int tid = threadIdx.x - Config::kScoreWarpgroup * Config::kThreadsPerWarpgroup;  // 0..127
    const int lane = tid % 32;
    const int warp = tid / 32;

    Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});     // (64 heads, D, stage)
    Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Config::SmemLayoutK{});     // (64 keys, D, stage)
    Tensor sKt = make_tensor(make_smem_ptr(ss.k), typename Config::SmemLayoutKt{});   // (D, 64 keys, stage)
    Tensor sAt = make_tensor(make_smem_ptr(ss.a), typename Config::SmemLayoutAt{});   // (64 heads, 64 keys, term, buf)

    typename Config::TiledMmaS mma_s;
    typename Config::TiledMmaDQ mma_dq;
    auto thr_s = mma_s.get_thread_slice(tid);
    auto thr_dq = mma_dq.get_thread_slice(tid);

    // GEMM1 operands and accumulator
    // Q in registers (GEMM1 is wgmma RS), loaded from sQ[qs] once per task with ldmatrix
    Tensor tSrQ = thr_s.partition_fragment_A(sQ(_, _, 0));  // (MMA, MMA_M, MMA_K) bf16 registers
    auto smem_copy_q = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_s);
    auto thr_copy_q = smem_copy_q.get_thread_slice(tid);
    Tensor tQsQ = thr_copy_q.partition_S(sQ);      // (CPY, CPY_M, CPY_K, stageQ)
    Tensor tQrQ = thr_copy_q.retile_D(tSrQ);
    Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stageK)
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<Config::kHeadTile>, Int<kBlock>>{});  // (MMA, M, N) fp32
    Tensor tSrA = make_tensor_like<Element>(tSrS);   // A_hi
    Tensor tSrAlo = make_tensor_like<Element>(tSrS); // A_lo = bf16(A - A_hi)
    // A leaves the accumulator layout (heads x keys) for sA (keys x heads,
    // heads contiguous) through transposing stmatrix: 8x8 bf16 tiles per instruction.
    auto smem_copy_a = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma_s);
    auto thr_copy_a = smem_copy_a.get_thread_slice(tid);
    Tensor tAsAt = thr_copy_a.partition_D(sAt);      // (CPY, CPY_M, CPY_N, term, buf)
    Tensor tArA = thr_copy_a.retile_S(tSrA);
    Tensor tArAlo = thr_copy_a.retile_S(tSrAlo);
    // GEMM3 takes A from registers (wgmma RS): the bf16 A terms, in the GEMM1
    // accumulator's layout, viewed as wgmma A fragments
    Tensor tDQrA = make_tensor(tSrA.data(), acc_layout_as_a_operand(tSrA.layout()));      // (MMA, M, K)
    Tensor tDQrAlo = make_tensor(tSrAlo.data(), acc_layout_as_a_operand(tSrAlo.layout()));
    static_assert(decltype(size<2>(tDQrA))::value == kBlock / 16, "one k-block per 16 keys");
    Tensor tDQrKt = thr_dq.partition_fragment_B(sKt);
    Tensor tDQrDQ = partition_fragment_C(mma_dq, Shape<Int<Config::kHeadTile>, Int<kD>>{});

    // wgmma accumulator (PTX ISA, "Register fragment D"): value i is at row
    // r0 + 8 * ((i / 2) % 2), column c0 + (i % 2) + 8 * (i / 4).
    static_assert(decltype(size(tSrS))::value == Config::kHeadTile * kBlock / 128, "one m64 tile per warpgroup");
    static_assert(decltype(size(tDQrDQ))::value == Config::kHeadTile * kD / 128, "one m64 tile per warpgroup");
    const int r0 = warp * 16 + lane / 4;
    const int c0 = 2 * (lane % 4);

    auto k_state = make_consumer_start_state<Config::kStagesK>();
    auto q_state = make_consumer_start_state<Config::kStagesQ>();
    auto a_state = make_producer_start_state<Config::kABuffers>();

    // ---- one task of the backward: its Q, weights and row statistics, then its blocks
    PipelineState<Config::kStagesQ> task_q{};  // the task's Q stage
    float w_row[2] = {0.0f, 0.0f};
    float row_lse = 0.0f, row_g = 0.0f;  // the P-free kernels: the row's LSE and G = -c * mass
    float dw[2] = {0.0f, 0.0f};
    auto k_prev = k_state;  // the previous backward block's stage, held until GEMM3 of that block completed
    bool holds_prev = false;
    auto begin_task = [&](const PipelineState<Config::kStagesQ>& qst) {
      task_q = qst;
      const int qs = qst.index;
      // No wgmma still reads Q's registers: each GEMM1 was waited for in its block.
      copy(smem_copy_q, tQsQ(_, _, _, qs), tQrQ);
      w_row[0] = ss.w_scaled[qs][r0];
      w_row[1] = ss.w_scaled[qs][r0 + 8];
      dw[0] = dw[1] = 0.0f;
      clear(tDQrDQ);
      holds_prev = false;
    };
    // One block. The wait after GEMM1 also completes the previous block's GEMM3,
    // so GEMM3 runs while this warpgroup waits for K; only then is that block's
    // stage released. Every wait has the same count on every path: a count that
    // depends on a runtime branch makes ptxas serialise every wgmma (C7514/C7515).
    auto backward_block = [&] {
      const auto kb = k_state;
      k_state.advance();
      const int ks = kb.index;
      k_pipe.consumer_wait(kb);  // K block, its gs and key_row
      warpgroup_gemm_rs<true>(mma_s, tSrQ, tSrK(_, _, _, ks), tSrS);  // GEMM1: S = Q K^T (Q from registers)
      warpgroup_wait<0>();  // GEMM1 of this block and GEMM3 of the previous one complete
      if (holds_prev) k_pipe.consumer_release(k_prev);  // GEMM1/GEMM3 reads of the previous stage are done
      if constexpr (kIsPFree<Config>) recompute_gs(tSrS, w_row, row_lse, row_g, ks, tid);

      // dW and the masked A (docs/math.md stage 2)
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) {
        const int key = c0 + (i % 2) + 8 * (i / 4);
        const float x = tSrS(i);
        const float gs = ss.gs[ks][key];
        const int half = (i >> 1) & 1;  // value i sits in row r0 + 8 * half
        dw[half] += gs * relu_keeping_nan(x);
        const float a = relu_passes(x) ? gs * w_row[half] : 0.0f;
        tSrA(i) = Element(a);
        if constexpr (Config::kSplitA) tSrAlo(i) = Element(a - static_cast<float>(tSrA(i)));
      }
      a_pipe.producer_acquire(a_state);  // the dK role's GEMM2 of two blocks ago read sA[b]
      const int b = a_state.index;
      // The stmatrix reads A's registers before GEMM3 is issued: PTX leaves any
      // access to a wgmma's A registers undefined until wgmma.wait_group.
      copy(smem_copy_a, tArA, tAsAt(_, _, _, 0, b));
      if constexpr (Config::kSplitA) copy(smem_copy_a, tArAlo, tAsAt(_, _, _, 1, b));
      if (lane < 16) ss.a_key_row[b][16 * warp + lane] = ss.key_row[ks][16 * warp + lane];
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // sA is read by the dK role's wgmma next
      // GEMM3, A from registers: the next block's wait completes it before A is rewritten.
      warpgroup_gemm_rs<false>(mma_dq, tDQrA, tDQrKt(_, _, _, ks), tDQrDQ);
      if constexpr (Config::kSplitA) warpgroup_gemm_rs<false>(mma_dq, tDQrAlo, tDQrKt(_, _, _, ks), tDQrDQ);
      a_pipe.producer_commit(a_state);  // every thread, after its stores and fence
      a_state.advance();
      k_prev = kb;
      holds_prev = true;
    };
    // After the task's last block: dQ and dW out.
    auto end_task = [&](int64_t task) {
      const int64_t row = task / p.head_groups;
      const int h0 = static_cast<int>(task % p.head_groups) * Config::kHeadTile;
      const int nh = min(Config::kHeadTile, p.heads - h0);
      warpgroup_wait<0>();  // the last GEMM3 of the task: dQ is read next
      if (holds_prev) k_pipe.consumer_release(k_prev);
      q_pipe.consumer_release(task_q);  // this role's ldmatrix reads of q[qs] are done

      // ---- epilogue: dW (quad reduction over the 4 lanes sharing a row), dQ
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        float v = dw[half];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        const int h = r0 + 8 * half;
        if (lane % 4 == 0 && h < nh) {
          const int64_t o = row * p.heads + h0 + h;
          if (p.dw_f32) static_cast<float*>(p.d_weights)[o] = v * p.sm_scale;
          else static_cast<Element*>(p.d_weights)[o] = Element(v * p.sm_scale);
        }
      }
      CUTE_UNROLL
      for (int i = 0; i < size(tDQrDQ); i += 2) {
        const int h = r0 + 8 * ((i / 2) % 2);
        const int d = c0 + 8 * (i / 4);  // values i, i+1 are columns d, d+1
        if (h < nh) {
          const int64_t o = (row * p.heads + h0 + h) * kD + d;
          if (p.dq_f32) {
            *reinterpret_cast<float2*>(static_cast<float*>(p.d_index_q) + o) = make_float2(tDQrDQ(i), tDQrDQ(i + 1));
          } else {
            __nv_bfloat162 packed = __floats2bfloat162_rn(tDQrDQ(i), tDQrDQ(i + 1));
            *reinterpret_cast<__nv_bfloat162*>(static_cast<Element*>(p.d_index_q) + o) = packed;
          }
        }
      }
    };

    for (int64_t task = blockIdx.x; task < p.num_tasks; task += gridDim.x) {
      q_pipe.consumer_wait(q_state);
      const int num_blocks = ss.num_blocks[q_state.index];
      if constexpr (kFusesForward<Config>) {
        // The row's LSE and G from the dK role's forward of it (stats_full, on
        // this q_full wait's phase: loss_and_grad/loss_and_grad_storage.cuh).
        mbarrier_wait(&ss.fused.stats_full[q_state.index], q_state.phase, 5u);
      }
      begin_task(q_state);
      if constexpr (kIsPFree<Config>) {
        row_lse = ss.p_free.row_lse[q_state.index];
        row_g = ss.p_free.row_g[q_state.index];
      }
      q_state.advance();
      for (int blk = 0; blk < num_blocks; ++blk) backward_block();
      end_task(task);
    }
  }
};

}  // namespace dsaib::hopper
