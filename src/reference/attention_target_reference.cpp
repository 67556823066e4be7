// fp64 reference of the attention target (docs/attention-target.md), and the
// cpu backend of attention_target() built on it.
//
// Per query row r and valid slot i with key row j:
//   U_i = sum_h exp(sm_scale * (q[r, h] . kv[j]) - lse[r, h])                 (natural)
//   U_i = sum_h exp2(sm_scale * log2(e) * (q[r, h] . kv[j]) - lse[r, h])      (base 2)
//   T_i = U_i / sum_i' U_i' (normalize; a row whose sum is 0 gives 0), 0 at invalid slots.
// Without an lse: lse[r, h] = log sum_{valid i} exp(sm_scale * (q[r, h] . kv[j_i])),
// max-shifted, and U as in the natural case with it.
// Rows are independent and each is computed by one thread in a fixed order, so
// every result is the same for any thread count.
#include <cmath>
#include <cstdint>
#include <vector>

#include "api/attention_target_problem.hpp"
#include "core/allocation.hpp"
#include "core/element_access.hpp"
#include "core/float_mode.hpp"
#include "core/threads.hpp"
#include "reference/attention_target_reference.hpp"

namespace dsaib::detail {
namespace {

/// One thread's row buffers: the query row and one key row in fp64, the row's
/// key rows; without an lse, the row's logits (slot-major) and per-head lse.
struct TargetScratch {
  std::vector<double> q, kv;
  std::vector<int64_t> krow;
  std::vector<double> logit, lse;
  TargetScratch(const ProblemGeometry& g, bool lse_given)
      : q(static_cast<size_t>(g.heads * g.head_dim)),
        kv(static_cast<size_t>(g.head_dim)),
        krow(static_cast<size_t>(g.topk)),
        logit(lse_given ? 0 : static_cast<size_t>(g.topk * g.heads)),
        lse(lse_given ? 0 : static_cast<size_t>(g.heads)) {}
};

/// Writes row r's K targets (fp64) to `t`.
void target_row(const AttentionTargetInputs& in, const AttentionTargetOptions& opt, const ProblemGeometry& g, int64_t r,
                TargetScratch& s, double* t) {
  const int64_t H = g.heads, D = g.head_dim, K = g.topk;
  const bool thd = g.layout == Layout::thd;
  int64_t b, tq;
  g.q_row_coords(r, &b, &tq);

  const TensorView& ids = in.topk_indices;
  const int64_t ids_row = row_offset(ids, g.layout, r, g.s_q);
  bool any_valid = false;
  for (int64_t i = 0; i < K; ++i) {
    const auto id = static_cast<int64_t>(load_element(DType::i32, ids.data, ids_row + i * ids.strides[thd ? 1 : 2]));
    s.krow[i] = g.key_row(b, id);
    any_valid = any_valid || s.krow[i] >= 0;
    t[i] = 0.0;
  }
  if (!any_valid) return;  // no memory of the row is read

  const TensorView& q = in.query;
  const int64_t q_row = row_offset(q, g.layout, r, g.s_q);
  const int64_t q_hs = q.strides[thd ? 1 : 2], q_ds = q.strides[thd ? 2 : 3];
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t d = 0; d < D; ++d) s.q[h * D + d] = load_element(DType::bf16, q.data, q_row + h * q_hs + d * q_ds);
  }
  const TensorView& kv = in.kv;
  const int64_t kv_ds = kv.strides[thd ? 1 : 2];
  // Key row j into s.kv, its dot with each head h of the query row into dot[h].
  auto dots = [&](int64_t j, double* dot) {
    const int64_t kv_row = row_offset(kv, g.layout, j, g.s_kv);
    for (int64_t d = 0; d < D; ++d) s.kv[d] = load_element(DType::bf16, kv.data, kv_row + d * kv_ds);
    for (int64_t h = 0; h < H; ++h) {
      const double* qh = &s.q[h * D];
      double acc = 0.0;
      for (int64_t d = 0; d < D; ++d) acc += qh[d] * s.kv[d];
      dot[h] = acc;
    }
  };

