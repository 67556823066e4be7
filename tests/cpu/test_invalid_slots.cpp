// Invalid slots, S_kv < topk, duplicates and the eps clip (math contract:
// "Invalid slots contribute nothing anywhere: their T and P are ignored, as if
// both were 0"; "duplicates add twice"; "m_i = [P_i >= eps]").
//
// Equivalences are checked on the fp64 reference gradients to 1e-14 of the
// largest entry (they hold exactly in real arithmetic); the backend's outputs
// are checked for exact zeros and finiteness.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();

/// max |a - b| <= tol * max |a|, per gradient tensor.
void expect_same_gradients(const ReferenceGradients& a, const ReferenceGradients& b, double tol = 1e-14) {
  auto check = [&](const std::vector<double>& x, const std::vector<double>& y, const char* name) {
    ASSERT_EQ(x.size(), y.size()) << name;
    double err = 0, scale = 0;
    for (size_t e = 0; e < x.size(); ++e) {
      err = std::max(err, std::abs(x[e] - y[e]));
      scale = std::max(scale, std::abs(x[e]));
      ASSERT_TRUE(std::isfinite(y[e])) << name << "[" << e << "]";
    }
    EXPECT_LE(err, tol * scale) << name << " (scale " << scale << ")";
  };
  check(a.d_index_q, b.d_index_q, "d_index_q");
  check(a.d_weights, b.d_weights, "d_weights");
  check(a.d_index_k, b.d_index_k, "d_index_k");
}

ReferenceGradients grads(const GeneratedProblem& p, IndexerOptions o) {
  o.num_threads = 2;
  return reference_backward(p.inputs(), o);
}

/// B3 S40, all slots valid, then holes of every kind.
GeneratedProblem holey_problem(IdMode mode) {
  GenerateSpec s = small_spec(41);
  s.batch = 3;
  s.s_q = 40;
  s.s_kv = 40;
  s.topk = 16;
  s.ids = IdPattern::random_permutation;
  s.id_mode = mode;
  GeneratedProblem p = make_problem(s);
  invalidate_run(p, 0, Where::start, 3);    // batch 0, first row
  invalidate_run(p, 5, Where::middle, 4);
  invalidate_run(p, 10, Where::end, 5);
  invalidate_row(p, 13);
  set_out_of_range(p, 45, 0);               // batch 1: one past the sequence
  set_id(p, 45, 3, 1000);
  set_id(p, 45, 7, INT_MAX);
  set_id(p, 45, 9, -2);
  set_id(p, 45, 15, INT_MIN);
  set_id(p, 46, 4, mode == IdMode::global ? 3 : -40);  // global: a key of batch 0
  invalidate_run(p, 100, Where::start, 2);  // batch 2
  invalidate_run(p, 100, Where::end, 2);
  invalidate_row(p, 119);                   // the very last row
  refresh_scores(p);
  return p;
}

TEST(InvalidSlots, EqualCompactedProblemWhateverTheirScores) {
  for (IdMode mode : {IdMode::local, IdMode::global}) {
    const GeneratedProblem p = holey_problem(mode);
    const ReferenceGradients want = grads(compacted(p), p.options());
    for (float junk : {0.0f, 0.7f, 1e30f, -5.0f, kNaN, std::numeric_limits<float>::infinity()}) {
      SCOPED_TRACE("T = P = " + std::to_string(junk) + " at invalid slots, " + id_mode_name(mode));
      GeneratedProblem q = p;
      fill_invalid_scores(q, junk);
      expect_same_gradients(want, grads(q, q.options()));
      const OutputBuffers o = run_cpu(q, q.options());
      for (const HostTensor* t : {&o.d_index_q, &o.d_weights, &o.d_index_k}) {
        EXPECT_TRUE(compare(*t, to_doubles(*t)).all_finite);
      }
    }
  }
}

// A NaN target T at a VALID slot whose P >= eps propagates (max(T, eps) as
// std::max, not fmax): that row's d_index_q and d_weights are NaN, the other
// rows are untouched (docs/math.md; the cuda kernel uses the same rule).
TEST(InvalidSlots, NanTargetAtAValidSlotPropagatesToItsRow) {
  GeneratedProblem p = holey_problem(IdMode::local);
  const ReferenceGradients clean = grads(p, p.options());
  const int64_t row = 20, K = topk(p), H = p.spec.heads, D = p.spec.head_dim;
  int64_t slot = -1;
  for (int64_t i = 0; i < K && slot < 0; ++i) {
    if (slot_valid(p, row, i) && p.index_score.data<float>()[row * K + i] >= 1e-30f) slot = i;
  }
  ASSERT_GE(slot, 0);
  p.attn_score.data<float>()[row * K + slot] = kNaN;
  const ReferenceGradients g = grads(p, p.options());
  for (int64_t e = 0; e < H * D; ++e) ASSERT_TRUE(std::isnan(g.d_index_q[row * H * D + e])) << e;
  for (int64_t e = 0; e < H; ++e) ASSERT_TRUE(std::isnan(g.d_weights[row * H + e])) << e;
  for (int64_t e = 0; e < H; ++e) EXPECT_EQ(g.d_weights[(row + 1) * H + e], clean.d_weights[(row + 1) * H + e]);
}

