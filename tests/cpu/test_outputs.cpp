// Outputs and inputs of the cpu backend (docs/api.md, "The problem"): incoming output contents never matter, poisoned outputs come
// back finite and right, strided inputs are read through their strides, bf16
// and f32 outputs, scalars (grad_loss_device, N), replay determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#if defined(__x86_64__) || defined(__SSE2__)
#include <xmmintrin.h>
#endif

#include "core/bf16.hpp"
#include "core/element_access.hpp"
#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

/// bf16 nearest-even rounding of a double, computed independently of bf16.hpp:
/// on the exact scaled significand (doubles hold every step exactly).
double bf16_round_reference(double d) {
  if (std::isnan(d) || std::isinf(d) || d == 0) return d;
  const double a = std::fabs(d);
  int e = 0;
  (void)std::frexp(a, &e);                       // a = m * 2^e, m in [0.5, 1)
  const int quantum_exp = std::max(e, -125) - 8;  // 8 significand bits; subnormals below 2^-126
  const double scaled = std::ldexp(a, -quantum_exp);
  double q = std::floor(scaled);
  const double rest = scaled - q;
  if (rest > 0.5 || (rest == 0.5 && std::fmod(q, 2.0) == 1.0)) q += 1;
  const double r = std::ldexp(q, quantum_exp);
  const double max_bf16 = std::ldexp(255.0, 120);  // 0x7f7f
  return std::copysign(r > max_bf16 ? std::numeric_limits<double>::infinity() : r, d);
}

/// Runs fn with the SSE flush-to-zero and denormals-are-zero bits set, as
/// -ffast-math code or torch.set_flush_denormal(True) leave a thread, and checks
/// that the library restored them; returns false where there is no MXCSR.
template <class Fn>
bool with_ftz_daz(Fn fn) {
#if defined(__x86_64__) || defined(__SSE2__)
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040u);
  fn();
  const unsigned after = _mm_getcsr();
  _mm_setcsr(saved);
  EXPECT_EQ(after & ~0x3Fu, (saved | 0x8040u) & ~0x3Fu) << "the caller's mode is restored (exception flags aside)";
  return true;
#else
  (void)fn;
  return false;
#endif
}

// The fp64 reference, the cpu backend and the generator run with IEEE
// subnormals whatever the caller's mode: under FTZ/DAZ an index_score of
// 27 * 2^-149 (3.8e-44, >= eps = exp(-100)) at a valid slot read as 0 and
// masked the slot out (relative RMS 1.0 in a break-it run).
TEST(Outputs, CallersFlushToZeroModeChangesNothing) {
  GenerateSpec s = small_spec(71);
  s.batch = 1, s.s_q = 6, s.s_kv = 40, s.topk = 8, s.heads = 8, s.head_dim = 64;
  s.num_threads = 2;
  GeneratedProblem p = make_problem(s);
  // A subnormal P at row 3's first valid slot, a subnormal weight too.
  const int64_t K = topk(p);
  const int32_t* ids = p.topk_indices.data<int32_t>();
  int64_t slot = -1;
  for (int64_t i = 0; i < K && slot < 0; ++i) slot = ids[3 * K + i] >= 0 ? 3 * K + i : -1;
  ASSERT_GE(slot, 0);
  uint32_t sub = 27;  // 27 * 2^-149
  std::memcpy(&p.index_score.data<float>()[slot], &sub, 4);
  p.weights.data<uint16_t>()[5] = 0x0003;  // a bf16 subnormal
  IndexerOptions opt = p.options();
  opt.num_threads = 2;
  const OutputBuffers want = run_cpu(p, opt);
  const ReferenceGradients ref_want = reference_backward(p.inputs(), opt);
  const double loss_want = indexer_kl_loss(p.inputs(), opt, /*recompute_p=*/false);
  OutputBuffers got;
  ReferenceGradients ref_got;
  double loss_got = 0;
  GeneratedProblem gen_got;
  if (!with_ftz_daz([&] {
        got = run_cpu(p, opt);
        ref_got = reference_backward(p.inputs(), opt);
        loss_got = indexer_kl_loss(p.inputs(), opt, /*recompute_p=*/false);
        gen_got = make_problem(s);
      })) {
    GTEST_SKIP() << "no MXCSR on this target";
  }
  EXPECT_TRUE(bitwise_equal(got.d_index_q, want.d_index_q));
  EXPECT_TRUE(bitwise_equal(got.d_weights, want.d_weights));
  EXPECT_TRUE(bitwise_equal(got.d_index_k, want.d_index_k));
  EXPECT_EQ(ref_got.d_index_q, ref_want.d_index_q);
  EXPECT_EQ(ref_got.d_index_k, ref_want.d_index_k);
  EXPECT_EQ(loss_got, loss_want);
  const GeneratedProblem gen_want = make_problem(s);
  EXPECT_TRUE(bitwise_equal(gen_got.index_score, gen_want.index_score));
  EXPECT_TRUE(bitwise_equal(gen_got.attn_score, gen_want.attn_score));
  // The slot counts: P at 3.8e-44 is >= eps, so row 3's gradients are not zero.
  double row3 = 0;
  const int64_t HD = s.heads * s.head_dim;
  for (int64_t e = 0; e < HD; ++e) row3 += std::abs(want.d_index_q.data<float>()[3 * HD + e]);
  EXPECT_GT(row3, 0.0);
}

