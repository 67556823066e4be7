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
#include "hopper/kl_forward/forward_shared_storage.cuh"
#include "hopper/common/problem_device.cuh"
#include "hopper/common/producer_gather.cuh"
#include "hopper/common/warpgroup_gemm.cuh"

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
  static constexpr int kEpilogueBatch = kBatch;
  // A row whose every slot has z - LSE >= this takes no slot pass: exp(-99) is far
  // above eps, so no mask is 0 and no term clipped, also for the backward's logits.
  static constexpr double kNoClipBound = -99.0;
  // ... and whose |LSE| is below this: the plain loss term cancels |LSE| 2^-53 per
  // slot, and the f32 LSE stays well inside the clip bound's margin.
  static constexpr double kPlainLseBound = 1048576.0;

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
      // warp-uniform as ptxas sees it, so the wgmma issues below are not on a divergent path
      const int num_blocks = __shfl_sync(0xffffffffu, ss.num_blocks[qs], 0);
      float w[kN / 4];  // head c0 + 8 * (k / 2) + k % 2
      CUTE_UNROLL
      for (int k = 0; k < kN / 4; ++k) w[k] = ss.w_scaled[qs][c0 + 8 * (k / 2) + k % 2];

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

        add_block(acc, [&](int k) { return w[k]; }, quad, slot, target, st, z_row);
      };
      // Two accumulators, so the next GEMM1 runs under this head sum; pairs, with
      // no branch around the wgmma issues (ptxas would serialise them).
      if (num_blocks > 0) {
        k_pipe.consumer_wait(k_state);
        warpgroup_gemm<true>(mma_s, tSsK(_, _, _, k_state.index), tSsQ(_, _, _, qs), acc0);
        int blk = 0;
        for (; blk + 2 < num_blocks; blk += 2) {
          issue_next(acc1);
          warpgroup_wait<1>();
          consume(acc0);
          issue_next(acc0);
          warpgroup_wait<1>();
          consume(acc1);
        }
        if (blk + 1 < num_blocks) {
          issue_next(acc1);
          warpgroup_wait<1>();
          consume(acc0);
          warpgroup_wait<0>();
          consume(acc1);
        } else {
          warpgroup_wait<0>();
          consume(acc0);
        }
      }
      q_pipe.consumer_release(q_state);  // every GEMM1 of the row retired; w_scaled / num_blocks read
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
      st.z_min = fminf(st.z_min, z);
      if (z > st.m) {
        st.s *= expf(st.m - z);
        st.m = z;
      }
      // a NaN logit makes the sum NaN; a -inf one adds 0 (z - m would be NaN)
      if (z != -INFINITY) st.s += expf(z - st.m);
      st.target_logit += static_cast<double>(target) * static_cast<double>(z);
      st.target += static_cast<double>(target);
      ++st.count;
    }
  }

  /// Combines two parts of a row's statistics.
  __device__ static void combine(RowRunningStats& a, const RowRunningStats& b) {
    combine_max_sum(a.m, a.s, b.m, b.s);
    a.z_min = fminf(a.z_min, b.z_min);
    a.target_logit += b.target_logit;
    a.target += b.target;
    a.count += b.count;
  }

  /// The row's LSE, target mass and loss term from the threads' statistics.
  __device__ void finish_row(int64_t row, RowRunningStats st, uint32_t n, const float* z_row, float eps) {
    const int tid = threadIdx.x - kWarpgroup * Config::kThreadsPerWarpgroup;
    const int lane = tid % 32, warp = tid / 32;
    CUTE_UNROLL
    for (int off = 16; off > 0; off >>= 1) {
      RowRunningStats o;
      o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
      o.s = __shfl_xor_sync(0xffffffffu, st.s, off);
      o.z_min = __shfl_xor_sync(0xffffffffu, st.z_min, off);
      o.target_logit = __shfl_xor_sync(0xffffffffu, st.target_logit, off);
      o.target = __shfl_xor_sync(0xffffffffu, st.target, off);
      o.count = __shfl_xor_sync(0xffffffffu, st.count, off);
      combine(st, o);
    }
    if (lane == 0) ss.row_stats[n & 1u][warp] = st;
    // row_stats[n & 1] and the row's z_row stores complete (bar.sync orders global
    // stores too); rewritten two rows on, after the next row's barrier.
    forward_score_sync<Config>();
    st = ss.row_stats[n & 1u][0];
    CUTE_UNROLL
    for (int wi = 1; wi < kWarps; ++wi) combine(st, ss.row_stats[n & 1u][wi]);
    const bool any_slot = st.count > 0;
    // every valid logit -inf: the softmax is undefined, as the reference's exp(NaN)
    if (any_slot && st.s == 0.0f) st.s = NAN;
    const float log_s = logf(st.s);
    const float lse = st.m + log_s;  // no valid slot: -inf + log(0) = -inf
    const double lse_exact = static_cast<double>(st.m) + log(static_cast<double>(st.s));
    const bool plain = !any_slot || (isfinite(st.target) && isfinite(st.target_logit) &&
                                     fabs(lse_exact) < kPlainLseBound &&
                                     static_cast<double>(st.z_min) - lse_exact >= kNoClipBound);
    if (plain) {
      // The same statistics whether or not P is written.
      if (tid == 0) {
        double term = 0.0, mass = 0.0;
        if (any_slot) {
          term = st.target_logit - st.target * lse_exact;
          // c >= 1/topk: the rebuilt P of the row's largest logit is exp(-log s)
          const double c = static_cast<double>(st.s) * exp(static_cast<double>(st.m) - static_cast<double>(lse));
          mass = st.target / c;
        }
        fp.row_lse[row] = lse;
        fp.row_target_mass[row] = static_cast<float>(mass);
        fp.loss_terms[row] = term;
      }
      if (fp.index_score != nullptr) slot_pass<false>(row, z_row, st.m, log_s, lse, eps);
      return;
    }
    slot_pass<true>(row, z_row, st.m, log_s, lse, eps);
  }

  /// Slots base + j * kThreads of a row: valid[j] and, at valid slots, the logit
  /// from z_row; all id loads issued before the first is used, then all z loads.
  __device__ void load_valid_z(int base, const RowSequence& seq, const int32_t* ids, const float* z_row,
                               bool (&valid)[kEpilogueBatch], float (&zb)[kEpilogueBatch]) const {
    const IndexerParams& p = fp.in;
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

  /// P (where wanted) and, with kStatistics, the row's target mass and loss term,
  /// slot by slot from its logits in z_row.
  template <bool kStatistics>
  __device__ void slot_pass(int64_t row, const float* z_row, float m, float log_s, float lse, float eps) {
    const IndexerParams& p = fp.in;
    const int tid = threadIdx.x - kWarpgroup * Config::kThreadsPerWarpgroup;
    const RowSequence seq = row_sequence(p, row);
    const int32_t* ids = p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride);
    const float* attn = p.attn_score + batched_offset(row, p.q_rows_per_batch, p.attn_score_batch_stride, p.attn_score_row_stride);

    // log P = (z - m) - log s carries none of the f32 LSE's rounding. The mass is
    // divided by c = sum_i exp(z_i - LSE), formed as the P-free backward rebuilds
    // P, so that the LSE's rounding cancels in its P_i G (docs/kl-forward.md).
    float* p_out = fp.index_score ? fp.index_score + row * p.topk : nullptr;
    double term = 0.0, mass = 0.0, rebuilt_sum = 0.0;
    for (int base = tid; base < p.topk; base += kThreads * kEpilogueBatch) {
      bool valid[kEpilogueBatch];
      float zb[kEpilogueBatch], tb[kEpilogueBatch], prob[kEpilogueBatch];
      CUTE_UNROLL
      for (int j = 0; j < kEpilogueBatch; ++j) {
        const int i = base + j * kThreads;
        tb[j] = kStatistics && i < p.topk ? attn[i] : 0.0f;  // issued with the ids' loads below; used at valid slots
      }
      load_valid_z(base, seq, ids, z_row, valid, zb);
      CUTE_UNROLL
      for (int j = 0; j < kEpilogueBatch; ++j) {
        prob[j] = 0.0f;
        if (valid[j]) {
          const float log_p = (zb[j] - m) - log_s;
          prob[j] = expf(log_p);
          if constexpr (kStatistics) {
            const float rebuilt = expf(zb[j] - lse);  // as recompute_gs forms it
            rebuilt_sum += rebuilt;
            const float t = max_keeping_nan(tb[j], eps);
            if (rebuilt >= eps) mass += t;
            term += static_cast<double>(t) * static_cast<double>(log_p < -100.0f ? -100.0f : log_p);
          }
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
    if constexpr (!kStatistics) {
      forward_score_sync<Config>();  // every thread's z_row reads done before the next row's logits overwrite it
    } else {
      finish_slot_pass(row, lse, term, mass, rebuilt_sum);
    }
  }

  /// The slot pass's per-thread sums to the row's outputs (fixed tree).
  __device__ void finish_slot_pass(int64_t row, float lse, double term, double mass, double rebuilt_sum) {
    const int tid = threadIdx.x - kWarpgroup * Config::kThreadsPerWarpgroup;
    const int lane = tid % 32, warp = tid / 32;
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
    // row_part complete; it is rewritten only after the next row's statistics barrier.
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
      // c >= 1/topk where a slot is valid; no valid slot: mass 0; NaN c: LSE NaN too.
      fp.row_target_mass[row] = static_cast<float>(c > 0.0 ? ms / c : ms);
      fp.loss_terms[row] = t;
    }
  }
};

}  // namespace dsaib::hopper