  double sum = 0.0;
  if (!in.lse.present()) {
    // Each head's natural lse over the row's valid slots (duplicates count once
    // per slot), shifted by the head's max logit: exp never overflows, and a
    // NaN or +inf logit makes the head's lse (and the row) NaN.
    const double scale = static_cast<double>(opt.sm_scale);
    for (int64_t h = 0; h < H; ++h) s.lse[h] = -INFINITY;  // the max first
    for (int64_t i = 0; i < K; ++i) {
      if (s.krow[i] < 0) continue;
      double* x = &s.logit[i * H];
      dots(s.krow[i], x);
      for (int64_t h = 0; h < H; ++h) {
        x[h] *= scale;
        if (std::isnan(x[h]) || x[h] > s.lse[h]) s.lse[h] = x[h];  // a NaN stays
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const double m = s.lse[h];
      double e = 0.0;
      for (int64_t i = 0; i < K; ++i) {
        if (s.krow[i] >= 0) e += std::exp(s.logit[i * H + h] - m);
      }
      s.lse[h] = m + std::log(e);
    }
    for (int64_t i = 0; i < K; ++i) {
      if (s.krow[i] < 0) continue;
      double u = 0.0;
      for (int64_t h = 0; h < H; ++h) u += std::exp(s.logit[i * H + h] - s.lse[h]);
      t[i] = u;
      sum += u;
    }
  } else {
    const TensorView& lse = in.lse;
    const int64_t lse_row = row_offset(lse, g.layout, r, g.s_q);
    const int64_t lse_hs = lse.strides[thd ? 1 : 2];
    const bool base2 = opt.lse_base == LseBase::base2;
    const double scale = base2 ? static_cast<double>(opt.sm_scale) * 1.4426950408889634073599246810019 /* log2(e) */
                               : static_cast<double>(opt.sm_scale);
    for (int64_t i = 0; i < K; ++i) {
      const int64_t j = s.krow[i];
      if (j < 0) continue;
      const int64_t kv_row = row_offset(kv, g.layout, j, g.s_kv);
      for (int64_t d = 0; d < D; ++d) s.kv[d] = load_element(DType::bf16, kv.data, kv_row + d * kv_ds);
      double u = 0.0;
      for (int64_t h = 0; h < H; ++h) {
        const double* qh = &s.q[h * D];
        double acc = 0.0;
        for (int64_t d = 0; d < D; ++d) acc += qh[d] * s.kv[d];
        const double l = load_element(lse.dtype, lse.data, lse_row + h * lse_hs);
        u += base2 ? std::exp2(scale * acc - l) : std::exp(scale * acc - l);
      }
      t[i] = u;
      sum += u;
    }
  }
  if (!opt.normalize) return;
  if (sum == 0.0) {
    for (int64_t i = 0; i < K; ++i) t[i] = 0.0;
    return;
  }
  for (int64_t i = 0; i < K; ++i) {
    if (s.krow[i] >= 0) t[i] /= sum;
  }
}

const char* const kOutOfMemory =
    "out of memory: expected room in host memory for the fp64 attention target, got an allocation failure";

}  // namespace

void run_cpu_attention_target(const AttentionTargetInputs& in, const AttentionTargetOutputs& out,
                              const AttentionTargetOptions& opt, const ProblemGeometry& g) {
  const IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ would read subnormals as 0 (float_mode.hpp)
  const int threads = thread_count(opt.num_threads, g.num_q_rows);
  const int64_t K = g.topk;
  // Every buffer is allocated here, before any worker runs or anything is written.
  std::vector<TargetScratch> scratch;
  std::vector<std::vector<double>> rows;
  allocation_failure_as_out_of_memory(kOutOfMemory, [&] {
    scratch.reserve(threads);
    for (int t = 0; t < threads; ++t) scratch.emplace_back(g, in.lse.present());
    rows.assign(static_cast<size_t>(threads), std::vector<double>(static_cast<size_t>(K)));
    return 0;
  });
  // attn_score is contiguous (validated): row r starts at element r * K.
  parallel_for(threads, g.num_q_rows, 16, [&](int64_t r, int tid) {
    double* t = rows[tid].data();
    target_row(in, opt, g, r, scratch[tid], t);
    for (int64_t i = 0; i < K; ++i) store_element(out.attn_score.dtype, out.attn_score.data, r * K + i, t[i]);
  });
}

}  // namespace dsaib::detail

namespace dsaib {

ReferenceAttentionTarget reference_attention_target(const AttentionTargetInputs& inputs,
                                                    const AttentionTargetOptions& options) {
  const detail::IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ would read subnormals as 0 (float_mode.hpp)
  AttentionTargetOptions opt = options;
  opt.backend = Backend::cpu;
  const detail::ProblemGeometry g = detail::validate_attention_target_problem(inputs, nullptr, opt, nullptr, false);
  const int threads = detail::thread_count(opt.num_threads, g.num_q_rows);
  ReferenceAttentionTarget res;
  res.num_q_rows = g.num_q_rows;
  res.topk = g.topk;
  std::vector<detail::TargetScratch> scratch;
  detail::allocation_failure_as_out_of_memory(detail::kOutOfMemory, [&] {
    res.attn_score.assign(static_cast<size_t>(g.num_q_rows * g.topk), 0.0);
    scratch.reserve(threads);
    for (int t = 0; t < threads; ++t) scratch.emplace_back(g, inputs.lse.present());
    return 0;
  });
  detail::parallel_for(threads, g.num_q_rows, 16, [&](int64_t r, int tid) {
    detail::target_row(inputs, opt, g, r, scratch[tid], &res.attn_score[static_cast<size_t>(r * g.topk)]);
  });
  return res;
}

}  // namespace dsaib