TEST(InvalidSlots, AllInvalidRowsGiveExactZeros) {
  GeneratedProblem p = holey_problem(IdMode::local);
  // Rows 13 and 119 are all -1; make row 70 all out of range.
  for (int64_t i = 0; i < topk(p); ++i) set_id(p, 70, i, 40 + static_cast<int32_t>(i));
  fill_invalid_scores(p, kNaN);
  for (DType dt : {DType::f32, DType::bf16}) {
    const OutputBuffers o = run_cpu(p, p.options(), dt, dt, dt);
    const std::vector<double> dq = to_doubles(o.d_index_q), dw = to_doubles(o.d_weights);
    const int64_t H = p.spec.heads, D = p.spec.head_dim;
    for (int64_t r : {13, 70, 119}) {
      for (int64_t e = 0; e < H * D; ++e) ASSERT_EQ(dq[r * H * D + e], 0.0) << "row " << r;
      for (int64_t e = 0; e < H; ++e) ASSERT_EQ(dw[r * H + e], 0.0) << "row " << r;
    }
    // A row with valid slots is not zero.
    double s = 0;
    for (int64_t e = 0; e < H; ++e) s += std::abs(dw[12 * H + e]);
    EXPECT_GT(s, 0.0);
  }
}

TEST(InvalidSlots, KeysNeverSelectedGetZero) {
  GenerateSpec s = small_spec(42);
  s.ids = IdPattern::causal_topk;
  s.s_kv = 30;  // causal offset 6: keys 0..6 visible to row 0, the last keys to few rows
  GeneratedProblem p = make_problem(s);
  std::vector<bool> used(static_cast<size_t>(num_k_rows(p)), false);
  for (int64_t r = 0; r < num_q_rows(p); ++r) {
    int64_t lo, hi;
    key_range(p, r, &lo, &hi);
    for (int64_t i = 0; i < topk(p); ++i) {
      if (slot_valid(p, r, i)) used[lo + get_id(p, r, i)] = true;
    }
  }
  const OutputBuffers o = run_cpu(p, p.options());
  const std::vector<double> dk = to_doubles(o.d_index_k);
  int64_t unused = 0;
  for (int64_t j = 0; j < num_k_rows(p); ++j) {
    if (used[j]) continue;
    ++unused;
    for (int64_t d = 0; d < s.head_dim; ++d) ASSERT_EQ(dk[j * s.head_dim + d], 0.0) << "key row " << j;
  }
  EXPECT_GT(unused, 0);
}

/// The first k slots of every row, as a problem with topk = k.
GeneratedProblem first_slots(const GeneratedProblem& p, int64_t k) {
  GeneratedProblem c = p;
  const int64_t R = num_q_rows(p), K = topk(p);
  std::vector<int64_t> shape = p.topk_indices.shape;
  shape.back() = k;
  c.spec.topk = k;
  c.topk_indices = HostTensor(DType::i32, shape);
  c.attn_score = HostTensor(DType::f32, shape);
  c.index_score = HostTensor(DType::f32, shape);
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(c.topk_indices.data<int32_t>() + r * k, p.topk_indices.data<int32_t>() + r * K, k * 4);
    std::memcpy(c.attn_score.data<float>() + r * k, p.attn_score.data<float>() + r * K, k * 4);
    std::memcpy(c.index_score.data<float>() + r * k, p.index_score.data<float>() + r * K, k * 4);
  }
  return c;
}

TEST(InvalidSlots, KeysFewerThanTopk) {
  for (IdPattern ids : {IdPattern::random_permutation, IdPattern::causal_topk}) {
    GenerateSpec s = small_spec(43);
    s.s_q = 3;
    s.s_kv = 100;
    s.topk = 2048;
    s.ids = ids;
    GeneratedProblem p = make_problem(s);
    for (int64_t r = 0; r < num_q_rows(p); ++r) {
      const int64_t want = ids == IdPattern::random_permutation ? 100 : 98 + r % 3;  // causal: s <= t + 97
      int64_t valid = 0;
      for (int64_t i = 0; i < topk(p); ++i) valid += slot_valid(p, r, i);
      ASSERT_EQ(valid, want) << "row " << r;
      for (int64_t i = want; i < topk(p); ++i) ASSERT_EQ(get_id(p, r, i), -1);
    }
    fill_invalid_scores(p, 0.25f);
    expect_same_gradients(grads(first_slots(p, 100), p.options()), grads(p, p.options()));
    const OutputBuffers o = run_cpu(p, p.options(), DType::bf16, DType::bf16, DType::bf16);
    EXPECT_TRUE(compare(o.d_index_k, grads(p, p.options()).d_index_k).ok(3e-3));
  }
}

