// Test helpers of the indexer KL forward: an fp64 computation written apart
// from the library's reference (straight from docs/math.md, on the host
// tensors of a generated problem), forward output buffers, and error metrics
// in which NaN never passes.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "dsaib/indexer_kl_forward.hpp"
#include "support/test_support.hpp"

namespace dsaib::test {

struct Fp64Forward {
  double loss = 0;
  std::vector<double> lse, mass, p;  // (rows), (rows), (rows, topk)
};

/// The forward in fp64 from the definition: a row's key rows come from
/// key_range() and the id mode; z from a direct double loop over heads and D.
inline Fp64Forward fp64_forward(const GeneratedProblem& pr, const IndexerBackwardOptions& opt) {
  const int64_t R = num_q_rows(pr), K = topk(pr), H = pr.spec.heads, D = pr.spec.head_dim;
  const std::vector<double> q = to_doubles(pr.index_q), w = to_doubles(pr.weights), k = to_doubles(pr.index_k),
                            t = to_doubles(pr.attn_score);
  const double eps = std::exp(-100.0), inf = std::numeric_limits<double>::infinity();
  Fp64Forward f;
  f.lse.assign(R, -inf);
  f.mass.assign(R, 0.0);
  f.p.assign(R * K, 0.0);
  double total = 0;
  std::vector<double> z(K);
  std::vector<int64_t> kr(K);
  for (int64_t r = 0; r < R; ++r) {
    int64_t begin, end;
    key_range(pr, r, &begin, &end);
    double zmax = -inf;
    bool any = false;
    for (int64_t i = 0; i < K; ++i) {
      const int64_t id = get_id(pr, r, i);
      const int64_t row = opt.id_mode == IdMode::local ? begin + id : id;
      kr[i] = (id >= 0 || opt.id_mode == IdMode::global) && row >= begin && row < end ? row : -1;
      if (kr[i] < 0) continue;
      double zi = 0;
      for (int64_t h = 0; h < H; ++h) {
        double x = 0;
        for (int64_t d = 0; d < D; ++d) x += q[(r * H + h) * D + d] * k[kr[i] * D + d];
        zi += w[r * H + h] * (x > 0 ? x : 0.0);
      }
      z[i] = static_cast<double>(opt.sm_scale) * zi;
      zmax = any ? std::max(zmax, z[i]) : z[i];
      any = true;
    }
    if (!any) continue;
    double s = 0;
    for (int64_t i = 0; i < K; ++i) s += kr[i] >= 0 ? std::exp(z[i] - zmax) : 0.0;
    f.lse[r] = zmax + std::log(s);
    double term = 0;
    for (int64_t i = 0; i < K; ++i) {
      if (kr[i] < 0) continue;
      const double P = std::exp(z[i] - f.lse[r]);
      const double T = std::max(t[r * K + i], eps);
      f.p[r * K + i] = P;
      if (P >= eps) f.mass[r] += T;
      term += T * std::log(std::max(P, eps));
    }
    total += term;
  }
  const int64_t n = opt.normalization_count > 0 ? opt.normalization_count : std::max<int64_t>(R, 1);
  f.loss = -(static_cast<double>(opt.loss_coeff) / static_cast<double>(n)) * total;
  return f;
}

/// Host f32 outputs of the forward, shaped for a problem.
struct ForwardBuffers {
  HostTensor loss, row_lse, row_target_mass, index_score;
  IndexerKLForwardOutputs views(bool with_p = true) const {
    return {loss.view(), row_lse.view(), row_target_mass.view(), with_p ? index_score.view() : TensorView{}};
  }
};
inline ForwardBuffers make_forward_buffers(const GeneratedProblem& p) {
  ForwardBuffers b;
  const bool thd = p.spec.layout == Layout::thd;
  std::vector<int64_t> rows = thd ? std::vector<int64_t>{num_q_rows(p)} : std::vector<int64_t>{p.spec.batch, p.spec.s_q};
  std::vector<int64_t> slots = rows;
  slots.push_back(topk(p));
  b.loss = HostTensor(DType::f32, {});
  b.row_lse = HostTensor(DType::f32, rows);
  b.row_target_mass = HostTensor(DType::f32, rows);
  b.index_score = HostTensor(DType::f32, slots);
  poison(b.loss);
  poison(b.row_lse);
  poison(b.row_target_mass);
  poison(b.index_score);
  return b;
}

/// The problem's inputs without index_score (the forward's inputs).
inline IndexerBackwardInputs forward_inputs(const GeneratedProblem& p) {
  IndexerBackwardInputs in = p.inputs();
  in.index_score = TensorView{};
  return in;
}

/// Largest error of `got` against `want`, elementwise: |got - want| (absolute)
/// or |got - want| / |want| (relative, only where |want| >= floor). Matching
/// infinities count as exact; NaN or a mismatched infinity gives +inf.
inline double max_error(const std::vector<double>& got, const std::vector<double>& want, bool relative,
                        double floor = 0) {
  double err = got.size() == want.size() ? 0.0 : std::numeric_limits<double>::infinity();
  for (size_t e = 0; e < std::min(got.size(), want.size()); ++e) {
    if (std::isinf(want[e]) && got[e] == want[e]) continue;
    if (!std::isfinite(got[e]) || !std::isfinite(want[e])) return std::numeric_limits<double>::infinity();
    if (relative && std::abs(want[e]) < floor) continue;
    const double d = std::abs(got[e] - want[e]);
    err = std::max(err, relative ? d / std::abs(want[e]) : d);
  }
  return err;
}

/// P at slots where want is below `floor`: the largest absolute error there
/// (P has no relative accuracy deep in fp32's subnormals). NaN gives +inf.
inline double max_abs_error_below(const std::vector<double>& got, const std::vector<double>& want, double floor) {
  double err = 0;
  for (size_t e = 0; e < want.size(); ++e) {
    if (!std::isfinite(got[e])) return std::numeric_limits<double>::infinity();
    if (std::abs(want[e]) < floor) err = std::max(err, std::abs(got[e] - want[e]));
  }
  return err;
}

inline double rel_error(double got, double want) {
  if (!std::isfinite(got)) return std::numeric_limits<double>::infinity();
  return want == 0 ? std::abs(got) : std::abs(got - want) / std::abs(want);
}

}  // namespace dsaib::test
