// Consumer role (warpgroup 1): per task, for each gathered block of keys,
//   GEMM1 S = Q K^T -> dW, masked A -> GEMM2 dK_blk = A^T Q, GEMM3 dQ += A K
// then the dK block is staged in shared memory and scatter-added row by row with
// float4 reductions by the scatter role (scatter_reduce.cuh) from a double
// buffer; dQ and dW are written at the end of the task. After its last task the
// consumer stages an end marker.
#pragma once

#include <cute/tensor.hpp>
#include <cuda/ptx>
#include <cutlass/arch/barrier.h>

#include "hopper/problem_device.cuh"
#include "hopper/shared_storage.cuh"

namespace dsaib::hopper {

/// Issues one warpgroup GEMM over all k-blocks of the operands (async; the
/// caller waits with warpgroup_wait).
template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, const TA& tA, const TB& tB, TC& tC) {
  cute::warpgroup_fence_operand(tC);
  cute::warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < cute::size<2>(tA); ++kb) {
    cute::gemm(mma, tA(cute::_, cute::_, kb), tB(cute::_, cute::_, kb), tC);
    mma.accumulate_ = cute::GMMA::ScaleOut::One;
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_fence_operand(tC);
}

template <class Config>
struct ConsumerMma {
  using Element = typename Config::Element;
  static constexpr int kD = Config::kHeadDim;
  static constexpr int kBlock = Config::kBlockKeys;

  const IndexerBackwardParams& p;
  SharedStorage<Config>& ss;
  MbarrierPipeline<Config::kStagesK> k_pipe;
  MbarrierPipeline<Config::kStagesQ> q_pipe;
  MbarrierPipeline<Config::kDkBuffers> dk_pipe;  // this role fills the staging buffers

