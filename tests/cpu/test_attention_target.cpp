// The attention target on the cpu backend and its fp64 reference: against the
// definition written out in tests/support/attention_target_check.hpp on fresh
// random problems (BSHD/THD, local/global ids, -1 and out-of-range slots, rows
// without a valid slot, lse in natural log and base 2, normalised or not, Hq
// 1/16/128, Dqk 192/576); the cpu backend as the reference rounded once to f32;
// every validation rule naming its argument, with nothing written on error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "dsaib/attention_target.hpp"
#include "support/attention_target_check.hpp"
#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

TargetSpec bshd_spec(int64_t h, int64_t d, int64_t topk, IdMode mode, LseBase base, uint64_t seed) {
  TargetSpec s;
  s.layout = Layout::bshd;
  s.id_mode = mode;
  s.lse_base = base;
  s.heads = h;
  s.head_dim = d;
  s.topk = topk;
  s.batch = 2;
  s.s_q = 4;
  s.s_kv = 11;
  s.seed = seed;
  return s;
}

TargetSpec thd_spec(int64_t h, int64_t d, int64_t topk, IdMode mode, LseBase base, uint64_t seed) {
  TargetSpec s = bshd_spec(h, d, topk, mode, base, seed);
  s.layout = Layout::thd;
  s.q_lens = {3, 0, 4, 2};
  s.k_lens = {9, 5, 13, 0};  // the last sequence has no key: its rows have no valid slot
  return s;
}

/// Relative difference ||a - b|| / ||b|| (0/0 = 0).
double rel_rms(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? (num == 0 ? 0 : INFINITY) : std::sqrt(num / den);
}

/// Sets row r's ids to -1 (a row with no valid slot).
void clear_row(TargetProblem& p, int64_t r) {
  for (int64_t i = 0; i < p.topk; ++i) p.ids()[r * p.topk + i] = -1;
}

struct TargetCase {
  std::string name;
  TargetSpec spec;
};

std::vector<TargetCase> cases() {
  const IdMode L = IdMode::local, G = IdMode::global;
  const LseBase e = LseBase::natural, two = LseBase::base2;
  return {
      {"bshd_h1_d192_local_natural", bshd_spec(1, 192, 8, L, e, 1)},
      {"bshd_h16_d192_global_base2", bshd_spec(16, 192, 12, G, two, 2)},
      {"bshd_h16_d576_local_base2", bshd_spec(16, 576, 8, L, two, 3)},
      {"bshd_h128_d576_global_natural", bshd_spec(128, 576, 6, G, e, 4)},
      {"thd_h1_d576_global_base2", thd_spec(1, 576, 8, G, two, 5)},
      {"thd_h16_d192_local_natural", thd_spec(16, 192, 16, L, e, 6)},
      {"thd_h128_d192_local_base2", thd_spec(128, 192, 5, L, two, 7)},
      {"thd_h128_d576_global_natural", thd_spec(128, 576, 4, G, e, 8)},
      {"bshd_topk_past_skv", bshd_spec(16, 192, 20, L, e, 9)},  // more slots than keys: duplicates
  };
}

void PrintTo(const TargetCase& c, std::ostream* os) { *os << c.name; }

class TargetAgainstDefinition : public ::testing::TestWithParam<TargetCase> {};