/// Duplicated ids add twice: the problem with slot `dup` repeating key j equals
/// the problem where that slot names a fresh copy j' of key j, with
/// dK_j(dup) = dK_j + dK_j'.
TEST(InvalidSlots, DuplicatesContributeTwice) {
  GenerateSpec s = small_spec(44);
  s.ids = IdPattern::random_permutation;
  GeneratedProblem p = make_problem(s);
  const int64_t D = s.head_dim, S = s.s_kv, row = 30, b = row / s.s_q;
  duplicate_slot(p, row, 2, 7);
  duplicate_slot(p, row, 2, 11);  // three times in all
  duplicate_slot(p, 3, 0, 1);     // batch 0 too
  refresh_scores(p);
  const int32_t j = get_id(p, row, 2);

  // Same keys plus one extra row per batch (S + 1); the extra row of batch b copies key j.
  GeneratedProblem q = p;
  q.spec.s_kv = S + 1;
  q.index_k = HostTensor(DType::bf16, {s.batch, S + 1, D});
  for (int64_t bb = 0; bb < s.batch; ++bb) {
    std::memcpy(q.index_k.data<uint16_t>() + bb * (S + 1) * D, p.index_k.data<uint16_t>() + bb * S * D, S * D * 2);
  }
  std::memcpy(q.index_k.data<uint16_t>() + (b * (S + 1) + S) * D, p.index_k.data<uint16_t>() + (b * S + j) * D, D * 2);
  set_id(q, row, 7, static_cast<int32_t>(S));
  const ReferenceGradients gp = grads(p, p.options()), gq = grads(q, q.options());
  ReferenceGradients merged = gp;
  for (int64_t bb = 0; bb < s.batch; ++bb) {
    for (int64_t k = 0; k < S; ++k) {
      for (int64_t d = 0; d < D; ++d) merged.d_index_k[(bb * S + k) * D + d] = gq.d_index_k[(bb * (S + 1) + k) * D + d];
    }
  }
  for (int64_t d = 0; d < D; ++d) merged.d_index_k[(b * S + j) * D + d] += gq.d_index_k[(b * (S + 1) + S) * D + d];
  merged.d_index_q = gq.d_index_q;
  merged.d_weights = gq.d_weights;
  expect_same_gradients(gp, merged, 1e-13);
  // And the duplicate matters: without it dK_j differs.
  double diff = 0;
  for (int64_t d = 0; d < D; ++d) diff += std::abs(gp.d_index_k[(b * S + j) * D + d] - gq.d_index_k[(b * (S + 1) + j) * D + d]);
  EXPECT_GT(diff, 0.0);
}

/// P below eps is clipped out of the gradient: such a slot acts exactly like an
/// invalid one. The smallest fp32 >= eps (a subnormal) is NOT clipped, so an
/// implementation flushing subnormals to zero fails here.
TEST(InvalidSlots, EpsClipOfTinyPredictions) {
  GenerateSpec s = small_spec(45);
  s.ids = IdPattern::random_permutation;
  GeneratedProblem p = make_problem(s);
  const double eps = std::exp(-100.0);
  float at_eps = static_cast<float>(eps);
  while (static_cast<double>(at_eps) < eps) at_eps = std::nextafter(at_eps, 1.0f);
  const float below_eps = std::nextafter(at_eps, 0.0f);
  ASSERT_LT(static_cast<double>(below_eps), eps);
  ASSERT_EQ(std::fpclassify(at_eps), FP_SUBNORMAL);

  GeneratedProblem clipped = p, invalid = p, kept = p;
  for (int64_t r : {4, 30, 47}) {
    clipped.index_score.data<float>()[r * topk(p) + 3] = below_eps;
    kept.index_score.data<float>()[r * topk(p) + 3] = at_eps;
    set_id(invalid, r, 3, -1);
  }
  const ReferenceGradients gc = grads(clipped, p.options()), gi = grads(invalid, p.options());
  expect_same_gradients(gi, gc);
  const ReferenceGradients gk = grads(kept, p.options());
  double diff = 0;
  for (int64_t e = 0; e < s.heads; ++e) diff += std::abs(gk.d_weights[30 * s.heads + e] - gc.d_weights[30 * s.heads + e]);
  EXPECT_GT(diff, 0.0) << "P = smallest fp32 >= eps must count (g_i = -c T_i), not be flushed";

  const OutputBuffers oc = run_cpu(clipped, p.options()), oi = run_cpu(invalid, p.options());
  EXPECT_TRUE(bitwise_equal(oc.d_index_q, oi.d_index_q));
  EXPECT_TRUE(bitwise_equal(oc.d_weights, oi.d_weights));
  EXPECT_TRUE(bitwise_equal(oc.d_index_k, oi.d_index_k));
}

/// T below eps is raised to eps: T = 0 and T = 1e-45 at a valid slot give the same gradient.
TEST(InvalidSlots, TinyTargetsRaisedToEps) {
  GenerateSpec s = small_spec(46);
  GeneratedProblem a = make_problem(s);
  GeneratedProblem b = a;
  a.attn_score.data<float>()[30 * topk(a) + 1] = 0.0f;
  b.attn_score.data<float>()[30 * topk(a) + 1] = 1e-45f;
  expect_same_gradients(grads(a, a.options()), grads(b, b.options()), 0.0);
}

}  // namespace
}  // namespace dsaib::test