// A NaN dot product propagates through relu into the logits and the loss, as
// torch's relu does (docs/math.md, "NaN and infinities"): relu(NaN) = NaN.
TEST(Outputs, LogitsAndLossPropagateANanDotProduct) {
  GenerateSpec s = small_spec(72);
  s.batch = 1, s.s_q = 2, s.s_kv = 3, s.topk = 3, s.heads = 8, s.head_dim = 64;
  GeneratedProblem p = make_problem(s);
  p.index_q.data<uint16_t>()[0] = 0x7f80;                                      // q[row 0, head 0, d 0] = +inf
  for (int64_t j = 0; j < 3; ++j) p.index_k.data<uint16_t>()[j * 64] = 0;      // k[:, 0] = 0: inf * 0 = NaN
  const std::vector<double> z = reference_index_logits(p.inputs(), p.options());
  int valid = 0;
  for (int64_t i = 0; i < 3; ++i) {
    if (p.topk_indices.data<int32_t>()[i] < 0) continue;
    ++valid;
    EXPECT_TRUE(std::isnan(z[i])) << "slot " << i << ": " << z[i];
  }
  ASSERT_GT(valid, 0);
  for (int64_t i = 3; i < 6; ++i) {  // row 1 is untouched
    if (p.topk_indices.data<int32_t>()[i] >= 0) EXPECT_TRUE(std::isfinite(z[i])) << "slot " << i << ": " << z[i];
  }
  refresh_index_score(p);  // P = softmax of those logits: NaN in row 0
  EXPECT_TRUE(std::isnan(indexer_kl_loss(p.inputs(), p.options(), /*recompute_p=*/true)));
  EXPECT_TRUE(std::isnan(indexer_kl_loss(p.inputs(), p.options(), /*recompute_p=*/false)));
  // Valid slots whose logits are all -inf (an infinite query, negative weights):
  // the row is not dropped as if it had no valid slot; its loss is NaN.
  GeneratedProblem m = make_problem(s);
  for (int64_t h = 0; h < 8; ++h) {
    m.index_q.data<uint16_t>()[h * 64] = 0x7f80;  // q[row 0, h, 0] = +inf
    m.weights.data<uint16_t>()[h] = 0xbf80;       // w[row 0, h] = -1
  }
  for (int64_t j = 0; j < 3; ++j) m.index_k.data<uint16_t>()[j * 64] = 0x3f80;  // k[:, 0] = 1
  const std::vector<double> zm = reference_index_logits(m.inputs(), m.options());
  ASSERT_EQ(zm[0], -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(indexer_kl_loss(m.inputs(), m.options(), /*recompute_p=*/true)));
}