TEST_P(TargetAgainstDefinition, ReferenceAndCpuBackend) {
  TargetProblem p = make_target_problem(GetParam().spec);
  clear_row(p, 1);  // a row with no valid slot, its lse NaN: never read
  for (int64_t h = 0; h < p.heads; ++h) p.lse.data<float>()[1 * p.heads + h] = NAN;
  for (bool normalize : {true, false}) {
    SCOPED_TRACE(normalize ? "normalize" : "unnormalised");
    const std::vector<double> want = naive_attention_target(p, normalize);
    const AttentionTargetOptions opt = p.options(normalize);
    const ReferenceAttentionTarget ref = reference_attention_target(p.inputs(), opt);
    ASSERT_EQ(ref.num_q_rows, p.num_q_rows());
    ASSERT_EQ(ref.topk, p.topk);
    ASSERT_EQ(ref.attn_score.size(), want.size());
    EXPECT_LE(rel_rms(ref.attn_score, want), 1e-13);
    int64_t valid = 0;
    double row_sum = 0;
    for (size_t e = 0; e < want.size(); ++e) {
      ASSERT_TRUE(std::isfinite(ref.attn_score[e])) << "element " << e;
      EXPECT_NEAR(ref.attn_score[e], want[e], 1e-12 * std::max(1.0, std::fabs(want[e]))) << "element " << e;
      valid += want[e] != 0;
    }
    EXPECT_GT(valid, 0);  // the case has valid slots
    for (int64_t i = 0; i < p.topk; ++i) {
      EXPECT_EQ(ref.attn_score[1 * p.topk + i], 0.0);  // the cleared row
      row_sum += ref.attn_score[0 * p.topk + i];
    }
    if (normalize) EXPECT_NEAR(row_sum, 1.0, 1e-12);  // row 0 has a valid slot in every case

    // The cpu backend: the reference rounded once to f32, every element written.
    HostTensor out = p.make_output();
    poison(out);
    AttentionTargetOptions cpu = opt;
    cpu.backend = Backend::cpu;
    attention_target(p.inputs(), {out.view()}, cpu);
    const float* got = out.data<float>();
    for (size_t e = 0; e < want.size(); ++e) {
      ASSERT_EQ(got[e], static_cast<float>(ref.attn_score[e])) << "element " << e;
    }
    EXPECT_EQ(attention_target_workspace_size(p.inputs(), {out.view()}, cpu), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, TargetAgainstDefinition, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// Without an lse: each head's lse over the row's valid selected slots, against
// the definition written out in the test; the unnormalised U of a row with a
// valid slot sums to Hq (each head's softmax over the slots sums to 1); the
// cpu backend is the reference rounded once to f32; lse_base is not used.
TEST_P(TargetAgainstDefinition, WithoutLse) {
  TargetProblem p = make_target_problem(GetParam().spec);
  clear_row(p, 1);
  AttentionTargetInputs in = p.inputs();
  in.lse = TensorView{};
  for (bool normalize : {true, false}) {
    SCOPED_TRACE(normalize ? "normalize" : "unnormalised");
    const std::vector<double> want = naive_selected_attention_target(p, normalize);
    const AttentionTargetOptions opt = p.options(normalize);
    const ReferenceAttentionTarget ref = reference_attention_target(in, opt);
    ASSERT_EQ(ref.attn_score.size(), want.size());
    EXPECT_LE(rel_rms(ref.attn_score, want), 1e-13);
    for (size_t e = 0; e < want.size(); ++e) {
      ASSERT_TRUE(std::isfinite(ref.attn_score[e])) << "element " << e;
      EXPECT_NEAR(ref.attn_score[e], want[e], 1e-12 * std::max(1.0, std::fabs(want[e]))) << "element " << e;
    }
    for (int64_t r = 0; r < p.num_q_rows(); ++r) {
      double sum = 0;
      bool any = false;
      for (int64_t i = 0; i < p.topk; ++i) {
        sum += ref.attn_score[r * p.topk + i];
        any = any || want[r * p.topk + i] != 0;
      }
      if (r == 1) EXPECT_FALSE(any);  // the cleared row: zeros
      if (any) EXPECT_NEAR(sum, normalize ? 1.0 : static_cast<double>(p.heads), 1e-11 * p.heads) << "row " << r;
    }

    HostTensor out = p.make_output();
    poison(out);
    AttentionTargetOptions cpu = opt;
    cpu.backend = Backend::cpu;
    attention_target(in, {out.view()}, cpu);
    for (size_t e = 0; e < want.size(); ++e) {
      ASSERT_EQ(out.data<float>()[e], static_cast<float>(ref.attn_score[e])) << "element " << e;
    }
    HostTensor other = p.make_output();
    cpu.lse_base = cpu.lse_base == LseBase::natural ? LseBase::base2 : LseBase::natural;
    attention_target(in, {other.view()}, cpu);
    EXPECT_TRUE(bitwise_equal(out, other)) << "lse_base changed the target without an lse";
    EXPECT_EQ(attention_target_workspace_size(in, {out.view()}, cpu), 0u);
  }
}

// The selected-key lse written into the lse input gives the target without an
// lse (up to the f32 rounding of lse), and the dense lse of the problem does
// not (the test would pass for a target that ignored the selection otherwise).
TEST(AttentionTarget, WithoutLseEqualsSelectedLse) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    const TargetSpec s = layout == Layout::bshd ? bshd_spec(16, 192, 8, IdMode::local, LseBase::natural, 23)
                                                : thd_spec(16, 192, 8, IdMode::global, LseBase::natural, 23);
    TargetProblem p = make_target_problem(s);
    AttentionTargetInputs none = p.inputs();
    none.lse = TensorView{};
    const ReferenceAttentionTarget dense = reference_attention_target(p.inputs(), p.options(false));
    const ReferenceAttentionTarget sel = reference_attention_target(none, p.options(false));
    // lse[r, h] = log sum_{valid i} exp(sm_scale * q[r, h] . kv[j_i]), written
    // here from the definition (NaN in a row without a valid slot: never read).
    const int64_t H = p.heads, D = p.head_dim, K = p.topk;
    for (int64_t b = 0; b < p.batch(); ++b) {
      const int64_t k0 = p.k_start(b), kl = p.k_lens[b];
      for (int64_t t = 0; t < p.q_lens[b]; ++t) {
        const int64_t r = p.q_start(b) + t;
        for (int64_t h = 0; h < H; ++h) {
          double mx = -INFINITY;
          std::vector<double> x;
          for (int64_t i = 0; i < K; ++i) {
            const int64_t id = p.ids()[r * K + i];
            const int64_t j = p.id_mode == IdMode::local ? (id >= 0 && id < kl ? k0 + id : -1)
                                                         : (id >= k0 && id < k0 + kl ? id : -1);
            if (j < 0) continue;
            double dot = 0;
            for (int64_t d = 0; d < D; ++d) {
              dot += static_cast<double>(target_bf16_to_float(p.query.data<uint16_t>()[(r * H + h) * D + d])) *
                     target_bf16_to_float(p.kv.data<uint16_t>()[j * D + d]);
            }
            x.push_back(p.sm_scale * dot);
            mx = std::max(mx, x.back());
          }
          double e = 0;
          for (double v : x) e += std::exp(v - mx);
          p.lse.data<float>()[r * H + h] = x.empty() ? NAN : static_cast<float>(mx + std::log(e));
        }
      }
    }
    const ReferenceAttentionTarget given = reference_attention_target(p.inputs(), p.options(false));
    EXPECT_LE(rel_rms(sel.attn_score, given.attn_score), 1e-6) << layout_name(layout);
    EXPECT_GT(rel_rms(sel.attn_score, dense.attn_score), 1e-3) << "the dense and selected lse agree: proves nothing";
  }
}

// Logits far beyond exp's range (sm_scale 60: |logit| in the thousands): the
// max shift keeps every U finite, equal to the definition's.
TEST(AttentionTarget, WithoutLseLargeLogits) {
  TargetProblem p = make_target_problem(thd_spec(16, 192, 12, IdMode::local, LseBase::natural, 29));
  p.sm_scale = 60.0f;
  AttentionTargetInputs in = p.inputs();
  in.lse = TensorView{};
  for (bool normalize : {true, false}) {
    const std::vector<double> want = naive_selected_attention_target(p, normalize);
    HostTensor out = p.make_output();
    poison(out);
    attention_target(in, {out.view()}, p.options(normalize));
    EXPECT_TRUE(compare(out, want).ok(1e-6)) << compare(out, want).str();
    double mass = 0;
    for (int64_t e = 0; e < out.numel(); ++e) {
      ASSERT_TRUE(std::isfinite(out.data<float>()[e])) << "element " << e;
      mass += out.data<float>()[e];
    }
    EXPECT_GT(mass, 0.5);
  }
}

// Without an lse, a NaN in a valid slot's query reaches its row's output, and
// only its row's; the lse_base option is not checked beyond its enum.
TEST(AttentionTarget, WithoutLseNaN) {
  TargetProblem p = make_target_problem(bshd_spec(16, 192, 8, IdMode::local, LseBase::natural, 37));
  AttentionTargetInputs in = p.inputs();
  in.lse = TensorView{};
  p.query.data<uint16_t>()[(2 * p.heads + 5) * p.head_dim + 7] = 0x7fc0;  // row 2, head 5: NaN
  HostTensor out = p.make_output();
  attention_target(in, {out.view()}, p.options(true));
  bool nan2 = false;
  for (int64_t i = 0; i < p.topk; ++i) {
    nan2 = nan2 || std::isnan(out.data<float>()[2 * p.topk + i]);
    EXPECT_FALSE(std::isnan(out.data<float>()[0 * p.topk + i])) << "slot " << i;
  }
  EXPECT_TRUE(nan2);
}

// The same target from the lse in natural log and in base 2: base 2 takes
// lse / ln 2 and scales the logits by log2(e).
TEST(AttentionTarget, Base2MatchesNatural) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    TargetSpec s = layout == Layout::bshd ? bshd_spec(16, 192, 8, IdMode::local, LseBase::natural, 21)
                                          : thd_spec(16, 192, 8, IdMode::local, LseBase::natural, 21);
    const TargetProblem natural = make_target_problem(s);
    s.lse_base = LseBase::base2;
    const TargetProblem base2 = make_target_problem(s);
    for (bool normalize : {true, false}) {
      const ReferenceAttentionTarget a = reference_attention_target(natural.inputs(), natural.options(normalize));
      const ReferenceAttentionTarget b = reference_attention_target(base2.inputs(), base2.options(normalize));
      // Only the f32 roundings of lse and lse / ln 2 differ.
      EXPECT_LE(rel_rms(b.attn_score, a.attn_score), 1e-6) << layout_name(layout);
      EXPECT_GT(rel_rms(b.attn_score, a.attn_score), 0.0) << "the two lse tensors are the same; the test proves nothing";
    }
  }
}