  __device__ void run() {
    using namespace cute;
    const int tid = threadIdx.x - Config::kProducerWarpgroups * Config::kThreadsPerWarpgroup;  // 0..127
    const int lane = tid % 32;

    Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});     // (64 heads, D, stage)
    Tensor sQt = make_tensor(make_smem_ptr(ss.q), typename Config::SmemLayoutQt{});   // (D, 64 heads, stage)
    Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Config::SmemLayoutK{});     // (64 keys, D, stage)
    Tensor sKt = make_tensor(make_smem_ptr(ss.k), typename Config::SmemLayoutKt{});   // (D, 64 keys, stage)
    Tensor sA = make_tensor(make_smem_ptr(ss.a), typename Config::SmemLayoutA{});     // (64 keys, 64 heads, term, buf)
    Tensor sAt = make_tensor(make_smem_ptr(ss.a), typename Config::SmemLayoutAt{});   // (64 heads, 64 keys, term, buf)

    typename Config::TiledMmaS mma_s;
    typename Config::TiledMmaDK mma_dk;
    typename Config::TiledMmaDQ mma_dq;
    auto thr_s = mma_s.get_thread_slice(tid);
    auto thr_dk = mma_dk.get_thread_slice(tid);
    auto thr_dq = mma_dq.get_thread_slice(tid);

    // GEMM1 operands and accumulator
    Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K, stageQ) descriptors
    Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stageK)
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<Config::kHeadTile>, Int<kBlock>>{});  // (MMA, M, N) fp32
    Tensor tSrA = make_tensor_like<Element>(tSrS);   // A_hi
    Tensor tSrAlo = make_tensor_like<Element>(tSrS); // A_lo = bf16(A - A_hi)
    // A leaves the accumulator layout (heads x keys) for sA (keys x heads,
    // heads contiguous) through transposing stmatrix: 8x8 bf16 tiles per instruction.
    auto smem_copy_a = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma_s);
    auto thr_copy_a = smem_copy_a.get_thread_slice(tid);
    Tensor tAsAt = thr_copy_a.partition_D(sAt);      // (CPY, CPY_M, CPY_N, term)
    Tensor tArA = thr_copy_a.retile_S(tSrA);
    Tensor tArAlo = thr_copy_a.retile_S(tSrAlo);
    // GEMM2
    Tensor tDKrA = thr_dk.partition_fragment_A(sA);  // (MMA, M, K, term)
    Tensor tDKrQt = thr_dk.partition_fragment_B(sQt);
    Tensor tDKrDK = partition_fragment_C(mma_dk, Shape<Int<kBlock>, Int<kD>>{});
    // GEMM3
    Tensor tDQrAt = thr_dq.partition_fragment_A(sAt);  // (MMA, M, K, term)
    Tensor tDQrKt = thr_dq.partition_fragment_B(sKt);
    Tensor tDQrDQ = partition_fragment_C(mma_dq, Shape<Int<Config::kHeadTile>, Int<kD>>{});

    // wgmma m64nNk16 accumulator layout (PTX ISA, "Register fragment D"):
    // value i of thread tid sits at row r0 + 8 * ((i / 2) % 2) and column
    // c0 + (i % 2) + 8 * (i / 4), with r0 = 16 * warp + lane / 4, c0 = 2 * (lane % 4).
    static_assert(decltype(size(tSrS))::value == Config::kHeadTile * kBlock / 128, "one m64 tile per warpgroup");
    static_assert(decltype(size(tDQrDQ))::value == Config::kHeadTile * kD / 128, "one m64 tile per warpgroup");
    const int r0 = (tid / 32) * 16 + lane / 4;
    const int c0 = 2 * (lane % 4);

    auto k_state = make_consumer_start_state<Config::kStagesK>();
    auto q_state = make_consumer_start_state<Config::kStagesQ>();
    int a_buf = 0;  // sA double buffer (see the WAR note below)
    auto dk_state = make_producer_start_state<Config::kDkBuffers>();

    for (int64_t task = blockIdx.x; task < p.num_tasks; task += gridDim.x) {
      const int64_t row = task / p.head_groups;
      const int h0 = static_cast<int>(task % p.head_groups) * Config::kHeadTile;
      const int nh = min(Config::kHeadTile, p.heads - h0);

      q_pipe.consumer_wait(q_state);
      const int qs = q_state.index;
      const int num_blocks = ss.num_blocks[qs];
      const float w_row[2] = {ss.w_scaled[qs][r0], ss.w_scaled[qs][r0 + 8]};
      float dw[2] = {0.0f, 0.0f};
      clear(tDQrDQ);

      // With kGemm1Ahead (tile_config.cuh), GEMM1 of block blk+1 is issued
      // right after GEMM2/3 of block blk, so the tensor pipe works on it while
      // this warpgroup stages block blk's dK. S (tSrS) is free by then: A of
      // block blk has left it for tSrA and sA. Per block, three wgmma steps in
      // order: GEMM2 (kATerms groups), GEMM3 (kATerms groups), then GEMM1 of
      // the next block or an empty group (one group either way), so every wait
      // counts the same groups on every path; waits that depend on a runtime
      // branch make ptxas serialise every wgmma (C7514/C7515, perf-log v25).
      if constexpr (Config::kGemm1Ahead) {
        if (num_blocks > 0) {
          k_pipe.consumer_wait(k_state);  // K block 0, its gs and key_row
          warpgroup_gemm<true>(mma_s, tSrQ(_, _, _, qs), tSrK(_, _, _, k_state.index), tSrS);  // GEMM1 of block 0
        }
      }
      for (int blk = 0; blk < num_blocks; ++blk) {
        const int ks = k_state.index;
        if constexpr (!Config::kGemm1Ahead) {
          k_pipe.consumer_wait(k_state);
          warpgroup_gemm<true>(mma_s, tSrQ(_, _, _, qs), tSrK(_, _, _, ks), tSrS);  // GEMM1: S = Q K^T
        }
        warpgroup_wait<0>();  // GEMM1 of this block complete
        if constexpr (Config::kGemm1Ahead) warpgroup_fence_operand(tSrS);

        // dW and the masked A (docs/math.md stage 2)
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          const int key = c0 + (i % 2) + 8 * (i / 4);
          const float x = tSrS(i);
          const float gs = ss.gs[ks][key];
          const int half = (i >> 1) & 1;  // value i sits in row r0 + 8 * half
          dw[half] += gs * fmaxf(x, 0.0f);
          const float a = x > 0.0f ? gs * w_row[half] : 0.0f;
          tSrA(i) = Element(a);
          if constexpr (Config::kSplitA) tSrAlo(i) = Element(a - static_cast<float>(tSrA(i)));
        }
        // WAR on sA[a_buf]: its last readers were GEMM2/3 two blocks ago; every
        // consumer thread waited for those before arriving at the previous
        // block's kConsumerSmemReady barrier, which this thread has passed.
        copy(smem_copy_a, tArA, tAsAt(_, _, _, 0, a_buf));
        if constexpr (Config::kSplitA) copy(smem_copy_a, tArAlo, tAsAt(_, _, _, 1, a_buf));
        cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // sA is read by wgmma next
        consumer_smem_ready_sync<Config>();  // sA[a_buf] complete

        // GEMM2: dK_blk = A^T Q (every A term), then GEMM3: dQ += A K. wgmma
        // groups of a warpgroup complete in order, so the dK block is staged
        // as soon as GEMM2's groups are done, while GEMM3 (and, with
        // kGemm1Ahead, the next GEMM1) still run.
        warpgroup_gemm<true>(mma_dk, tDKrA(_, _, _, 0, a_buf), tDKrQt(_, _, _, qs), tDKrDK);
        if constexpr (Config::kSplitA) warpgroup_gemm<false>(mma_dk, tDKrA(_, _, _, 1, a_buf), tDKrQt(_, _, _, qs), tDKrDK);
        warpgroup_gemm<false>(mma_dq, tDQrAt(_, _, _, 0, a_buf), tDQrKt(_, _, _, ks), tDQrDQ);
        if constexpr (Config::kSplitA) warpgroup_gemm<false>(mma_dq, tDQrAt(_, _, _, 1, a_buf), tDQrKt(_, _, _, ks), tDQrDQ);
        auto k_next = k_state;  // with kGemm1Ahead: block blk+1's K stage
        if constexpr (Config::kGemm1Ahead) {
          k_next.advance();
          if (blk + 1 < num_blocks) {
            k_pipe.consumer_wait(k_next);  // K block blk+1, its gs and key_row
            warpgroup_gemm<true>(mma_s, tSrQ(_, _, _, qs), tSrK(_, _, _, k_next.index), tSrS);  // GEMM1: S = Q K^T
          } else {
            cute::warpgroup_commit_batch();  // the empty group in GEMM1's place
          }
          warpgroup_wait<Config::kATerms + 1>();  // GEMM2 complete; GEMM3 and the next GEMM1 may run
          warpgroup_fence_operand(tDKrDK);
        } else {
          warpgroup_wait<Config::kATerms>();  // GEMM2 complete; GEMM3's kATerms groups may be in flight
        }
        // dK staging: warp w's accumulator holds key rows 16w..16w+15 whole
        // (value i is row r0 + 8*((i/2)%2), column c0 + (i%2) + 8*(i/4)); it
        // writes them to its rows of dk_stage[buf], and the scatter role
        // (perf-log v16) reads them back row-contiguous: one float4 red per lane
        // covers kLanesPerRow*16 B of one key row (a whole 512-B row at D=128)
        // instead of 32 B of each of 16 rows (perf-log v10: the L2 adds whole
        // rows at ~3.5 TB/s and the fragment pattern at ~2.2 TB/s). The key rows
        // go with the block, so k stage ks is released below as before. RAW and
        // WAR on buffer buf: dk_full / dk_empty (contract blocks in
        // shared_storage.cuh): every consumer thread arrives after its stores,
        // every scatter thread after its loads.
        {
          const int warp = tid / 32, buf = dk_state.index;
          dk_pipe.producer_acquire(dk_state);  // the scatter role has read buffer buf
          CUTE_UNROLL
          for (int j = 0; j < kD / 8; ++j) {
            *reinterpret_cast<float2*>(&ss.dk_stage[buf][r0][c0 + 8 * j]) = make_float2(tDKrDK(4 * j), tDKrDK(4 * j + 1));
            *reinterpret_cast<float2*>(&ss.dk_stage[buf][r0 + 8][c0 + 8 * j]) = make_float2(tDKrDK(4 * j + 2), tDKrDK(4 * j + 3));
          }
          if (lane < 16) ss.dk_key_row[buf][16 * warp + lane] = ss.key_row[ks][16 * warp + lane];
          if (tid == 0) ss.dk_end[buf] = 0;
          dk_pipe.producer_commit(dk_state);  // every consumer thread, after its stores
          dk_state.advance();
        }
        // GEMM3 complete (with kGemm1Ahead the next GEMM1 may still run: it reads k[ks+1])
        warpgroup_wait<Config::kGemm1Ahead ? 1 : 0>();
        k_pipe.consumer_release(k_state);  // GEMM1/GEMM3 reads of k[ks], reads of gs[ks]/key_row[ks] are done
        if constexpr (Config::kGemm1Ahead) k_state = k_next;
        else k_state.advance();
        a_buf ^= 1;
      }
      if constexpr (Config::kGemm1Ahead) warpgroup_wait<0>();  // the last (empty) group: dQ is read next
      q_pipe.consumer_release(q_state);  // GEMM1/GEMM2 reads of q[qs] were waited for
      q_state.advance();

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
            __nv_bfloat162 v2 = __floats2bfloat162_rn(tDQrDQ(i), tDQrDQ(i + 1));
            *reinterpret_cast<__nv_bfloat162*>(static_cast<Element*>(p.d_index_q) + o) = v2;
          }
        }
      }
    }
    // The end marker: the scatter role exits.
    dk_pipe.producer_acquire(dk_state);
    if (tid == 0) ss.dk_end[dk_state.index] = 1;
    dk_pipe.producer_commit(dk_state);
  }
};

}  // namespace dsaib::hopper