// The cpu backend rounds its fp64 results to bf16 once. Rounding through float
// first (float_to_bf16(float(d))) is one ulp off for a double just beyond a bf16
// tie that the float rounding lands on exactly; the test includes such values and
// checks that the old way does get them wrong (so that the test can fail).
TEST(Outputs, Bf16OutputsRoundOnceFromDouble) {
  std::mt19937_64 rng(12345);
  std::uniform_int_distribution<uint32_t> bits16(0, 0xffff);
  int checked = 0, double_rounding_differs = 0;
  for (int n = 0; n < 200000; ++n) {
    const uint16_t b = static_cast<uint16_t>(bits16(rng));
    const double v = detail::bf16_to_float(b);
    if (!std::isfinite(v)) continue;
    const uint16_t b_next = static_cast<uint16_t>(b + 1);
    const double v_next = detail::bf16_to_float(b_next);
    if (!std::isfinite(v_next) || std::signbit(v_next) != std::signbit(v)) continue;
    const double tie = v + (v_next - v) / 2;  // exact in double
    for (const double d : {tie, std::nextafter(tie, 0.0), std::nextafter(tie, 2 * tie), tie + (v_next - v) * 1e-9,
                           tie - (v_next - v) * 1e-9, v, v + (v_next - v) * 0.3}) {
      const double want = bf16_round_reference(d);
      const double got = detail::bf16_to_float(detail::double_to_bf16(d));
      ASSERT_EQ(got, want) << std::hexfloat << "d=" << d;
      HostTensor t(DType::bf16, {1});
      detail::store_element(DType::bf16, t.bytes.data(), 0, d);
      ASSERT_EQ(detail::bf16_to_float(t.data<uint16_t>()[0]), want) << std::hexfloat << "store_element d=" << d;
      if (detail::bf16_to_float(detail::float_to_bf16(static_cast<float>(d))) != want) ++double_rounding_differs;
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000000);
  EXPECT_GT(double_rounding_differs, 0) << "the values near ties should include double-rounding cases";
  // Overflow, infinities, NaN, zeros, the smallest subnormals.
  const double inf = std::numeric_limits<double>::infinity();
  for (const double d : {1e39, -1e39, std::ldexp(255.5, 120), std::ldexp(255.49999, 120), inf, -inf, 0.0, -0.0,
                         std::ldexp(1.0, -133), std::ldexp(1.0, -134), std::ldexp(1.5, -134), std::ldexp(1.0, -140)}) {
    EXPECT_EQ(detail::bf16_to_float(detail::double_to_bf16(d)), bf16_round_reference(d)) << std::hexfloat << d;
    EXPECT_EQ(std::signbit(detail::bf16_to_float(detail::double_to_bf16(d))), std::signbit(d)) << d;
  }
  EXPECT_TRUE(std::isnan(detail::bf16_to_float(detail::double_to_bf16(std::nan("")))));
}

void expect_bitwise(const OutputBuffers& a, const OutputBuffers& b) {
  EXPECT_TRUE(bitwise_equal(a.d_index_q, b.d_index_q)) << "d_index_q";
  EXPECT_TRUE(bitwise_equal(a.d_weights, b.d_weights)) << "d_weights";
  EXPECT_TRUE(bitwise_equal(a.d_index_k, b.d_index_k)) << "d_index_k";
}

GeneratedProblem awkward_problem(uint64_t seed, Layout layout = Layout::bshd) {
  GenerateSpec s = small_spec(seed);
  s.layout = layout;
  s.batch = 2;
  s.s_q = 33;
  s.s_kv = 47;
  s.seqlens_q = {1, 33, 20};
  s.seqlens_k = {5, 47, 20};
  s.heads = 16;
  s.topk = 29;
  return make_problem(s);
}

TEST(Outputs, PrefilledContentsNeverMatter) {
  const GeneratedProblem p = awkward_problem(61);
  for (DType dt : {DType::f32, DType::bf16}) {
    OutputBuffers zero = make_outputs(p, dt, dt, dt);
    indexer_backward(p.inputs(), zero.views(), p.options());
    for (double fillv : {999.0, -1e30, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
      SCOPED_TRACE("prefill " + std::to_string(fillv) + " " + dtype_name(dt));
      OutputBuffers o = make_outputs(p, dt, dt, dt);
      fill(o.d_index_q, fillv);
      fill(o.d_weights, fillv);
      fill(o.d_index_k, fillv);
      indexer_backward(p.inputs(), o.views(), p.options());
      expect_bitwise(zero, o);
    }
  }
}

TEST(Outputs, PoisonedOutputsComeBackFiniteAndRight) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    const GeneratedProblem p = awkward_problem(62, layout);
    const ReferenceGradients ref = reference_backward(p.inputs(), p.options());
    for (DType dq : {DType::f32, DType::bf16}) {
      for (DType dw : {DType::f32, DType::bf16}) {
        for (DType dk : {DType::f32, DType::bf16}) {
          const OutputBuffers o = run_cpu(p, p.options(), dq, dw, dk);  // poisoned with NaN first
          const struct {
            const HostTensor& out;
            const std::vector<double>& want;
            const char* name;
          } checks[] = {{o.d_index_q, ref.d_index_q, "d_index_q"},
                        {o.d_weights, ref.d_weights, "d_weights"},
                        {o.d_index_k, ref.d_index_k, "d_index_k"}};
          for (const auto& c : checks) {
            const ErrorStats st = compare(c.out, c.want);
            const double tol = c.out.dtype == DType::bf16 ? 3e-3 : 1e-6;
            EXPECT_TRUE(st.ok(tol)) << c.name << " " << dtype_name(c.out.dtype) << ": " << st.str();
            EXPECT_GT(st.max_abs_ref, 0.0) << c.name;
          }
        }
      }
    }
  }
}

