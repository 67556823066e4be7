// The end of a row of the loss forward, shared by every kernel that forms a
// row's softmax statistics (the loss forward's score role, the
// loss-and-gradient kernel's dK role, the loss forward from given logits): the
// threads' running statistics combined in a fixed tree, then the row's LSE,
// target mass and loss term, with a pass over its slots where a slot is
// clipped, |LSE| is large or P is written (docs/kl-forward.md).
#pragma once

#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "hopper/common/kernel_params.hpp"
#include "hopper/common/named_barriers.cuh"
#include "hopper/common/problem_device.cuh"
#include "hopper/common/row_running_stats.cuh"

namespace dsaib::hopper {

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

/// Storage: shared memory with row_stats[2][kThreads / 32] and
/// row_part[kThreads / 32][3], private to the kThreads threads of warpgroup
/// kWarpgroup, which run every step here together (NamedBarrierId::kForwardScoreSync).
/// kBatch: slots per thread per batch of a slot pass.
template <class Storage, int kThreads, int kWarpgroup, int kBatch>
struct RowSoftmaxFinish {
  static constexpr int kThreadsPerWarpgroup = 128;
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

  __device__ static void sync() {
    cutlass::arch::NamedBarrier::sync(kThreads, static_cast<uint32_t>(NamedBarrierId::kForwardScoreSync));
  }

  /// Adds a valid slot's logit z and its T~ to a thread's running statistics.
  __device__ __forceinline__ static void add_logit(float z, float target, RowRunningStats& st) {
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

  /// Combines two parts of a row's statistics.
  __device__ static void combine(RowRunningStats& a, const RowRunningStats& b) {
    combine_max_sum(a.m, a.s, b.m, b.s);
    a.z_min = fminf(a.z_min, b.z_min);
    a.target_logit += b.target_logit;
    a.target += b.target;
    a.count += b.count;
  }

  /// The row's LSE, target mass and loss term from the threads' statistics.
  /// z_row[i]: the logit of slot i (read only by a slot pass).
  template <class ZRow>
  __device__ void finish_row(int64_t row, RowRunningStats st, uint32_t n, ZRow z_row, float eps) {
    const int tid = threadIdx.x - kWarpgroup * kThreadsPerWarpgroup;
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
    sync();
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
  template <class ZRow>
  __device__ void load_valid_z(int base, const RowSequence& seq, const int32_t* ids, ZRow z_row,
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
  template <bool kStatistics, class ZRow>
  __device__ void slot_pass(int64_t row, ZRow z_row, float m, float log_s, float lse, float eps) {
    const IndexerParams& p = fp.in;
    const int tid = threadIdx.x - kWarpgroup * kThreadsPerWarpgroup;
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
      sync();  // every thread's z_row reads done before the next row's logits overwrite it
    } else {
      finish_slot_pass(row, lse, term, mass, rebuilt_sum);
    }
  }

  /// The slot pass's per-thread sums to the row's outputs (fixed tree).
  __device__ void finish_slot_pass(int64_t row, float lse, double term, double mass, double rebuilt_sum) {
    const int tid = threadIdx.x - kWarpgroup * kThreadsPerWarpgroup;
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
    sync();
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
