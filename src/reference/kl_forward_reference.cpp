// fp64 reference of the indexer KL loss forward (docs/kl-forward.md), and the cpu backend of indexer_kl_forward() built on it.
//
// Per query row, over its valid slots: the logits z (reference_index_logits, or
// sm_scale times the given topk_logits),
// LSE = zmax + log sum exp(z - zmax), P = exp(z - LSE) and the loss term
// sum T~ log(max(P, eps)). The statistics of the P-free backward use the LSE
// as written (rounded to f32 by the cpu backend into an f32 row_lse, exact in
// an f64 row_lse and in the fp64 reference):
// with Pb = exp(z - LSE_written), as that backward rebuilds P, the target mass
// is sum T~ [Pb >= eps] / sum Pb, so the backward's Pb G equals P G to
// rounding (docs/kl-forward.md). Rows are independent (split over threads);
// the loss sums the row terms in row order, so every result is the same for
// any thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/element_access.hpp"
#include "core/float_mode.hpp"
#include "core/threads.hpp"
#include "dsaib/reference.hpp"
#include "reference/cpu_reference.hpp"

namespace dsaib::detail {
namespace {

const double kEps = std::exp(-100.0);

double slot_value(const TensorView& v, const ProblemGeometry& g, int64_t r, int64_t i) {
  return load_element(v.dtype, v.data, row_offset(v, g.layout, r, g.s_q) + i * v.strides[g.layout == Layout::thd ? 1 : 2]);
}

/// `f32_lse`: the LSE is written in f32 (the cpu backend's f32 row_lse), so
/// row_lse holds its f32 rounding and the target mass is divided by the sum of
/// exp(z - that LSE).
ReferenceKLForward compute_forward(const IndexerInputs& in, const IndexerOptions& opt,
                                   const ProblemGeometry& g, bool f32_lse) {
  const int64_t K = g.topk;
  std::vector<double> z;
  if (in.topk_logits.present()) {
    // The top-k's logits, scaled as the cuda kernel scales them (an fp64
    // topk_logits unrounded). Invalid slots are never read.
    z.assign(static_cast<std::size_t>(g.num_q_rows * K), 0.0);
    const bool f32 = in.topk_logits.dtype == DType::f32;
    for (int64_t r = 0; r < g.num_q_rows; ++r) {
      int64_t b, tq;
      g.q_row_coords(r, &b, &tq);
      for (int64_t i = 0; i < K; ++i) {
        if (g.key_row(b, static_cast<int64_t>(slot_value(in.topk_indices, g, r, i))) < 0) continue;
        const double logit = slot_value(in.topk_logits, g, r, i);
        z[r * K + i] = f32 ? static_cast<double>(opt.sm_scale * static_cast<float>(logit))
                           : static_cast<double>(opt.sm_scale) * logit;
      }
    }
  } else {
    // reference_index_logits takes the backward's inputs: attn_score stands in
    // for the index_score it does not read.
    IndexerInputs with_target = in;
    with_target.index_score = in.attn_score;
    z = reference_index_logits(with_target, opt);
  }
  const double inf = std::numeric_limits<double>::infinity();
  ReferenceKLForward res;
  res.num_q_rows = g.num_q_rows;
  res.topk = K;
  res.row_lse.assign(g.num_q_rows, -inf);
  res.row_target_mass.assign(g.num_q_rows, 0.0);
  res.index_score.assign(g.num_q_rows * K, 0.0);
  std::vector<double> terms(g.num_q_rows, 0.0);
  const int threads = thread_count(opt.num_threads, g.num_q_rows);
  run_items_on_threads(threads, [&](int t) {
    const int64_t lo = g.num_q_rows * t / threads, hi = g.num_q_rows * (t + 1) / threads;
    std::vector<int64_t> krow(K);
    for (int64_t r = lo; r < hi; ++r) {
      int64_t b, tq;
      g.q_row_coords(r, &b, &tq);
      const double* zr = &z[r * K];
      // Validity from the ids (a valid slot's logit may itself be -inf); a NaN
      // logit makes the row's LSE NaN.
      double zmax = -inf;
      bool any_valid = false;
      for (int64_t i = 0; i < K; ++i) {
        krow[i] = g.key_row(b, static_cast<int64_t>(slot_value(in.topk_indices, g, r, i)));
        if (krow[i] < 0) continue;
        any_valid = true;
        zmax = std::isnan(zr[i]) || std::isnan(zmax) ? std::numeric_limits<double>::quiet_NaN() : std::max(zmax, zr[i]);
      }
      if (!any_valid) continue;  // LSE -inf, P 0, no loss term
      double sum = 0;
      for (int64_t i = 0; i < K; ++i) {
        if (krow[i] >= 0) sum += std::exp(zr[i] - zmax);
      }
      const double lse = zmax + std::log(sum);
      const double lse_written = f32_lse ? static_cast<double>(static_cast<float>(lse)) : lse;
      double mass = 0, term = 0, rebuilt_sum = 0;
      for (int64_t i = 0; i < K; ++i) {
        if (krow[i] < 0) continue;
        const double P = std::exp(zr[i] - lse);
        const double Pb = std::exp(zr[i] - lse_written);  // as the P-free backward rebuilds P
        const double T = std::max(slot_value(in.attn_score, g, r, i), kEps);  // a NaN T stays NaN
        res.index_score[r * K + i] = P;
        rebuilt_sum += Pb;
        if (Pb >= kEps) mass += T;
        term += T * std::log(std::max(P, kEps));
      }
      res.row_lse[r] = lse_written;
      // rebuilt_sum >= exp(zmax - lse_written) > 0 for finite logits; a NaN
      // sum (NaN logits: the LSE is NaN) leaves the mass as is.
      res.row_target_mass[r] = rebuilt_sum > 0 ? mass / rebuilt_sum : mass;
      terms[r] = term;
    }
  });
  double total = 0;
  for (int64_t r = 0; r < g.num_q_rows; ++r) total += terms[r];
  const double c = static_cast<double>(opt.loss_coeff) / static_cast<double>(g.normalization_count);
  res.loss = 0.0 - c * total;  // +0 (not -0) for a problem without terms
  return res;
}

}  // namespace

void run_cpu_kl_forward(const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                        const IndexerOptions& opt, const ProblemGeometry& g) {
  const IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ would read subnormals as 0 (float_mode.hpp)
  // An f64 row_lse holds the LSE unrounded: the target mass is then the fp64 reference's.
  const ReferenceKLForward ref = compute_forward(in, opt, g, /*f32_lse=*/out.row_lse.dtype != DType::f64);
  // Outputs are contiguous (validated), so flat element e is offset e; each is
  // written in its own dtype (f32, or f64 unrounded).
  store_element(out.loss.dtype, out.loss.data, 0, ref.loss);
  for (int64_t r = 0; r < g.num_q_rows; ++r) {
    store_element(out.row_lse.dtype, out.row_lse.data, r, ref.row_lse[r]);
    store_element(out.row_target_mass.dtype, out.row_target_mass.data, r, ref.row_target_mass[r]);
  }
  if (out.index_score.present()) {
    for (size_t e = 0; e < ref.index_score.size(); ++e) {
      store_element(out.index_score.dtype, out.index_score.data, static_cast<int64_t>(e), ref.index_score[e]);
    }
  }
}

}  // namespace dsaib::detail

namespace dsaib {

ReferenceKLForward reference_kl_forward(const IndexerInputs& inputs, const IndexerOptions& options) {
  const detail::IeeeSubnormalsScope ieee;  // the caller's FTZ/DAZ would read subnormals as 0 (float_mode.hpp)
  IndexerOptions opt = options;
  opt.backend = Backend::cpu;
  // The inputs' and options' rules of indexer_kl_forward(), without outputs.
  detail::check_options(opt);
  if (inputs.index_score.present()) {
    throw Error(ErrorCode::invalid_argument, "index_score",
                "index_score: expected absent in the inputs of the forward (it writes P to outputs.index_score), got a tensor");
  }
  IndexerInputs with_target = inputs;
  with_target.index_score = inputs.attn_score;
  with_target.topk_logits = {};
  const detail::ProblemGeometry g = detail::validate_problem(with_target, {}, opt, nullptr, /*check_outputs=*/false);
  detail::check_topk_logits(inputs, opt, g);
  return detail::compute_forward(inputs, opt, g, /*f32_lse=*/false);
}

}  // namespace dsaib