TEST(Outputs, Bf16OutputsAreTheRoundedFp64Values) {
  const GeneratedProblem p = awkward_problem(63);
  const ReferenceGradients ref = reference_backward(p.inputs(), p.options());
  const OutputBuffers o = run_cpu(p, p.options(), DType::bf16, DType::bf16, DType::bf16);
  const std::vector<double> got = to_doubles(o.d_index_q);
  for (size_t e = 0; e < got.size(); ++e) {
    // Within half a bf16 ulp of the fp64 value (plus the f32 double rounding).
    const double want = ref.d_index_q[e];
    const double ulp = want == 0 ? 0 : std::ldexp(1.0, std::ilogb(want) - 7);
    ASSERT_LE(std::abs(got[e] - want), 0.5 * ulp * (1 + 0x1.0p-15)) << e;
  }
}

/// Every input through non-contiguous strides (gaps hold NaN, or id 0 = a
/// valid key, so a wrong stride shows) must give the contiguous result.
TEST(Outputs, StridedInputsAreReadThroughTheirStrides) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    SCOPED_TRACE(layout_name(layout));
    GeneratedProblem p = awkward_problem(64, layout);
    invalidate_run(p, 3, Where::middle, 4);
    refresh_scores(p);
    const bool thd = layout == Layout::thd;
    const OutputBuffers want = run_cpu(p, p.options());

    auto steps = [&](std::vector<int64_t> bshd, std::vector<int64_t> t) { return thd ? t : bshd; };
    const StridedCopy q = strided_copy(p.index_q, steps({1, 2, 1, 2}, {2, 1, 2}), steps({1, 0, 3, 1}, {1, 0, 1}));
    const StridedCopy w = strided_copy(p.weights, steps({1, 1, 3}, {1, 2}), steps({0, 2, 1}, {3, 0}));
    const StridedCopy k = strided_copy(p.index_k, steps({1, 2, 2}, {3, 2}), steps({1, 1, 0}, {0, 1}));
    const StridedCopy ids = strided_copy(p.topk_indices, steps({1, 1, 2}, {2, 3}), steps({1, 1, 1}, {2, 2}), 0);
    const StridedCopy t = strided_copy(p.attn_score, steps({2, 1, 1}, {1, 2}), steps({0, 0, 5}, {1, 1}));
    const StridedCopy s = strided_copy(p.index_score, steps({1, 3, 1}, {2, 1}), steps({1, 0, 0}, {0, 3}));
    IndexerInputs in = p.inputs();
    in.index_q = q.view;
    in.weights = w.view;
    in.index_k = k.view;
    in.topk_indices = ids.view;
    in.attn_score = t.view;
    in.index_score = s.view;
    StridedCopy cq, ck;
    if (thd) {
      cq = strided_copy(p.cu_seqlens_q, {3}, {0}, 999);
      ck = strided_copy(p.cu_seqlens_k, {2}, {1}, 999);
      in.cu_seqlens_q = cq.view;
      in.cu_seqlens_k = ck.view;
    }
    ASSERT_FALSE(in.index_q.is_contiguous());
    OutputBuffers got = make_outputs(p);
    poison(got);
    IndexerOptions strict = p.options();
    strict.strict_indices = true;  // reads the ids through their strides too
    indexer_backward(in, got.views(), strict);
    expect_bitwise(want, got);
    EXPECT_DOUBLE_EQ(indexer_kl_loss(in, p.options()), indexer_kl_loss(p.inputs(), p.options()));
  }
}

