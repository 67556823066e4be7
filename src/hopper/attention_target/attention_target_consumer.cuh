// The attention target's consumers (warpgroups 1 and 2): consumer c takes blocks
// c, c + 2, ... of each row from its own ring. Per slice one wgmma group, with the
// previous slice's group waited for and its stage freed (one group in flight);
// per key U = sum_h exp2(S^T * scale2 - lse2), at its slot. With normalize both
// consumers meet and divide the row by its sum, in a fixed order. kSelectedLse:
// a first sweep over the row's blocks, with heads as the wgmma M, keeps each
// head's running max and sum of exp2 over the thread's keys, merged in a fixed
// order into lse2 (merge_row_lse).
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

/// 2^x by the MUFU alone (ex2.approx.ftz): results under 2^-126 are flushed to zero.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <class Config>
struct AttentionTargetConsumer {
  using Storage = AttentionTargetStorage<Config>;
  static constexpr int kN = Config::kHeadsPadded;
  static constexpr int kBlock = Config::kBlockKeys;
  static constexpr int kWarps = Config::kThreadsPerWarpgroup / 32;
  static constexpr int kFinalBatch = 8;  // slots per thread per batch of the final pass
  static constexpr int kHeadTiles = kN / 64;  // sweep 0's m64 tiles of heads

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
    // kSelectedLse's sweep 0: S = Q . K^T (heads x keys), kHeadTiles m64 tiles
    typename Config::TiledMmaHeads mma_h;
    auto thr_h = mma_h.get_thread_slice(tid);
    Tensor hA = thr_h.partition_fragment_A(sQ);  // (MMA, M, K, slice) descriptors
    Tensor hB = thr_h.partition_fragment_B(sK);  // (MMA, N, K, stage)
    // acc's registers: the wgmma keeps its accumulator live across the loops (its
    // scale-out is a runtime operand), so a second one would hold 64 more registers.
    Tensor acc_h = make_tensor(acc.data(), partition_fragment_C(mma_h, Shape<Int<kN>, Int<kBlock>>{}).layout());
    static_assert(decltype(size(acc_h))::value == kHeadTiles * 32 && kHeadTiles * 32 == kN / 2,
                  "per m64 tile of heads 32 values per thread: acc's size");

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

