// Finite-difference proof of the fp64 reference.
//
// The reference gradients (dsaib::reference_backward) are compared with central
// finite differences of the public loss dsaib::indexer_kl_loss(recompute_p =
// true), which recomputes P = softmax(z) from q, w and k itself. Before each
// analytic gradient, index_score is set to that true softmax, so the two sides
// describe the same function.
//
// The inputs are bf16, so a perturbation must be exactly representable: the
// sampled entry is first set to +-0.5 (q, k) or +-0.25 (w); then the points
// v +- h, v +- 2h with h = 2^-7 (q, k) or 2^-8 (w) are all bf16-exact (bf16 has
// 8 significant bits: ulp 2^-9 just below 0.5, 2^-8 above; 2^-10/2^-9 around
// 0.25). The derivative is the 4th-order central difference
//   f' ~ (8 (f(v+h) - f(v-h)) - (f(v+2h) - f(v-2h))) / (12 h).
// Samples whose perturbation could cross a relu kink (some affected
// |x_hi| <= 2.5h |dx/dv|) are skipped; those |x| are the only thing this test
// computes itself.
//
// Error measure: |analytic - fd| / max(|fd|, rms of that gradient tensor),
// required <= 1e-6. The floor is needed because index_score is fp32 by
// contract: the reference's gs_i = g_i - P_i G then carries an absolute error
// of about 2^-24 * P_i * |G|, i.e. ~1e-7 of the gradient's scale; an entry far
// below the RMS (cancellation in sum_i gs_i ...) cannot be checked to 1e-6 of
// itself. Measured: worst |analytic - fd| / rms ~ 2.5e-7, FD error itself
// (4th order, fp64 loss) ~ 1e-10.
//
// "The check can fail": the same harness is fed gradients that are wrong in
// known ways, produced by the reference itself from altered inputs (no
// test-local formula):
//   - P*G dropped: index_score set to the smallest fp32 >= eps at every valid
//     slot, so gs_i = g_i - eps*G = g_i (to 1e-43), which is the gradient an
//     implementation forgetting the softmax-normalisation term would return;
//     it must miss by > 1e-3;
//   - a uniform 1e-5 relative error (grad_loss scaled by 1 + 1e-5): it must be
//     caught, i.e. the harness resolves errors 10x its tolerance.
// Checked by hand as well: deleting "- P_i * G" in cpu_reference.cpp makes the
// three FD tests below fail (errors ~0.1 to 10).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>

#include "core/bf16.hpp"
#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

constexpr double kTol = 1e-6;

enum class Which { q, w, k };
const char* which_name(Which w) { return w == Which::q ? "index_q" : w == Which::w ? "weights" : "index_k"; }

HostTensor& tensor_of(GeneratedProblem& p, Which w) {
  return w == Which::q ? p.index_q : w == Which::w ? p.weights : p.index_k;
}

double get(const HostTensor& t, int64_t e) {
  if (t.dtype == DType::bf16) return detail::bf16_to_float(t.data<uint16_t>()[e]);
  return t.data<float>()[e];
}
void set_exact(HostTensor& t, int64_t e, double v) {
  if (t.dtype == DType::bf16) {
    const uint16_t h = detail::float_to_bf16(static_cast<float>(v));
    ASSERT_EQ(detail::bf16_to_float(h), v) << "not bf16-exact: " << v;
    t.data<uint16_t>()[e] = h;
  } else {
    ASSERT_EQ(static_cast<double>(static_cast<float>(v)), v) << "not f32-exact: " << v;
    t.data<float>()[e] = static_cast<float>(v);
  }
}

/// Gradient of the problem as fp64 vectors (q, w, k), computed some way.
using GradFn = std::function<ReferenceGradients(const GeneratedProblem&, const IndexerOptions&)>;

ReferenceGradients true_gradient(const GeneratedProblem& p, const IndexerOptions& o) {
  return reference_backward(p.inputs(), o);
}

const std::vector<double>& grad_of(const ReferenceGradients& g, Which w) {
  return w == Which::q ? g.d_index_q : w == Which::w ? g.d_weights : g.d_index_k;
}

/// |x| of every (row, slot, head) the perturbation of entry e touches, with
/// |dx/dv|; true if a kink could be crossed within +-2h.
bool near_kink(const GeneratedProblem& p, Which which, int64_t e, double h) {
  if (which == Which::w) return false;  // z is linear in w
  const int64_t H = p.spec.heads, D = p.spec.head_dim, R = num_q_rows(p), K = topk(p);
  auto q = [&](int64_t r, int64_t hh, int64_t d) { return get(p.index_q, (r * H + hh) * D + d); };
  auto krow = [&](int64_t r, int64_t i) {
    int64_t lo, hi;
    key_range(p, r, &lo, &hi);
    return get_id(p, r, i) + (p.spec.id_mode == IdMode::local ? lo : 0);
  };
  auto x_of = [&](int64_t r, int64_t hh, int64_t j) {
    double x = 0;
    for (int64_t d = 0; d < D; ++d) x += q(r, hh, d) * get(p.index_k, j * D + d);
    return x;
  };
  if (which == Which::q) {
    const int64_t r = e / (H * D), hh = (e / D) % H, d = e % D;
    for (int64_t i = 0; i < K; ++i) {
      if (!slot_valid(p, r, i)) continue;
      const int64_t j = krow(r, i);
      if (std::abs(x_of(r, hh, j)) <= 2.5 * h * std::abs(get(p.index_k, j * D + d))) return true;
    }
    return false;
  }
  const int64_t j = e / D, d = e % D;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < K; ++i) {
      if (!slot_valid(p, r, i) || krow(r, i) != j) continue;
      for (int64_t hh = 0; hh < H; ++hh) {
        if (std::abs(x_of(r, hh, j)) <= 2.5 * h * std::abs(q(r, hh, d))) return true;
      }
    }
  }
  return false;
}