// Unnormalised targets summed over a split of the heads, then normalised,
// equal the target of all heads (the tensor-parallel pattern).
TEST(AttentionTarget, HeadSplitSumThenNormalize) {
  const TargetProblem p = make_target_problem(bshd_spec(32, 192, 10, IdMode::local, LseBase::natural, 31));
  const ReferenceAttentionTarget whole = reference_attention_target(p.inputs(), p.options(true));
  std::vector<double> u(whole.attn_score.size(), 0.0);
  for (int part = 0; part < 2; ++part) {
    // Heads [16 part, 16 part + 16): query copied (it must be contiguous), lse
    // as a strided view of the full tensor.
    AttentionTargetInputs in = p.inputs();
    in.lse.shape[2] = 16;
    in.lse.data = const_cast<float*>(p.lse.data<float>()) + part * 16;
    HostTensor q(DType::bf16, {2, 4, 16, p.head_dim});
    for (int64_t r = 0; r < 8; ++r) {
      std::memcpy(q.data<uint16_t>() + r * 16 * p.head_dim,
                  p.query.data<uint16_t>() + (r * 32 + part * 16) * p.head_dim, 16 * p.head_dim * 2);
    }
    in.query = q.view();
    const ReferenceAttentionTarget half = reference_attention_target(in, p.options(false));
    for (size_t e = 0; e < u.size(); ++e) u[e] += half.attn_score[e];
  }
  for (int64_t r = 0; r < 8; ++r) {
    double sum = 0;
    for (int64_t i = 0; i < 10; ++i) sum += u[r * 10 + i];
    for (int64_t i = 0; i < 10; ++i) u[r * 10 + i] = sum > 0 ? u[r * 10 + i] / sum : 0;
  }
  EXPECT_LE(rel_rms(u, whole.attn_score), 1e-13);
}

