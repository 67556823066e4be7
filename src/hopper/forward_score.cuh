// The loss forward's score role (warpgroup 1) and the kernel (forward_kernel.cuh).
//
// Per row: load Q (all heads) into registers once; per gathered block of 64
// keys, GEMM1 S = Q K^T (wgmma RS, as the backward's score role), then
// z_key = sum_h w_h sm_scale relu(S_hk): each thread sums its accumulator rows,
// a butterfly over the 8 lanes of a column group leaves 2 columns per lane, and
// the 4 warps' partials meet in shared memory, summed in warp order; z goes to
// the CTA's scratch row at the key's slot. After the row's blocks, two passes
// over its slots (in slot order, so the results do not depend on the gather
// order): (1) max m and sum s of exp(z - m) -> LSE = m + log s, rounded to f32;
// (2) P = exp((z - m) - log s) (no LSE rounding in it), the loss term
// sum T~ log(max(P, eps)), and the statistics of the P-free backward: with
// Pb = exp(z - LSE) as that backward rebuilds it from the f32 LSE, the target
// mass sum T~ [Pb >= eps] divided by c = sum Pb (fp64 sums). Every reduction
// has a fixed order: the outputs are bitwise reproducible.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cute/tensor.hpp>
#include <cuda/ptx>

#include "hopper/forward_kernel.cuh"
#include "hopper/head_sum.cuh"
#include "hopper/problem_device.cuh"
#include "hopper/producer_gather.cuh"
#include "hopper/warpgroup_gemm.cuh"

namespace dsaib::hopper {

template <class Config>
__device__ inline void forward_score_sync() {
  cutlass::arch::NamedBarrier::sync(Config::kScoreThreads, static_cast<uint32_t>(NamedBarrierId::kForwardScoreSync));
}

/// (max, sum of exp relative to max) of two parts. A part without terms is
/// (-inf, 0); a NaN sum stays NaN.
__device__ __forceinline__ void combine_max_sum(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) {
    s = s + s2;
  } else {
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
  }
  m = mm;
}

template <class Config>
struct ForwardScore {
  using Element = typename Config::Element;
  static constexpr int kBlock = Config::kBlockKeys;
  static constexpr int kThreads = Config::kScoreThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kMmaM = Config::kHeadTile / 64;  // m64 tiles per block
  // Slots per thread per batch of the row passes: 2048 slots in one batch.
  static constexpr int kEpilogueBatch = 16;

  const IndexerKLForwardParams& fp;
  ForwardSharedStorage<Config>& ss;
  MbarrierPipeline<Config::kStagesK> k_pipe;
  MbarrierPipeline<Config::kStagesQ> q_pipe;