struct Sample {
  Which which;
  int64_t element;
};

struct FdOutcome {
  int checked = 0, skipped = 0;
  double max_rel[3] = {0, 0, 0};  // per Which
  std::string worst;
};

/// Runs the FD comparison of `grad` over the samples. The problem is restored afterwards.
FdOutcome run_fd(GeneratedProblem p, const IndexerOptions& opt, const std::vector<Sample>& samples,
                 const GradFn& grad) {
  FdOutcome out;
  // Floor of the relative error: RMS of each true gradient tensor.
  refresh_index_score(p);
  const ReferenceGradients g0 = reference_backward(p.inputs(), opt);
  double rms[3];
  for (Which w : {Which::q, Which::w, Which::k}) {
    const auto& v = grad_of(g0, w);
    double s = 0;
    for (double x : v) s += x * x;
    rms[static_cast<int>(w)] = std::sqrt(s / std::max<size_t>(v.size(), 1));
  }
  for (const Sample& s : samples) {
    HostTensor& t = tensor_of(p, s.which);
    const double original = get(t, s.element);
    const double base = (s.which == Which::w ? 0.25 : 0.5) * (original < 0 ? -1 : 1);
    const double h = s.which == Which::w ? 0x1.0p-8 : 0x1.0p-7;
    set_exact(t, s.element, base);
    if (near_kink(p, s.which, s.element, h)) {
      ++out.skipped;
      set_exact(t, s.element, original);
      continue;
    }
    refresh_index_score(p);
    const double analytic = grad_of(grad(p, opt), s.which)[s.element];
    auto f = [&](double v) {
      set_exact(t, s.element, v);
      return indexer_kl_loss(p.inputs(), opt, /*recompute_p=*/true);
    };
    const double fd = (8.0 * (f(base + h) - f(base - h)) - (f(base + 2 * h) - f(base - 2 * h))) / (12.0 * h);
    set_exact(t, s.element, original);
    const int wi = static_cast<int>(s.which);
    const double rel = std::abs(analytic - fd) / std::max(std::abs(fd), rms[wi]);
    if (getenv("FD_VERBOSE")) std::printf("%s[%ld] an %.10e fd %.10e rel %.2e absrel %.2e/rms\n", which_name(s.which), (long)s.element, analytic, fd, rel, std::abs(analytic - fd)/rms[wi]);
    if (rel > out.max_rel[wi]) {
      out.max_rel[wi] = rel;
      if (rel >= *std::max_element(out.max_rel, out.max_rel + 3)) {
        out.worst = std::string(which_name(s.which)) + "[" + std::to_string(s.element) + "]: analytic " +
                    std::to_string(analytic) + " fd " + std::to_string(fd);
      }
    }
    ++out.checked;
  }
  refresh_index_score(p);
  return out;
}

/// Samples: q entries of rows with valid slots, every w sampled the same way,
/// k entries of key rows that some row selects.
std::vector<Sample> pick_samples(const GeneratedProblem& p, int per_tensor, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t H = p.spec.heads, D = p.spec.head_dim, R = num_q_rows(p), K = topk(p);
  std::vector<int64_t> rows_with_valid, selected_keys;
  for (int64_t r = 0; r < R; ++r) {
    int64_t lo, hi;
    key_range(p, r, &lo, &hi);
    bool any = false;
    for (int64_t i = 0; i < K; ++i) {
      if (!slot_valid(p, r, i)) continue;
      any = true;
      selected_keys.push_back(get_id(p, r, i) + (p.spec.id_mode == IdMode::local ? lo : 0));
    }
    if (any) rows_with_valid.push_back(r);
  }
  std::vector<Sample> s;
  for (int n = 0; n < per_tensor; ++n) {
    const int64_t r = rows_with_valid[rng() % rows_with_valid.size()];
    s.push_back({Which::q, (r * H + static_cast<int64_t>(rng() % H)) * D + static_cast<int64_t>(rng() % D)});
    const int64_t r2 = rows_with_valid[rng() % rows_with_valid.size()];
    s.push_back({Which::w, r2 * H + static_cast<int64_t>(rng() % H)});
    const int64_t j = selected_keys[rng() % selected_keys.size()];
    s.push_back({Which::k, j * D + static_cast<int64_t>(rng() % D)});
  }
  return s;
}