// lse may have any strides: a transposed view of a (B, Hq, S_q) tensor gives
// the same target as the contiguous one.
TEST(AttentionTarget, LseAnyStrides) {
  const TargetProblem p = make_target_problem(bshd_spec(16, 192, 8, IdMode::local, LseBase::natural, 41));
  const int64_t B = 2, S = 4, H = 16;
  HostTensor bhs(DType::f32, {B, H, S});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < S; ++t)
      for (int64_t h = 0; h < H; ++h) bhs.data<float>()[(b * H + h) * S + t] = p.lse.data<float>()[(b * S + t) * H + h];
  AttentionTargetInputs in = p.inputs();
  in.lse.data = bhs.data<float>();
  in.lse.strides[0] = H * S;
  in.lse.strides[1] = 1;
  in.lse.strides[2] = S;
  HostTensor a = p.make_output(), b = p.make_output();
  attention_target(p.inputs(), {a.view()}, p.options());
  attention_target(in, {b.view()}, p.options());
  EXPECT_TRUE(bitwise_equal(a, b));
}

// Every thread count gives the same bytes; a row whose sum is 0 gives 0; NaN
// in a valid slot's lse reaches the output.
TEST(AttentionTarget, ThreadsZeroSumAndNaN) {
  TargetProblem p = make_target_problem(thd_spec(16, 192, 8, IdMode::global, LseBase::natural, 51));
  HostTensor one = p.make_output(), many = p.make_output();
  AttentionTargetOptions opt = p.options();
  opt.num_threads = 1;
  attention_target(p.inputs(), {one.view()}, opt);
  opt.num_threads = 5;
  attention_target(p.inputs(), {many.view()}, opt);
  EXPECT_TRUE(bitwise_equal(one, many));

  // Row 0: an lse so large that every term underflows (its sum is 0); row 2:
  // one head's lse NaN. Both rows have valid slots.
  const int64_t K = p.topk;
  const std::vector<double> before = naive_attention_target(p, true);
  double mass0 = 0, mass2 = 0;
  for (int64_t i = 0; i < K; ++i) mass0 += before[i], mass2 += before[2 * K + i];
  ASSERT_GT(mass0, 0.5);
  ASSERT_GT(mass2, 0.5);
  for (int64_t h = 0; h < p.heads; ++h) p.lse.data<float>()[h] = 1e30f;
  p.lse.data<float>()[2 * p.heads + 3] = NAN;
  HostTensor out = p.make_output();
  poison(out);
  attention_target(p.inputs(), {out.view()}, p.options(true));
  bool nan_seen = false;
  for (int64_t i = 0; i < K; ++i) {
    EXPECT_EQ(out.data<float>()[i], 0.0f) << "slot " << i;
    nan_seen = nan_seen || std::isnan(out.data<float>()[2 * K + i]);
  }
  EXPECT_TRUE(nan_seen);
}