      // One block's product over every slice: per slice, wait for its stage, on
      // slice 0 on_first(stage) (the block's key slots), gemm_slice(stage, slice)
      // (one wgmma group into accum), the previous slice's stage freed after its
      // group (one group in flight).
      auto mma_block = [&](auto& accum, auto&& on_first, auto&& gemm_slice) {
        int prev = 0;  // the previous slice's stage
        for (int s = 0; s < ns; ++s) {
          const int ks = ring_base + static_cast<int>(st.index);
          target_wait(&ss.k_full[ks], st.phase, 1u);
          cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // kv copies before wgmma reads
          if (s == 0) on_first(ks);
          warpgroup_fence_operand(accum);
          warpgroup_arrive();
          gemm_slice(ks, s);
          warpgroup_commit_batch();
          warpgroup_fence_operand(accum);
          warpgroup_wait<1>();  // the previous slice's group has read its stage
          if (s > 0) (void)cuda::ptx::mbarrier_arrive(&ss.k_empty[prev]);
          prev = ks;
          st.advance();
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(accum);
        (void)cuda::ptx::mbarrier_arrive(&ss.k_empty[prev]);
      };

      if constexpr (Config::kSelectedLse) {
        // Sweep 0 (num_blocks is the same for both consumers: both skip it, or
        // both meet in merge_row_lse) with the transposed product S = Q . K^T:
        // heads the wgmma M, the block's keys its N, so a thread holds 2 heads
        // per m64 tile (head warp * 16 + lane / 4 + 8 e + 64 mt) and 16 keys
        // (key 2 (lane % 4) + b + 8 j: value 4 j + 2 e + b of tile mt), and keeps
        // per head the max m and the sum l of exp2(x - m) over its keys,
        // x = S * scale2 (base 2). Tail keys (slot -1) are no keys. A NaN logit
        // is dropped by fmaxf but makes l NaN, so it reaches the row.
        if (num_blocks > 0) {
          float m[kHeadTiles][2], l[kHeadTiles][2];
#pragma unroll
          for (int mt = 0; mt < kHeadTiles; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;
          const int kc0 = 2 * (lane % 4);
          for (int blk = consumer; blk < num_blocks; blk += Config::kConsumers) {
            uint32_t valid = 0;  // bit 2 j + b: key kc0 + b + 8 j
            mma_block(
                acc_h,
                [&](int ks) {
#pragma unroll
                  for (int j = 0; j < 8; ++j) {
                    valid |= static_cast<uint32_t>(ss.key_slot[ks][kc0 + 8 * j] >= 0) << (2 * j);
                    valid |= static_cast<uint32_t>(ss.key_slot[ks][kc0 + 8 * j + 1] >= 0) << (2 * j + 1);
                  }
                },
                [&](int ks, int s) {
                  mma_h.accumulate_ = s == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
#pragma unroll
                  for (int kb = 0; kb < 4; ++kb) {
                    gemm(mma_h, hA(_, _, kb, qs * Config::kMaxSlices + s), hB(_, _, kb, ks), acc_h);
                    mma_h.accumulate_ = GMMA::ScaleOut::One;
                  }
                });
            if constexpr (kHeadTiles == 1) {
              // One tile of heads (64): per row e the max of the raw products over
              // the thread's keys (i = 2 j + b: value 4 j + 2 e + b), scaled once
              // (scale2 > 0 keeps the order), then the sum of exp2(x - max), whose
              // terms under 2^-126 are flushed (below l's precision beside the
              // largest, 1); tail keys tested only where the thread's 16 keys are not
              // all valid. At 128 heads this form's registers serialise the wgmma.
              auto add_block = [&](auto all_valid) {
                auto is_key = [&](int i) { return decltype(all_valid)::value || ((valid >> i) & 1u) != 0u; };
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  float bm = -INFINITY;
#pragma unroll
                  for (int i = 0; i < 16; ++i) {
                    if (is_key(i)) bm = fmaxf(bm, acc_h(4 * (i / 2) + 2 * e + i % 2));
                  }
                  const float mn = fmaxf(m[0][e], bm * scale2);
                  const float shift = mn == -INFINITY ? 0.0f : mn;  // no key yet: l stays 0
                  float sum = 0.0f;
#pragma unroll
                  for (int i = 0; i < 16; ++i) {
                    if (is_key(i)) sum += exp2_ftz(fmaf(acc_h(4 * (i / 2) + 2 * e + i % 2), scale2, -shift));
                  }
                  l[0][e] = fmaf(l[0][e], exp2_ftz(m[0][e] - shift), sum);
                  m[0][e] = mn;
                }
              };
              if (valid == 0xffffu) add_block(cute::true_type{});
              else add_block(cute::false_type{});
            } else {
              // Two tiles of heads: the same per tile, with exp2f and each key
              // tested in both loops (no copy of the products held).
#pragma unroll
              for (int mt = 0; mt < kHeadTiles; ++mt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  // i = 2 j + b: value 4 j + 2 e + b of tile mt (read twice: no copy held)
                  float bm = -INFINITY;
#pragma unroll
                  for (int i = 0; i < 16; ++i) {
                    if ((valid >> i) & 1u) bm = fmaxf(bm, acc_h(4 * (i / 2) + 2 * e + i % 2 + 32 * mt) * scale2);
                  }
                  const float mn = fmaxf(m[mt][e], bm);
                  const float shift = mn == -INFINITY ? 0.0f : mn;  // no key yet: l stays 0
                  float sum = 0.0f;
#pragma unroll
                  for (int i = 0; i < 16; ++i) {
                    const float x = acc_h(4 * (i / 2) + 2 * e + i % 2 + 32 * mt) * scale2;
                    if ((valid >> i) & 1u) sum += exp2f(x - shift);
                  }
                  l[mt][e] = fmaf(l[mt][e], exp2f(m[mt][e] - shift), sum);
                  m[mt][e] = mn;
                }
              }
            }
          }
          merge_row_lse(m, l, consumer, lane, warp, qs);
        }
      }