/// BSHD, local ids, causal (so early rows have -1 slots), plus a duplicate and
/// a hole in the middle of a row.
GeneratedProblem bshd_problem(bool weights_f32) {
  GenerateSpec spec = small_spec(11);
  spec.weights_f32 = weights_f32;
  GeneratedProblem p = make_problem(spec);
  duplicate_slot(p, 30, 0, 5);               // batch 1, t = 6: slot 5 repeats slot 0
  invalidate_run(p, 40, Where::middle, 3);   // batch 1, t = 16
  refresh_scores(p);
  return p;
}

IndexerOptions fd_options(const GeneratedProblem& p) {
  IndexerOptions o = p.options();
  o.loss_coeff = 0.7f;
  o.grad_loss = 1.3f;
  o.num_threads = 2;
  return o;
}

void expect_fd_ok(const FdOutcome& r) {
  EXPECT_GE(r.checked, 20) << "too many samples skipped near relu kinks (" << r.skipped << ")";
  for (Which w : {Which::q, Which::w, Which::k}) {
    EXPECT_LE(r.max_rel[static_cast<int>(w)], kTol) << which_name(w) << "; worst sample " << r.worst;
  }
}

TEST(FiniteDifference, BshdBf16Weights) {
  const GeneratedProblem p = bshd_problem(false);
  const FdOutcome r = run_fd(p, fd_options(p), pick_samples(p, 12, 1), true_gradient);
  expect_fd_ok(r);
  std::printf("checked %d (skipped %d): max rel err q %.2e w %.2e k %.2e\n", r.checked, r.skipped, r.max_rel[0],
              r.max_rel[1], r.max_rel[2]);
}

TEST(FiniteDifference, BshdF32WeightsNegativeScale) {
  GeneratedProblem p = bshd_problem(true);
  p.sm_scale = -0.3f;  // options() and refresh_index_score() follow it
  refresh_scores(p);
  const IndexerOptions o = fd_options(p);
  const FdOutcome r = run_fd(p, o, pick_samples(p, 12, 2), true_gradient);
  expect_fd_ok(r);
}

TEST(FiniteDifference, ThdGlobalIdsExplicitN) {
  GenerateSpec spec = small_spec(12);
  spec.layout = Layout::thd;
  spec.seqlens_q = {5, 19, 11};
  spec.seqlens_k = {7, 19, 30};
  spec.topk = 8;
  spec.id_mode = IdMode::global;
  spec.ids = IdPattern::random_permutation;
  GeneratedProblem p = make_problem(spec);
  duplicate_slot(p, 10, 1, 6);
  refresh_scores(p);
  IndexerOptions o = fd_options(p);
  o.normalization_count = 17;
  const FdOutcome r = run_fd(p, o, pick_samples(p, 12, 3), true_gradient);
  expect_fd_ok(r);
}

// ---- the check can fail ---------------------------------------------------

TEST(FiniteDifference, DetectsDroppedSoftmaxTerm) {
  const GeneratedProblem p = bshd_problem(false);
  const float eps_f32 = [] {
    float f = static_cast<float>(std::exp(-100.0));
    while (static_cast<double>(f) < std::exp(-100.0)) f = std::nextafter(f, 1.0f);
    return f;
  }();
  // index_score = eps at every valid slot: the reference then returns gs_i = g_i,
  // i.e. the gradient with the P*G term dropped.
  const GradFn dropped = [&](const GeneratedProblem& q, const IndexerOptions& o) {
    GeneratedProblem m = q;
    fill(m.index_score, 0.0);
    for (int64_t r = 0; r < num_q_rows(m); ++r) {
      for (int64_t i = 0; i < topk(m); ++i) {
        if (slot_valid(m, r, i)) m.index_score.data<float>()[r * topk(m) + i] = eps_f32;
      }
    }
    return reference_backward(m.inputs(), o);
  };
  const FdOutcome r = run_fd(p, fd_options(p), pick_samples(p, 12, 1), dropped);
  ASSERT_GE(r.checked, 20);
  for (Which w : {Which::q, Which::w, Which::k}) {
    EXPECT_GT(r.max_rel[static_cast<int>(w)], 1e3 * kTol) << which_name(w);
  }
}

TEST(FiniteDifference, DetectsRelativeErrorOf1e5) {
  const GeneratedProblem p = bshd_problem(false);
  const GradFn scaled = [](const GeneratedProblem& q, const IndexerOptions& o) {
    IndexerOptions o2 = o;
    o2.grad_loss = static_cast<float>(o.grad_loss * (1.0 + 1e-5));
    return reference_backward(q.inputs(), o2);
  };
  const FdOutcome r = run_fd(p, fd_options(p), pick_samples(p, 12, 1), scaled);
  ASSERT_GE(r.checked, 20);
  for (Which w : {Which::q, Which::w, Which::k}) {
    EXPECT_GT(r.max_rel[static_cast<int>(w)], 5 * kTol) << which_name(w);
  }
}

}  // namespace
}  // namespace dsaib::test