/// Stride 0 (one weight row broadcast over the batch) is a valid input view.
TEST(Outputs, BroadcastInputViaStrideZero) {
  GeneratedProblem p = awkward_problem(65);
  const int64_t per_batch = p.weights.numel() / 2;
  std::memcpy(p.weights.bytes.data() + per_batch * 2, p.weights.bytes.data(), per_batch * 2);  // batch 1 := batch 0
  refresh_index_score(p);
  const OutputBuffers want = run_cpu(p, p.options());
  IndexerInputs in = p.inputs();
  in.weights.strides[0] = 0;
  OutputBuffers got = make_outputs(p);
  indexer_backward(in, got.views(), p.options());
  expect_bitwise(want, got);
}

TEST(Outputs, GradLossDeviceIsReadAndScalesExactly) {
  const GeneratedProblem p = awkward_problem(66);
  IndexerOptions o = p.options();
  o.grad_loss = 1.0f;
  const OutputBuffers one = run_cpu(p, o);
  float device_value = 2.0f;
  o.grad_loss = std::numeric_limits<float>::quiet_NaN();  // ignored when grad_loss_device is set
  o.grad_loss_device = &device_value;
  const OutputBuffers two = run_cpu(p, o);
  const std::vector<double> a = to_doubles(one.d_index_k), b = to_doubles(two.d_index_k);
  for (size_t e = 0; e < a.size(); ++e) ASSERT_EQ(2 * a[e], b[e]) << e;
  device_value = 1.0f;  // a "replay" with a new value
  expect_bitwise(one, run_cpu(p, o));
}

TEST(Outputs, NormalizationCountScalesExactly) {
  const GeneratedProblem p = awkward_problem(67);
  IndexerOptions o = p.options();
  const OutputBuffers def = run_cpu(p, o);
  o.normalization_count = num_q_rows(p);  // the default, spelled out
  expect_bitwise(def, run_cpu(p, o));
  o.normalization_count = 2 * num_q_rows(p);
  const OutputBuffers half = run_cpu(p, o);
  const std::vector<double> a = to_doubles(def.d_weights), b = to_doubles(half.d_weights);
  for (size_t e = 0; e < a.size(); ++e) ASSERT_EQ(a[e] / 2, b[e]) << e;
  // loss_coeff and grad_loss enter as the product: (2, 0.25) == (0.5, 1).
  IndexerOptions x = p.options(), y = p.options();
  x.loss_coeff = 2.0f;
  x.grad_loss = 0.25f;
  y.loss_coeff = 0.5f;
  y.grad_loss = 1.0f;
  expect_bitwise(run_cpu(p, x), run_cpu(p, y));
}