      // lse2 of head c0 + 8 * (k / 2) + k % 2: in registers for the row, or with
      // kSelectedLse read from shared memory per block (the registers it would
      // hold serialise the wgmma at 128 x 576 beside sweep 0's state)
      float lse2[Config::kSelectedLse ? 1 : kN / 4];
      if constexpr (!Config::kSelectedLse) {
#pragma unroll
        for (int k = 0; k < kN / 4; ++k) lse2[k] = ss.lse2[qs][c0 + 8 * (k / 2) + k % 2];
      }
      auto lse2_of = [&](int k) {
        if constexpr (Config::kSelectedLse) return ss.lse2[qs][c0 + 8 * (k / 2) + k % 2];
        else return lse2[k];
      };

      float row_sum = 0.0f;
      for (int blk = consumer; blk < num_blocks; blk += Config::kConsumers) {
        int32_t slot0 = -1, slot1 = -1;
        mma_block(
            acc,
            [&](int ks) {
              slot0 = ss.key_slot[ks][r0];
              slot1 = ss.key_slot[ks][r0 + 8];
            },
            [&](int ks, int s) {
              mma.accumulate_ = s == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
#pragma unroll
              for (int kb = 0; kb < 4; ++kb) {
                gemm(mma, tA(_, _, kb, ks), tB(_, _, kb, qs * Config::kMaxSlices + s), acc);
                mma.accumulate_ = GMMA::ScaleOut::One;
              }
            });

        // U of the thread's two keys: its columns (two partial sums each, fixed
        // order), then the quad (lanes with the same lane / 4 hold the same keys).
        float u[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
        for (int v = 0; v < kN / 2; ++v) {
          const float x = fmaf(acc(v), scale2, -lse2_of((v / 4) * 2 + v % 2));
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

  /// (m, l) <- the (max, sum of exp2(x - max)) of both sets of x; -inf maxima
  /// (no x) are shifted by 0, so an empty set adds 0.
  __device__ static void merge_lse(float& m, float& l, float mo, float lo) {
    const float mn = fmaxf(m, mo);
    const float shift = mn == -INFINITY ? 0.0f : mn;
    l = fmaf(l, exp2f(m - shift), lo * exp2f(mo - shift));
    m = mn;
  }

  /// kSelectedLse, after sweep 0: each thread's (m, l) of its heads merged over
  /// the quad (lanes with the same lane / 4 hold the same heads: a butterfly),
  /// then consumer 1's into consumer 0's through lse_part, into lse2[qs] =
  /// m + log2(l) (+inf for padded heads). A fixed order; two
  /// kTargetConsumerSync barriers, the second publishing lse2.
  __device__ void merge_row_lse(float (&m)[kHeadTiles][2], float (&l)[kHeadTiles][2], int consumer, int lane,
                                int warp, int qs) {
#pragma unroll
    for (int mt = 0; mt < kHeadTiles; ++mt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
          const float mo = __shfl_xor_sync(0xffffffffu, m[mt][e], off);
          const float lo = __shfl_xor_sync(0xffffffffu, l[mt][e], off);
          merge_lse(m[mt][e], l[mt][e], mo, lo);
        }
      }
    }
    const int h0 = warp * 16 + lane / 4;  // head h0 + 8 e + 64 mt
    if (consumer == 1 && lane % 4 == 0) {
#pragma unroll
      for (int mt = 0; mt < kHeadTiles; ++mt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) ss.lse_part[h0 + 8 * e + 64 * mt] = make_float2(m[mt][e], l[mt][e]);
      }
    }
    target_consumer_sync<Config>();  // consumer 1's (m, l) written
    if (consumer == 0 && lane % 4 == 0) {
#pragma unroll
      for (int mt = 0; mt < kHeadTiles; ++mt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int h = h0 + 8 * e + 64 * mt;
          const float2 part = ss.lse_part[h];
          merge_lse(m[mt][e], l[mt][e], part.x, part.y);
          ss.lse2[qs][h] = h < tp.in.heads ? m[mt][e] + log2f(l[mt][e]) : INFINITY;
        }
      }
    }
    target_consumer_sync<Config>();  // lse2[qs] complete; lse_part read before the next row's writes
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
