// Test helpers of the indexer KL forward: an fp64 computation written apart
// from the library's reference (straight from docs/math.md, on the host
// tensors of a generated problem), forward output buffers, and error metrics
// in which NaN never passes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dsaib/indexer_kl_forward.hpp"
#include "support/test_support.hpp"

namespace dsaib::test {

struct Fp64Forward {
  double loss = 0;
  std::vector<double> lse, mass, p;  // (rows), (rows), (rows, topk)
  std::vector<double> z, t;          // (rows, topk): logits and T~ at valid slots, NaN at invalid ones
};

/// The forward in fp64 from the definition: a row's key rows come from
/// key_range() and the id mode; z from a direct double loop over heads and D.
/// Invalid slots of four kinds, in rows 0 to 3: a run of -1 at the start, an
/// id past the sequence, a row with no valid slot, a duplicate id.
inline void add_invalid_slots(GeneratedProblem& p) {
  invalidate_run(p, 0, Where::start, 2);
  set_out_of_range(p, 1, 0, 0);
  invalidate_row(p, 2);
  duplicate_slot(p, 3, 0, 1);
}

inline Fp64Forward fp64_forward(const GeneratedProblem& pr, const IndexerOptions& opt) {
  const int64_t R = num_q_rows(pr), K = topk(pr), H = pr.spec.heads, D = pr.spec.head_dim;
  const std::vector<double> q = to_doubles(pr.index_q), w = to_doubles(pr.weights), k = to_doubles(pr.index_k),
                            t = to_doubles(pr.attn_score);
  const double eps = std::exp(-100.0), inf = std::numeric_limits<double>::infinity();
  Fp64Forward f;
  f.lse.assign(R, -inf);
  f.mass.assign(R, 0.0);
  f.p.assign(R * K, 0.0);
  f.z.assign(R * K, std::numeric_limits<double>::quiet_NaN());
  f.t.assign(R * K, std::numeric_limits<double>::quiet_NaN());
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
        zi += w[r * H + h] * (x < 0 ? 0.0 : x);  // relu with NaN kept, as torch's
      }
      z[i] = static_cast<double>(opt.sm_scale) * zi;
      f.z[r * K + i] = z[i];
      f.t[r * K + i] = std::max(t[r * K + i], eps);
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

/// row_target_mass by its definition for the LSE as written (`lse`, e.g. the
/// f32 row_lse of a backend): with Pb_i = exp(z_i - lse) over the valid slots,
/// sum_i T~_i [Pb_i >= eps] / sum_i Pb_i (0 in a row without a valid slot).
inline std::vector<double> target_mass_for_lse(const Fp64Forward& f, const std::vector<double>& lse) {
  const double eps = std::exp(-100.0);
  const size_t R = f.lse.size(), K = R ? f.z.size() / R : 0;
  std::vector<double> mass(R, 0.0);
  for (size_t r = 0; r < R; ++r) {
    double m = 0, c = 0;
    for (size_t i = 0; i < K; ++i) {
      if (std::isnan(f.t[r * K + i])) continue;  // invalid slot
      const double pb = std::exp(f.z[r * K + i] - lse[r]);
      c += pb;
      if (pb >= eps) m += f.t[r * K + i];
    }
    mass[r] = c > 0 ? m / c : m;
  }
  return mass;
}

/// The same from a reference's exact LSE and target mass: sum_i exp(z_i - lse)
/// = exp(LSE - lse) (the exact P sums to 1), so the mass times exp(lse - LSE).
/// (The mask [Pb_i >= eps] can differ from the exact one only for a slot
/// within |LSE - lse| of the clip, which the generated problems do not have.)
inline std::vector<double> target_mass_for_lse(const std::vector<double>& ref_mass, const std::vector<double>& ref_lse,
                                               const std::vector<double>& lse) {
  std::vector<double> mass = ref_mass;
  for (size_t r = 0; r < mass.size(); ++r) {
    if (std::isfinite(ref_lse[r]) && std::isfinite(lse[r])) mass[r] *= std::exp(lse[r] - ref_lse[r]);
  }
  return mass;
}

/// Gives every logit of `p` a large common part with a small spread, the case
/// in which the f32 LSE's rounding (|LSE| 2^-24, common to a row) matters.
/// Keys: 1 on the first D/2 dims, -1/0/1 on the others. Each head's query:
/// `q_common` (>= 2) on the first D/2 dims, -1/0/1 on the others. Weights 1/2,
/// 1, 2 by head; sm_scale = 2^sm_scale_log2. So q.k = (D/2) q_common + O(sqrt D)
/// > 0 (relu passes every head) and z_i ~ sm_scale (D/2) q_common sum_h w_h
/// for every slot. Every value is a small integer times a power of two and
/// every partial sum stays below 2^24 units of the smallest, so z is the same in
/// f32 as in fp64 whatever the summation order: a backend's error against fp64
/// is its own rounding after the logits. index_score is refreshed to these
/// logits (the P form's input).
inline void give_logits_a_common_part(GeneratedProblem& p, int q_common, int sm_scale_log2, uint64_t seed) {
  const int64_t H = p.spec.heads, D = p.spec.head_dim, R = num_q_rows(p), Rk = num_k_rows(p);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto ternary = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<int>((state >> 33) % 3) - 1);
  };
  auto bf16_bits = [](float f) {  // exact: these values have at most 8 significant bits
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);
  };
  auto* q = p.index_q.data<uint16_t>();  // generated tensors are contiguous
  for (int64_t e = 0; e < R * H * D; ++e) q[e] = bf16_bits(e % D < D / 2 ? static_cast<float>(q_common) : ternary());
  auto* k = p.index_k.data<uint16_t>();
  for (int64_t e = 0; e < Rk * D; ++e) k[e] = bf16_bits(e % D < D / 2 ? 1.0f : ternary());
  const float w_of_head[3] = {0.5f, 1.0f, 2.0f};
  for (int64_t e = 0; e < R * H; ++e) {
    const float w = w_of_head[(e % H) % 3];
    if (p.weights.dtype == DType::f32) p.weights.data<float>()[e] = w;
    else p.weights.data<uint16_t>()[e] = bf16_bits(w);
  }
  p.sm_scale = std::ldexp(1.0f, sm_scale_log2);
  p.spec.sm_scale = p.sm_scale;
  refresh_index_score(p);
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
inline IndexerInputs forward_inputs(const GeneratedProblem& p) {
  IndexerInputs in = p.inputs();
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
