// The attention target's consumers (warpgroups 1 and 2): consumer c takes blocks
// c, c + 2, ... of each row from its own ring. Per slice one wgmma group, with the
// previous slice's group waited for and its stage freed (one group in flight);
// per key U = sum_h exp2(S^T * scale2 - lse2), at its slot. With normalize both
// consumers meet and divide the row by its sum, in a fixed order.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cute/tensor.hpp>
#include <cuda/ptx>

#include "hopper/attention_target/attention_target_producer.cuh"
#include "hopper/attention_target/attention_target_tile_config.cuh"
#include "hopper/common/named_barriers.cuh"
#include "hopper/common/pipeline.cuh"
#include "hopper/common/problem_device.cuh"

namespace dsaib::hopper {

template <class Config>
__device__ inline void target_consumer_sync() {
  cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, static_cast<uint32_t>(NamedBarrierId::kTargetConsumerSync));
}

template <class Config>
struct AttentionTargetConsumer {
  using Storage = AttentionTargetStorage<Config>;
  static constexpr int kN = Config::kHeadsPadded;
  static constexpr int kBlock = Config::kBlockKeys;
  static constexpr int kWarps = Config::kThreadsPerWarpgroup / 32;
  static constexpr int kFinalBatch = 8;  // slots per thread per batch of the final pass

  const AttentionTargetParams& tp;
  Storage& ss;