TEST(Outputs, ReplayIsBitwiseIdentical) {
  const GeneratedProblem p = awkward_problem(68, Layout::thd);
  for (int32_t threads : {1, 2, 3}) {
    IndexerOptions o = p.options();
    o.num_threads = threads;
    const OutputBuffers first = run_cpu(p, o, DType::f32, DType::bf16, DType::f32);
    for (int rep = 0; rep < 30; ++rep) expect_bitwise(first, run_cpu(p, o, DType::f32, DType::bf16, DType::f32));
  }
  // d_index_q and d_weights do not depend on the thread count at all; d_index_k
  // only through the order its per-thread fp64 partial sums are added.
  IndexerOptions o1 = p.options(), o7 = p.options();
  o1.num_threads = 1;
  o7.num_threads = 7;
  const OutputBuffers a = run_cpu(p, o1), b = run_cpu(p, o7);
  EXPECT_TRUE(bitwise_equal(a.d_index_q, b.d_index_q));
  EXPECT_TRUE(bitwise_equal(a.d_weights, b.d_weights));
  EXPECT_TRUE(compare(b.d_index_k, to_doubles(a.d_index_k)).ok(1e-7));
}

/// Awkward sizes (topk 1, 100, 129; H 8, 16, 128; D 64, 128) against the
/// sampled reference, an independent code path for dK.
TEST(Outputs, AwkwardSizesAgainstSampledReference) {
  struct Shape {
    int64_t h, d, k, s;
    IdPattern ids;
  };
  int nonzero_repeated = 0;  // repeated key rows' values that are not 0 (over all shapes)
  for (const Shape sh : {Shape{8, 64, 1, 20, IdPattern::causal_topk}, Shape{16, 64, 100, 130, IdPattern::causal_topk},
                         Shape{8, 128, 129, 140, IdPattern::random_permutation},
                         Shape{128, 64, 7, 9, IdPattern::random_permutation}}) {
    SCOPED_TRACE("H" + std::to_string(sh.h) + " D" + std::to_string(sh.d) + " topk" + std::to_string(sh.k));
    GenerateSpec s = small_spec(69);
    s.batch = 2;
    s.s_q = 5;
    s.s_kv = sh.s;
    s.heads = sh.h;
    s.head_dim = sh.d;
    s.topk = sh.k;
    s.ids = sh.ids;
    const GeneratedProblem p = make_problem(s);
    const ReferenceGradients full = reference_backward(p.inputs(), p.options());
    // Rows requested twice (4; 0 and 3) get their gradients at every position.
    std::vector<int64_t> qr = {0, 4, 7, 9, 4}, kr = {0, 3, sh.s - 1, sh.s, 2 * sh.s - 1, 3, 0};
    const SampledReferenceGradients smp = reference_backward_sampled(p.inputs(), p.options(), qr, kr);
    const int64_t H = sh.h, D = sh.d;
    for (size_t n = 0; n < qr.size(); ++n) {
      for (int64_t e = 0; e < H * D; ++e) ASSERT_EQ(smp.d_index_q[n * H * D + e], full.d_index_q[qr[n] * H * D + e]);
      for (int64_t e = 0; e < H; ++e) ASSERT_EQ(smp.d_weights[n * H + e], full.d_weights[qr[n] * H + e]);
    }
    for (size_t n = 0; n < kr.size(); ++n) {
      for (int64_t d = 0; d < D; ++d) {
        ASSERT_NEAR(smp.d_index_k[n * D + d], full.d_index_k[kr[n] * D + d], 1e-13 * (1 + std::abs(full.d_index_k[kr[n] * D + d])));
        if (n >= 5 && smp.d_index_k[n * D + d] != 0) ++nonzero_repeated;
      }
    }
    const OutputBuffers o = run_cpu(p, p.options(), DType::bf16, DType::f32, DType::bf16);
    EXPECT_TRUE(compare(o.d_index_q, full.d_index_q).ok(3e-3));
    EXPECT_TRUE(compare(o.d_weights, full.d_weights).ok(1e-6));
    EXPECT_TRUE(compare(o.d_index_k, full.d_index_k).ok(3e-3));
  }
  EXPECT_GT(nonzero_repeated, 0) << "key rows 0 and 3 are selected in the larger shapes: their repeats are not all 0";
}

}  // namespace
}  // namespace dsaib::test