TEST(AttentionTarget, EmptyProblem) {
  TargetSpec s = bshd_spec(16, 192, 8, IdMode::local, LseBase::natural, 61);
  s.s_q = 0;
  const TargetProblem p = make_target_problem(s);
  HostTensor out = p.make_output();
  EXPECT_NO_THROW(attention_target(p.inputs(), {out.view()}, p.options()));
  EXPECT_TRUE(reference_attention_target(p.inputs(), p.options()).attn_score.empty());
}

// BSHD without query rows holds no bytes whatever B is: the call needs no host
// memory that grows with B.
TEST(AttentionTarget, EmptyProblemOfHugeBatchNeedsNoMemoryPerBatch) {
  if (kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  TargetSpec s = bshd_spec(16, 192, 8, IdMode::local, LseBase::natural, 62);
  s.batch = 1, s.s_q = 0, s.s_kv = 0;
  const TargetProblem p = make_target_problem(s);
  HostTensor out = p.make_output();
  AttentionTargetInputs in = p.inputs();
  AttentionTargetOutputs o{out.view()};
  set_batch({&in.query, &in.kv, &in.topk_indices, &in.lse, &o.attn_score}, (int64_t{1} << 31) - 1);
  EXPECT_EXIT(exit_with_call_status_under_address_limit(size_t{64} << 20,
                                                        [&] { attention_target(in, o, p.options()); }),
              ::testing::ExitedWithCode(0), "");
}

TEST(AttentionTarget, LseBaseNames) {
  EXPECT_STREQ(lse_base_name(LseBase::natural), "natural");
  EXPECT_STREQ(lse_base_name(LseBase::base2), "base2");
  LseBase b = LseBase::natural;
  EXPECT_TRUE(parse_lse_base("base2", &b));
  EXPECT_EQ(b, LseBase::base2);
  EXPECT_TRUE(parse_lse_base("natural", &b));
  EXPECT_EQ(b, LseBase::natural);
  EXPECT_FALSE(parse_lse_base("e", &b));
  EXPECT_FALSE(parse_lse_base("2", &b));
  EXPECT_EQ(b, LseBase::natural);  // unchanged
}

// ------------------------------------------------------------ validation ---

struct Call {
  AttentionTargetInputs in;
  AttentionTargetOutputs out;
  AttentionTargetOptions opt;
};

struct ErrorCase {
  std::string name;
  Layout layout;
  std::function<void(Call&)> mutate;
  const char* argument;
  const char* message_part;  // a piece of the message ("" = none)
  ErrorCode code = ErrorCode::invalid_argument;
};

// Buffers the mutations point into (static: the cases outlive any one test).
HostTensor& spare_i32() {
  static HostTensor t(DType::i32, {64});
  return t;
}

std::vector<ErrorCase> error_cases() {
  const Layout S = Layout::bshd, T = Layout::thd;
  return {
      {"layout", S, [](Call& c) { c.opt.layout = static_cast<Layout>(7); }, "layout", "expected bshd or thd, got 7"},
      {"id_mode", S, [](Call& c) { c.opt.id_mode = static_cast<IdMode>(5); }, "id_mode", "local or global"},
      {"backend", S, [](Call& c) { c.opt.backend = static_cast<Backend>(3); }, "backend", "cpu or cuda"},
      {"lse_base", S, [](Call& c) { c.opt.lse_base = static_cast<LseBase>(4); }, "lse_base",
       "expected 0 (natural) or 1 (base2), got 4"},
      {"query_absent", S, [](Call& c) { c.in.query = {}; }, "query", "expected a tensor, got nothing (absent)"},
      {"query_dtype", S, [](Call& c) { c.in.query.dtype = DType::f32; }, "query", "expected dtype bf16, got dtype f32"},
      {"query_rank", S, [](Call& c) { c.in.query.rank = 3; }, "query", "expected rank 4"},
      {"query_rank_thd", T, [](Call& c) { c.in.query.rank = 2; }, "query", "expected rank 3"},
      {"kv_dtype", S, [](Call& c) { c.in.kv.dtype = DType::f32; }, "kv", "dtype bf16"},
      {"kv_absent", T, [](Call& c) { c.in.kv = {}; }, "kv", "expected a tensor"},
      {"lse_dtype", S, [](Call& c) { c.in.lse.dtype = DType::bf16; }, "lse", "expected dtype f32 or f64, got dtype bf16"},
      {"lse_rank", T, [](Call& c) { c.in.lse.rank = 3; }, "lse", "expected rank 2"},
      {"ids_dtype", S, [](Call& c) { c.in.topk_indices.dtype = DType::f32; }, "topk_indices", "dtype i32"},
      {"attn_score_absent", S, [](Call& c) { c.out.attn_score = {}; }, "attn_score", "expected a tensor"},
      {"attn_score_dtype", S, [](Call& c) { c.out.attn_score.dtype = DType::bf16; }, "attn_score", "dtype f32"},
      {"attn_score_misaligned", S,
       [](Call& c) { c.out.attn_score.data = static_cast<char*>(c.out.attn_score.data) + 2; }, "attn_score",
       "aligned to its element size"},
      {"query_negative_stride", S, [](Call& c) { c.in.query.strides[1] = -1; }, "query", "non-negative strides"},
      {"query_device", S, [](Call& c) { c.in.query.device = DeviceType::cuda; }, "query", "device 'cpu'"},
      {"cu_seqlens_q_for_bshd", S, [](Call& c) { c.in.cu_seqlens_q = spare_i32().view(); }, "cu_seqlens_q",
       "absent for layout bshd"},
      {"cu_seqlens_k_absent", T, [](Call& c) { c.in.cu_seqlens_k = {}; }, "cu_seqlens_k", "expected a tensor"},
      {"heads_zero", S, [](Call& c) { c.in.query.shape[2] = 0; }, "query", "Hq (heads, dim 2) >= 1, got Hq = 0"},
      {"heads_zero_thd", T, [](Call& c) { c.in.query.shape[1] = 0; }, "query", "Hq (heads, dim 1) >= 1"},
      {"dim_zero", S, [](Call& c) { c.in.query.shape[3] = 0; }, "query", "Dqk (last dim) >= 1, got Dqk = 0"},
      {"topk_zero", S, [](Call& c) { c.in.topk_indices.shape[2] = 0; }, "topk_indices", "topk (last dim) >= 1"},
      {"kv_dim", S, [](Call& c) { c.in.kv.shape[2] = 64; }, "kv", "(B, S_kv, Dqk) with B and Dqk of query"},
      {"kv_batch", S, [](Call& c) { c.in.kv.shape[0] = 1; }, "kv", "expected shape (2, 11, 192)"},
      {"kv_dim_thd", T, [](Call& c) { c.in.kv.shape[1] = 64; }, "kv", "(T_k, Dqk)"},
      {"lse_heads", S, [](Call& c) { c.in.lse.shape[2] = 8; }, "lse", "(B, S_q, Hq), got shape (2, 4, 8)"},
      {"lse_rows_thd", T, [](Call& c) { c.in.lse.shape[0] = 2; }, "lse", "(T_q, Hq)"},
      {"ids_rows", S, [](Call& c) { c.in.topk_indices.shape[1] = 3; }, "topk_indices", "(B, S_q, topk)"},
      {"attn_score_topk", S, [](Call& c) { c.out.attn_score.shape[2] = 7; }, "attn_score",
       "(B, S_q, topk), topk from topk_indices"},
      {"attn_score_rows_thd", T, [](Call& c) { c.out.attn_score.shape[0] = 3; }, "attn_score", "(T_q, topk)"},
      {"query_not_contiguous", S,
       [](Call& c) {
         c.in.query.shape[1] = 2;  // every other row of a (2, 4, ...) query, seen as (2, 2, ...)
         c.in.query.strides[1] *= 2;
         c.in.lse.shape[1] = 2;
         c.in.topk_indices.shape[1] = 2;
         c.out.attn_score.shape[1] = 2;
         c.in.topk_indices.strides[0] /= 2;
         c.out.attn_score.strides[0] /= 2;
       },
       "query", "expected a contiguous (row-major) tensor"},
      {"kv_not_contiguous", S, [](Call& c) { c.in.kv.shape[1] = 5, c.in.kv.strides[1] = 2 * 192; }, "kv",
       "contiguous"},
      {"ids_not_contiguous", T, [](Call& c) { c.in.topk_indices.shape[1] = 4, c.in.topk_indices.strides[1] = 2;
                                              c.out.attn_score.shape[1] = 4; },
       "topk_indices", "contiguous"},
      {"attn_score_not_contiguous", S, [](Call& c) { c.out.attn_score.strides[0] = 0; }, "attn_score",
       "contiguous (row-major)"},
      {"attn_score_overlaps_lse", S,
       [](Call& c) {
         c.out.attn_score.data = c.in.lse.data;  // lse (2, 4, 16) f32 holds 128 floats, attn_score 64
       },
       "attn_score", "memory disjoint from input lse"},
      {"attn_score_overlaps_query", S, [](Call& c) { c.out.attn_score.data = c.in.query.data; }, "attn_score",
       "disjoint from input query"},
      {"attn_score_overlaps_cu_seqlens", T, [](Call& c) { c.in.cu_seqlens_k.data = c.out.attn_score.data; },
       "attn_score", "disjoint from input cu_seqlens_k"},
      {"sm_scale", S, [](Call& c) { c.opt.sm_scale = std::numeric_limits<float>::infinity(); }, "sm_scale",
       "expected a finite value, got inf"},
      {"sm_scale_nan", T, [](Call& c) { c.opt.sm_scale = NAN; }, "sm_scale", "finite"},
      {"num_threads", S, [](Call& c) { c.opt.num_threads = -1; }, "num_threads", ">= 0"},
      {"cu_seqlens_q_length", T, [](Call& c) { c.in.cu_seqlens_q.shape[0] = 0; c.in.cu_seqlens_k.shape[0] = 0; },
       "cu_seqlens_q", "length B + 1 >= 1"},
      {"cu_seqlens_k_length", T, [](Call& c) { c.in.cu_seqlens_k.shape[0] = 4; }, "cu_seqlens_k",
       "length B + 1 = 5 (that of cu_seqlens_q), got length 4"},
      {"cu_seqlens_q_start", T,
       [](Call& c) {
         spare_i32().data<int32_t>()[0] = 1;
         for (int i = 1; i < 5; ++i) spare_i32().data<int32_t>()[i] = 9;
         c.in.cu_seqlens_q.data = spare_i32().data<int32_t>();
       },
       "cu_seqlens_q", "starting at 0, got first value 1"},
      {"cu_seqlens_k_decreasing", T,
       [](Call& c) {
         const int32_t v[] = {0, 9, 5, 27, 27};
         for (int i = 0; i < 5; ++i) spare_i32().data<int32_t>()[i] = v[i];
         c.in.cu_seqlens_k.data = spare_i32().data<int32_t>();
       },
       "cu_seqlens_k", "non-decreasing values, got value 5 at position 2 after 9"},
      {"cu_seqlens_q_total", T,
       [](Call& c) {
         const int32_t v[] = {0, 3, 3, 7, 8};
         for (int i = 0; i < 5; ++i) spare_i32().data<int32_t>()[i] = v[i];
         c.in.cu_seqlens_q.data = spare_i32().data<int32_t>();
       },
       "cu_seqlens_q", "last value equal to T_q (query dim 0) = 9, got 8"},
      {"cu_seqlens_k_total", T,
       [](Call& c) {
         const int32_t v[] = {0, 9, 14, 27, 28};
         for (int i = 0; i < 5; ++i) spare_i32().data<int32_t>()[i] = v[i];
         c.in.cu_seqlens_k.data = spare_i32().data<int32_t>();
       },
       "cu_seqlens_k", "last value equal to T_k (kv dim 0) = 27, got 28"},
      {"strict_out_of_range", S,
       [](Call& c) {
         c.opt.strict_indices = true;
         static_cast<int32_t*>(c.in.topk_indices.data)[8 + 3] = 11;  // row (b=0, t=1), slot 3; S_kv = 11
       },
       "topk_indices", "strict mode found an out-of-range id at (b=0, t=1, slot=3): expected -1 or an id in [0, 11)",
       ErrorCode::index_out_of_range},
      {"strict_out_of_range_thd_global", T,
       [](Call& c) {
         c.opt.strict_indices = true;
         c.opt.id_mode = IdMode::global;
         static_cast<int32_t*>(c.in.topk_indices.data)[0] = 0;  // row (b=0, t=0): ids in [0, 9)
         static_cast<int32_t*>(c.in.topk_indices.data)[3 * 8 + 2] = 3;  // row (b=2, t=0) has ids in [14, 27)
       },
       "topk_indices", "(b=2, t=0, slot=2): expected -1 or an id in [14, 27) (global ids), got id 3",
       ErrorCode::index_out_of_range},
  };
}

void PrintTo(const ErrorCase& c, std::ostream* os) { *os << c.name; }

class TargetValidation : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(TargetValidation, NamesTheArgumentAndWritesNothing) {
  const ErrorCase& ec = GetParam();
  TargetProblem p = make_target_problem(ec.layout == Layout::bshd
                                            ? bshd_spec(16, 192, 8, IdMode::local, LseBase::natural, 71)
                                            : thd_spec(16, 192, 8, IdMode::local, LseBase::natural, 71));
  // Every id -1, so that strict mode finds only the id a case puts in.
  for (int64_t e = 0; e < p.topk_indices.numel(); ++e) p.ids()[e] = -1;
  HostTensor out = p.make_output();
  poison(out);
  Call c{p.inputs(), {out.view()}, p.options()};
  ec.mutate(c);
  const Snapshot out_bytes(out), q(p.query), kv(p.kv), lse(p.lse), ids(p.topk_indices);
  bool thrown = false;
  try {
    attention_target(c.in, c.out, c.opt);
  } catch (const Error& e) {
    thrown = true;
    EXPECT_EQ(e.code(), ec.code) << e.what();
    EXPECT_EQ(e.argument(), ec.argument) << e.what();
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(std::string(ec.argument) + ":", 0), 0u) << msg;
    EXPECT_NE(msg.find(ec.message_part), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
    EXPECT_NE(msg.find("got"), std::string::npos) << msg;
  }
  EXPECT_TRUE(thrown);
  EXPECT_TRUE(out_bytes.unchanged()) << "attn_score written before the error";
  EXPECT_TRUE(q.unchanged() && kv.unchanged() && lse.unchanged() && ids.unchanged());
  // The workspace query raises the same error.
  try {
    attention_target_workspace_size(c.in, c.out, c.opt);
    ADD_FAILURE() << "attention_target_workspace_size accepted it";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), ec.argument) << e.what();
  }
  // The reference raises the input and option errors (it has no output).
  if (std::string(ec.argument) != "attn_score" && ec.name != "backend") {  // it runs on the host whatever the backend
    try {
      reference_attention_target(c.in, c.opt);
      ADD_FAILURE() << "reference_attention_target accepted it";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), ec.argument) << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Rules, TargetValidation, ::testing::ValuesIn(error_cases()),
                         [](const auto& info) { return info.param.name; });