  __device__ void run(int consumer) {
    using namespace cute;
    const IndexerParams& p = tp.in;
    const int tid = threadIdx.x - (1 + consumer) * Config::kThreadsPerWarpgroup;  // 0..127
    const int ctid = threadIdx.x - Config::kProducerThreads;                       // 0..255
    const int lane = tid % 32, warp = tid / 32;
    const int ns = tp.num_slices;
    const float scale2 = tp.scale2;

    Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});  // (heads, 64, slice)
    Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Config::SmemLayoutK{});  // (64 keys, 64, stage)
    typename Config::TiledMma mma;
    auto thr = mma.get_thread_slice(tid);
    Tensor tA = thr.partition_fragment_A(sK);  // (MMA, M, K, stage) descriptors
    Tensor tB = thr.partition_fragment_B(sQ);  // (MMA, N, K, slice)
    Tensor acc = partition_fragment_C(mma, Shape<Int<kBlock>, Int<kN>>{});
    // wgmma accumulator: value v is key r0 + 8 * ((v / 2) % 2), head c0 + (v % 2) + 8 * (v / 4).
    static_assert(decltype(size(acc))::value == kN / 2, "one m64 tile: N/2 values per thread");
    static_assert(decltype(size<2>(tA))::value == 4 && decltype(size<2>(tB))::value == 4, "4 k16 steps per slice");
    const int r0 = warp * 16 + lane / 4;
    const int c0 = 2 * (lane % 4);

    // this consumer's ring of K stages: [ring_base, ring_base + kStagesPerConsumer)
    auto st = make_consumer_start_state<Config::kStagesPerConsumer>();
    const int ring_base = consumer * Config::kStagesPerConsumer;
    auto q_state = make_consumer_start_state<Config::kStagesQ>();
    uint32_t n = 0;  // rows so far
    for (int64_t row = blockIdx.x; row < p.num_tasks; row += gridDim.x, ++n) {
      const int qs = static_cast<int>(q_state.index);
      target_wait(&ss.q_full[qs], q_state.phase, 2u);
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // Q copies (generic proxy) before wgmma reads
      const int num_blocks = ss.num_blocks[qs];
      float lse2[kN / 4];  // head c0 + 8 * (k / 2) + k % 2
#pragma unroll
      for (int k = 0; k < kN / 4; ++k) lse2[k] = ss.lse2[qs][c0 + 8 * (k / 2) + k % 2];

      float row_sum = 0.0f;
      for (int blk = consumer; blk < num_blocks; blk += Config::kConsumers) {
        int32_t slot0 = -1, slot1 = -1;
        int prev = 0;  // the previous slice's stage
        for (int s = 0; s < ns; ++s) {
          const int ks = ring_base + static_cast<int>(st.index);
          target_wait(&ss.k_full[ks], st.phase, 1u);
          cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // kv copies before wgmma reads
          if (s == 0) {
            slot0 = ss.key_slot[ks][r0];
            slot1 = ss.key_slot[ks][r0 + 8];
          }
          warpgroup_fence_operand(acc);
          warpgroup_arrive();
          mma.accumulate_ = s == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
#pragma unroll
          for (int kb = 0; kb < 4; ++kb) {
            gemm(mma, tA(_, _, kb, ks), tB(_, _, kb, qs * Config::kMaxSlices + s), acc);
            mma.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          warpgroup_fence_operand(acc);
          warpgroup_wait<1>();  // the previous slice's group has read its stage
          if (s > 0) (void)cuda::ptx::mbarrier_arrive(&ss.k_empty[prev]);
          prev = ks;
          st.advance();
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
        (void)cuda::ptx::mbarrier_arrive(&ss.k_empty[prev]);

        // U of the thread's two keys: its columns (two partial sums each, fixed
        // order), then the quad (lanes with the same lane / 4 hold the same keys).
        float u[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
        for (int v = 0; v < kN / 2; ++v) {
          const float x = fmaf(acc(v), scale2, -lse2[(v / 4) * 2 + v % 2]);
          u[(v / 2) % 2][(v / 4) % 2] += exp2f(x);
        }
        float u0 = u[0][0] + u[0][1], u1 = u[1][0] + u[1][1];
        u0 += __shfl_xor_sync(0xffffffffu, u0, 1);
        u1 += __shfl_xor_sync(0xffffffffu, u1, 1);
        u0 += __shfl_xor_sync(0xffffffffu, u0, 2);
        u1 += __shfl_xor_sync(0xffffffffu, u1, 2);
        if (lane % 4 == 0) {
          float* out = tp.u_in_smem ? ss.u_row[n & 1u] : tp.attn_score + row * static_cast<int64_t>(p.topk);
          // tail entries (slot -1) are zero-filled keys: their exp2 terms are not U
          if (slot0 >= 0) {
            out[slot0] = u0;
            row_sum += u0;
          }
          if (slot1 >= 0) {
            out[slot1] = u1;
            row_sum += u1;
          }
        }
      }
      if (tp.u_in_smem) {
        final_pass(row, row_sum, n, consumer, ctid, lane, warp, ss.u_row[n & 1u]);
        (void)cuda::ptx::mbarrier_arrive(&ss.q_empty[qs]);  // and the final pass read u_row[n & 1]
      } else {
        (void)cuda::ptx::mbarrier_arrive(&ss.q_empty[qs]);  // last wgmma on q[qs] waited for; lse2 / num_blocks read
        if (tp.normalize) {
          final_pass(row, row_sum, n, consumer, ctid, lane, warp, tp.attn_score + row * static_cast<int64_t>(p.topk));
        }
      }
      q_state.advance();
    }
  }

  /// T = U / sum U over the row (both consumers), +0 at the slots marked -0; U
  /// read from `u` (the row in attn_score, or u_row in shared memory).
  __device__ void final_pass(int64_t row, float row_sum, uint32_t n, int consumer, int ctid, int lane, int warp,
                             const float* u) {
    const IndexerParams& p = tp.in;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) row_sum += __shfl_xor_sync(0xffffffffu, row_sum, off);
    if (lane == 0) ss.row_part[n & 1u][consumer][warp] = row_sum;
    // row_part[n & 1] and both consumers' U stores complete (bar.sync orders global
    // stores too); rewritten two rows on, after the next row's barrier.
    target_consumer_sync<Config>();
    float total = 0.0f;
#pragma unroll
    for (int c = 0; c < Config::kConsumers; ++c) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += ss.row_part[n & 1u][c][w];
    }
    float* out = tp.attn_score + row * static_cast<int64_t>(p.topk);
    for (int base = ctid; base < p.topk; base += Config::kConsumerThreads * kFinalBatch) {
      float v[kFinalBatch];
#pragma unroll
      for (int j = 0; j < kFinalBatch; ++j) {
        const int i = base + j * Config::kConsumerThreads;
        v[j] = i < p.topk ? u[i] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kFinalBatch; ++j) {
        const int i = base + j * Config::kConsumerThreads;
        const bool invalid = v[j] == 0.0f && signbit(v[j]);
        if (i < p.topk) out[i] = (invalid || total == 0.0f) ? 0.0f : v[j] / total;
      }
    }
  }
};

}  // namespace dsaib::hopper