  __device__ void run() {
    using namespace cute;
    const IndexerBackwardParams& p = fp.in;
    const int tid = threadIdx.x - Config::kScoreWarpgroup * Config::kThreadsPerWarpgroup;  // 0..127
    const int lane = tid % 32;
    const int warp = tid / 32;
    const float eps = eps_exp_minus_100();

    Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});  // (heads, D, stage)
    Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Config::SmemLayoutK{});  // (64 keys, D, stage)
    typename Config::TiledMmaS mma_s;
    auto thr_s = mma_s.get_thread_slice(tid);
    Tensor tSrQ = thr_s.partition_fragment_A(sQ(_, _, 0));  // (MMA, MMA_M, MMA_K) bf16 registers
    auto smem_copy_q = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_s);
    auto thr_copy_q = smem_copy_q.get_thread_slice(tid);
    Tensor tQsQ = thr_copy_q.partition_S(sQ);
    Tensor tQrQ = thr_copy_q.retile_D(tSrQ);
    Tensor tSrK = thr_s.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<Config::kHeadTile>, Int<kBlock>>{});  // (MMA, MMA_M, MMA_N)
    // wgmma m64nNk16 accumulator (PTX ISA, "Register fragment D"): value v of
    // m64 tile m sits at head m * 64 + r0 + 8 * ((v / 2) % 2), key c0 + (v % 2) + 8 * (v / 4).
    static_assert(decltype(size<0>(tSrS))::value == kBlock / 2, "one n64 tile: 32 values per m64 tile");
    static_assert(decltype(size<1>(tSrS))::value == kMmaM && decltype(size<2>(tSrS))::value == 1, "tile shape");
    const int r0 = warp * 16 + lane / 4;

    float* z_row = fp.z_scratch + static_cast<int64_t>(blockIdx.x) * fp.z_stride;
    auto k_state = make_consumer_start_state<Config::kStagesK>();
    auto q_state = make_consumer_start_state<Config::kStagesQ>();
    uint32_t block_count = 0;

    for (int64_t row = blockIdx.x; row < p.num_tasks; row += gridDim.x) {
      q_pipe.consumer_wait(q_state);
      const int qs = q_state.index;
      const int num_blocks = ss.num_blocks[qs];
      // Every GEMM1 of the previous row was waited for: no wgmma reads these registers.
      copy(smem_copy_q, tQsQ(_, _, _, qs), tQrQ);
      float w[kMmaM][2];
      CUTE_UNROLL
      for (int m = 0; m < kMmaM; ++m) {
        w[m][0] = ss.w_scaled[qs][m * 64 + r0];
        w[m][1] = ss.w_scaled[qs][m * 64 + r0 + 8];
      }
      q_pipe.consumer_release(q_state);  // the ldmatrix loads and the reads above are done
      q_state.advance();

      for (int blk = 0; blk < num_blocks; ++blk, ++block_count) {
        const int ks = k_state.index;
        k_pipe.consumer_wait(k_state);
        warpgroup_gemm_rs<true>(mma_s, tSrQ, tSrK(_, _, _, ks), tSrS);  // GEMM1: S = Q K^T
        warpgroup_wait<0>();
        const int slot = tid < kBlock ? ss.key_slot[ks][tid] : -1;
        k_pipe.consumer_release(k_state);  // GEMM1's reads of k[ks] and this thread's of key_slot[ks] are done
        k_state.advance();

        // This thread's head sums of its 16 key columns: column j = (v / 4) * 2 + v % 2.
        float col[16];
        CUTE_UNROLL
        for (int j = 0; j < 16; ++j) col[j] = 0.0f;
        CUTE_UNROLL
        for (int m = 0; m < kMmaM; ++m) {
          CUTE_UNROLL
          for (int v = 0; v < kBlock / 2; ++v) {
            // relu with NaN as not positive (the reference's x > 0 ? x : 0)
            col[(v / 4) * 2 + v % 2] += w[m][(v >> 1) & 1] * fmaxf(tSrS(v, m, 0), 0.0f);
          }
        }
        const int buf = block_count & 1;
        *reinterpret_cast<float2*>(&ss.z_part[buf][warp][2 * lane]) = warp_head_sums(col, lane);
        // z_part[buf] complete. Its next writer (two blocks on) passes the next
        // block's barrier, after this block's reads below.
        forward_score_sync<Config>();
        if (slot >= 0) {
          float z = 0.0f;
          CUTE_UNROLL
          for (int wi = 0; wi < kWarps; ++wi) z += ss.z_part[buf][wi][tid];
          z_row[slot] = z;
        }
      }
      forward_score_sync<Config>();  // the row's logits are in z_row (bar.sync orders the global stores)
      epilogue(row, z_row, eps);
    }
  }

  /// Slots base + j * kThreads (j < kEpilogueBatch) of a row: valid[j] (in the row
  /// and its id in range) and, at valid slots, the logit from z_row. All id loads
  /// are issued before the first is used, then all z loads.
  __device__ void load_valid_z(int base, const RowSequence& seq, const int32_t* ids, const float* z_row,
                               bool (&valid)[kEpilogueBatch], float (&zb)[kEpilogueBatch]) const {
    const IndexerBackwardParams& p = fp.in;
    int32_t id[kEpilogueBatch];
    CUTE_UNROLL
    for (int j = 0; j < kEpilogueBatch; ++j) {
      const int i = base + j * kThreads;
      id[j] = i < p.topk ? ids[i] : -1;
    }
    CUTE_UNROLL
    for (int j = 0; j < kEpilogueBatch; ++j) {
      valid[j] = key_row_of(p, seq, id[j]) >= 0;
      zb[j] = valid[j] ? z_row[base + j * kThreads] : 0.0f;
    }
  }

  /// LSE, P, the target mass and the loss term of one row from its logits in z_row.
  __device__ void epilogue(int64_t row, const float* z_row, float eps) {
    const IndexerBackwardParams& p = fp.in;
    const int tid = threadIdx.x - Config::kScoreWarpgroup * Config::kThreadsPerWarpgroup;
    const int lane = tid % 32, warp = tid / 32;
    const RowSequence seq = row_sequence(p, row);
    const int32_t* ids = p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride);
    const float* attn = p.attn_score + batched_offset(row, p.q_rows_per_batch, p.attn_score_batch_stride, p.attn_score_row_stride);

    // Pass 1: this thread's slots in slot order (online max and sum), then a
    // fixed tree over the warp and the warps in order. The slots go in batches of
    // kEpilogueBatch per thread whose loads are all issued before any is used, so
    // a batch costs two memory latencies (ids, then the valid slots' z: z_row
    // holds nothing at invalid slots), not two per slot.
    float m = -INFINITY, s = 0.0f;
    for (int base = tid; base < p.topk; base += kThreads * kEpilogueBatch) {
      bool valid[kEpilogueBatch];
      float zb[kEpilogueBatch];
      load_valid_z(base, seq, ids, z_row, valid, zb);
      CUTE_UNROLL
      for (int j = 0; j < kEpilogueBatch; ++j) {
        if (!valid[j]) continue;
        const float z = zb[j];
        if (z > m) {
          s *= expf(m - z);
          m = z;
        }
        s += expf(z - m);  // a NaN logit makes the sum NaN
      }
    }
    CUTE_UNROLL
    for (int off = 16; off > 0; off >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
      combine_max_sum(m, s, m2, s2);
    }
    if (lane == 0) {
      ss.max_sum_part[warp][0] = m;
      ss.max_sum_part[warp][1] = s;
    }
    forward_score_sync<Config>();
    m = ss.max_sum_part[0][0];
    s = ss.max_sum_part[0][1];
    CUTE_UNROLL
    for (int wi = 1; wi < kWarps; ++wi) combine_max_sum(m, s, ss.max_sum_part[wi][0], ss.max_sum_part[wi][1]);
    const float log_s = logf(s);
    const float lse = m + log_s;  // no valid slot: -inf + log(0) = -inf

    // Pass 2. P and the loss take log P = (z - m) - log s: exact z - m near the
    // top, and none of the f32 LSE's rounding (up to |LSE| 2^-24, the same for
    // every slot of the row). log(max(P, eps)) is log P where log P >= -100,
    // else log(eps) = -100.
    //
    // The P-free backward (score_mma.cuh, recompute_gs) rebuilds Pb_i =
    // exp(z_i - LSE) from the f32 LSE written here, so Pb_i = c P_i with
    // c = sum_i Pb_i != 1 by that rounding, and its score gradient
    // [Pb_i >= eps] g~_i - Pb_i G picks up (c - 1) P_i G at every slot, which
    // the common part of the logits carries into d_weights and d_index_q. This
    // pass forms Pb_i exactly as that backward does and writes G / c (the mass
    // below divided by c) so that Pb_i G / c = P_i G to rounding; its mask
    // [Pb_i >= eps] is the backward's. That needs the backward's z_i to be
    // these z_i bit for bit: both come from the same GEMM1 (warpgroup_gemm_rs,
    // the same operand layouts) and the same head sum (head_sum.cuh) at
    // H <= 64, the only case that backward takes (above 64 heads it is fed P).
    float* p_out = fp.index_score ? fp.index_score + row * p.topk : nullptr;
    double term = 0.0, mass = 0.0, rebuilt_sum = 0.0;
    for (int base = tid; base < p.topk; base += kThreads * kEpilogueBatch) {
      bool valid[kEpilogueBatch];
      float zb[kEpilogueBatch], tb[kEpilogueBatch], prob[kEpilogueBatch];
      CUTE_UNROLL
      for (int j = 0; j < kEpilogueBatch; ++j) {
        const int i = base + j * kThreads;
        tb[j] = i < p.topk ? attn[i] : 0.0f;  // issued with the ids' loads below; used at valid slots
      }
      load_valid_z(base, seq, ids, z_row, valid, zb);
      CUTE_UNROLL
      for (int j = 0; j < kEpilogueBatch; ++j) {
        prob[j] = 0.0f;
        if (valid[j]) {
          const float log_p = (zb[j] - m) - log_s;
          prob[j] = expf(log_p);
          const float rebuilt = expf(zb[j] - lse);  // as recompute_gs forms it
          rebuilt_sum += rebuilt;
          const float t = max_keeping_nan(tb[j], eps);
          if (rebuilt >= eps) mass += t;
          term += static_cast<double>(t) * static_cast<double>(log_p < -100.0f ? -100.0f : log_p);
        }
      }
      if (p_out) {
        CUTE_UNROLL
        for (int j = 0; j < kEpilogueBatch; ++j) {
          const int i = base + j * kThreads;
          if (i < p.topk) p_out[i] = prob[j];
        }
      }
    }
    CUTE_UNROLL
    for (int off = 16; off > 0; off >>= 1) {
      term += __shfl_xor_sync(0xffffffffu, term, off);
      mass += __shfl_xor_sync(0xffffffffu, mass, off);
      rebuilt_sum += __shfl_xor_sync(0xffffffffu, rebuilt_sum, off);
    }
    if (lane == 0) {
      ss.row_part[warp][0] = term;
      ss.row_part[warp][1] = mass;
      ss.row_part[warp][2] = rebuilt_sum;
    }
    // row_part complete; it is rewritten only after the next row's pass-1 barrier.
    forward_score_sync<Config>();
    if (tid == 0) {
      double t = 0.0, ms = 0.0, c = 0.0;
      CUTE_UNROLL
      for (int wi = 0; wi < kWarps; ++wi) {
        t += ss.row_part[wi][0];
        ms += ss.row_part[wi][1];
        c += ss.row_part[wi][2];
      }
      fp.row_lse[row] = lse;
      // c >= 1/topk where a slot is valid (Pb = exp(-log s) at the maximum); a
      // row without a valid slot keeps mass 0, a NaN c leaves the mass as is
      // (the row's LSE is NaN then).
      fp.row_target_mass[row] = static_cast<float>(c > 0.0 ? ms / c : ms);
      fp.loss_terms[row] = t;
    }
  }
};

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1)
    indexer_kl_forward_kernel(const __grid_constant__ IndexerKLForwardParams p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* base = smem_raw + ((1024u - (smem_addr & 1023u)) & 1023u);
  using Storage = ForwardSharedStorage<Config>;
  Storage& ss = *reinterpret_cast<Storage*>(base);
  const MbarrierPipeline<Config::kStagesK> k_pipe{ss.k_full, ss.k_empty, 1u};
  const MbarrierPipeline<Config::kStagesQ> q_pipe{ss.q_full, ss.q_empty, 2u};
  if (threadIdx.x == 0) {
    k_pipe.init({Config::kProducerThreads, Config::kScoreThreads});
    q_pipe.init({Config::kProducerThreads, Config::kScoreThreads});
  }
  init_barriers_fence_and_sync();
  if (threadIdx.x / Config::kThreadsPerWarpgroup == Config::kProducerWarpgroup) {
    ProducerGather<Config, Storage, false>{p.in, ss, k_pipe, q_pipe}.run();
  } else {
    ForwardScore<Config>{p, ss, k_pipe, q_pipe}.run();
  }
}

}  // namespace dsaib::hopper