// Strict mode accepts -1 and in-range ids; reference ignores options.backend.
TEST(AttentionTarget, StrictAcceptsValidIds) {
  TargetProblem p = make_target_problem(thd_spec(16, 192, 8, IdMode::global, LseBase::natural, 81));
  for (int64_t e = 0; e < p.topk_indices.numel(); ++e) {
    // remove the out-of-range ids the generator put in
    const int64_t r = e / p.topk;
    int64_t b = 0;
    while (r >= p.q_start(b + 1)) ++b;
    const int32_t id = p.ids()[e];
    if (id >= 0 && (id < p.k_start(b) || id >= p.k_start(b) + p.k_lens[b])) p.ids()[e] = -1;
  }
  AttentionTargetOptions opt = p.options();
  opt.strict_indices = true;
  HostTensor out = p.make_output();
  EXPECT_NO_THROW(attention_target(p.inputs(), {out.view()}, opt));
  opt.backend = Backend::cuda;
  EXPECT_NO_THROW(reference_attention_target(p.inputs(), opt));
}

// cuda without a usable device is refused before the tensors; with one, the
// cuda limits (Hq a multiple of 16 up to 128, Dqk a multiple of 64 up to 576)
// are checked before any memory is read (views marked cuda over host memory).
TEST(AttentionTarget, CudaAvailabilityAndLimits) {
  const TargetProblem p = make_target_problem(bshd_spec(16, 192, 8, IdMode::local, LseBase::natural, 91));
  HostTensor out = p.make_output();
  AttentionTargetOptions opt = p.options();
  opt.backend = Backend::cuda;
  if (!cuda_backend_available()) {
    try {
      attention_target(p.inputs(), {out.view()}, opt);
      ADD_FAILURE() << "cuda accepted without a device";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::backend_unavailable) << e.what();
      EXPECT_EQ(e.argument(), "backend");
    }
    GTEST_SKIP() << "no cuda device: the cuda limits are not reachable";
  }
  struct Limit {
    int64_t heads, dim;
    const char* part;
  };
  for (const Limit& l : {Limit{8, 192, "Hq (heads, dim 2) a multiple of 16 in [16, 128] on the cuda backend, got Hq = 8"},
                         Limit{144, 192, "got Hq = 144"}, Limit{16, 96, "Dqk (last dim) a multiple of 64 in [64, 576] on the cuda backend, got Dqk = 96"},
                         Limit{16, 640, "got Dqk = 640"}}) {
    AttentionTargetInputs in = p.inputs();
    AttentionTargetOutputs o{out.view()};
    for (TensorView* v : {&in.query, &in.kv, &in.lse, &in.topk_indices, &o.attn_score}) v->device = DeviceType::cuda;
    in.query = contiguous_view(in.query.data, DType::bf16, {2, 4, l.heads, l.dim}, DeviceType::cuda);
    in.kv = contiguous_view(in.kv.data, DType::bf16, {2, 11, l.dim}, DeviceType::cuda);
    try {
      attention_target(in, o, opt);
      ADD_FAILURE() << "accepted " << l.heads << " x " << l.dim;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "query") << e.what();
      EXPECT_NE(std::string(e.what()).find(l.part), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace dsaib::test
