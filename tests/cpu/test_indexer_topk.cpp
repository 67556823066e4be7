// indexer_topk() on the cpu backend, its fp64 reference and its checker:
// against the selection written out in tests/support/topk_check.hpp (fp64
// logits, a full sort) on random problems (BSHD/THD, local/global ids, causal
// rows with any causal_offset, starts/ends, both orders, f32/bf16 weights);
// exact ties, all-zero rows, rows seeing fewer keys than topk, empty rows,
// topk 1 and 8192, S_kv 262144, a context-parallel shard's ranges, strict
// ranges, the NaN rule, -0.0 vs +0.0, sequence-first strided index_q, bitwise
// determinism over thread counts; float8 e4m3 inputs with and without their
// scales. The checker: test_topk_checker.cpp; the
// validation rules: test_indexer_topk_validation.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "dsaib/indexer_topk.hpp"
#include "support/test_support.hpp"
#include "support/topk_check.hpp"

namespace dsaib::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// f32 logits against the fp64 definition: relative RMS and max relative error
/// within one f32 rounding; non-finite values must match exactly.
void expect_logits_near(const HostTensor& got, const std::vector<double>& want, const std::string& what) {
  double num = 0, den = 0, max_rel = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.dtype == DType::f32 ? double(got.data<float>()[i]) : got.data<double>()[i];
    if (!std::isfinite(want[i])) {
      EXPECT_TRUE((std::isnan(want[i]) && std::isnan(g)) || g == want[i]) << what << " slot " << i << ": " << g << " vs " << want[i];
      continue;
    }
    ASSERT_TRUE(std::isfinite(g)) << what << " slot " << i << ": " << g;
    num += (g - want[i]) * (g - want[i]);
    den += want[i] * want[i];
    if (want[i] != 0) max_rel = std::max(max_rel, std::fabs(g - want[i]) / std::fabs(want[i]));
    else EXPECT_EQ(g, 0.0) << what << " slot " << i;
  }
  const double rel_rms = den == 0 ? (num == 0 ? 0 : kInf) : std::sqrt(num / den);
  const double tol = got.dtype == DType::f32 ? std::ldexp(1.0, -24) : 0.0;
  EXPECT_LE(rel_rms, tol) << what;
  EXPECT_LE(max_rel, tol) << what;
}

/// Runs the cpu backend and compares it with the written-out selection, the
/// reference with it too, and the checker accepts the output.
void expect_matches_definition(const TopkProblem& p, const IndexerTopkOptions& opt, int64_t topk,
                               const std::string& what, DType logits_dtype = DType::f32) {
  TopkOutputs out(p, topk, logits_dtype);
  indexer_topk(p.inputs(), out.views(), opt);
  const BruteTopk want = brute_force_topk(p, opt, topk);
  for (size_t i = 0; i < want.ids.size(); ++i) ASSERT_EQ(out.ids.data<int32_t>()[i], want.ids[i]) << what << " slot " << i;
  for (size_t r = 0; r < want.lengths.size(); ++r) ASSERT_EQ(out.lengths.data<int32_t>()[r], want.lengths[r]) << what << " row " << r;
  expect_logits_near(out.logits, want.logits, what);

  const ReferenceTopk ref = reference_indexer_topk(p.inputs(), opt, topk);
  EXPECT_EQ(ref.topk_indices, want.ids) << what;
  EXPECT_EQ(ref.topk_lengths, want.lengths) << what;
  for (size_t i = 0; i < want.logits.size(); ++i) {
    if (std::isnan(want.logits[i])) EXPECT_TRUE(std::isnan(ref.topk_logits[i]));
    else EXPECT_EQ(ref.topk_logits[i], want.logits[i]) << what << " slot " << i;  // the same sums in fp64
    if (want.ids[i] == -1) EXPECT_EQ(ref.topk_bounds[i], 0) << what;
    if (std::isfinite(want.logits[i])) EXPECT_GE(ref.topk_bounds[i], std::fabs(want.logits[i]) * std::ldexp(1.0, -21)) << what;
  }
  const TopkCheck check = check_indexer_topk(p.inputs(), opt, out.views());
  EXPECT_TRUE(check.pass) << what << ": " << check.first_failure;
  EXPECT_EQ(check.exchanged_ids, 0) << what;
  EXPECT_LE(check.max_logit_error, 1.0) << what;
  EXPECT_EQ(check.rows, p.rows);
}

struct DefinitionCase {
  std::string name;
  TopkSpec spec;
};

std::vector<DefinitionCase> definition_cases() {
  std::vector<DefinitionCase> c;
  TopkSpec s;
  c.push_back({"bshd_causal_auto", s});
  s.seed = 2, s.id_mode = IdMode::global, s.order = TopkOrder::id_ascending;
  c.push_back({"bshd_global_id_ascending", s});
  s = TopkSpec{}, s.seed = 3, s.causal_offset = 0, s.topk = 7;
  c.push_back({"bshd_causal_offset_0_fewer_keys", s});
  s = TopkSpec{}, s.seed = 4, s.causal_offset = -3;
  c.push_back({"bshd_causal_offset_negative", s});
  s = TopkSpec{}, s.seed = 5, s.causal_offset = std::numeric_limits<int64_t>::max();
  c.push_back({"bshd_causal_offset_max_sees_all", s});
  s = TopkSpec{}, s.seed = 6, s.causal_offset = std::numeric_limits<int64_t>::min() + 1;
  c.push_back({"bshd_causal_offset_min_sees_none", s});
  s = TopkSpec{}, s.seed = 7, s.ranges = true, s.weights_f32 = false;
  c.push_back({"bshd_ranges_bf16_weights", s});
  s = TopkSpec{}, s.seed = 8, s.topk = 20;  // more than every row sees
  c.push_back({"bshd_topk_above_keys", s});
  s = thd_spec(TopkSpec{}), s.seed = 9;
  c.push_back({"thd_causal_auto", s});
  s = thd_spec(TopkSpec{}), s.seed = 10, s.id_mode = IdMode::global, s.ranges = true;
  c.push_back({"thd_global_ranges", s});
  s = thd_spec(TopkSpec{}), s.seed = 11, s.order = TopkOrder::id_ascending, s.causal_offset = 2, s.topk = 3;
  c.push_back({"thd_id_ascending_offset", s});
  s = thd_spec(TopkSpec{}), s.seed = 12, s.heads = 16, s.head_dim = 64, s.topk = 5, s.ranges = true;
  c.push_back({"thd_h16_d64_ranges", s});
  // float8 e4m3 inputs with their per-token (and per-head) scales, or without one or both
  s = TopkSpec{}, s.seed = 13, s.e4m3 = true, s.heads = 8, s.head_dim = 32;
  c.push_back({"bshd_e4m3_scaled", s});
  s = TopkSpec{}, s.seed = 14, s.e4m3 = true, s.q_scale = false, s.ranges = true, s.weights_f32 = false;
  c.push_back({"bshd_e4m3_k_scale_only_ranges", s});
  s = thd_spec(TopkSpec{}), s.seed = 15, s.e4m3 = true, s.q_scale = false, s.k_scale = false,
  s.id_mode = IdMode::global;
  c.push_back({"thd_e4m3_unscaled_global", s});
  s = thd_spec(TopkSpec{}), s.seed = 16, s.e4m3 = true, s.negative_scales = true, s.order = TopkOrder::id_ascending;
  c.push_back({"thd_e4m3_negative_scales", s});
  return c;
}

void PrintTo(const DefinitionCase& c, std::ostream* os) { *os << c.name; }

class TopkAgainstDefinition : public ::testing::TestWithParam<DefinitionCase> {};

TEST_P(TopkAgainstDefinition, CpuBackendReferenceAndChecker) {
  const TopkProblem p = make_topk_problem(GetParam().spec);
  const Snapshot q(p.index_q), w(p.weights), k(p.index_k), st(p.starts), en(p.ends), cq(p.cu_q), ck(p.cu_k);
  expect_matches_definition(p, p.options(), p.spec.topk, GetParam().name);
  // f64 logits: unrounded.
  expect_matches_definition(p, p.options(), p.spec.topk, GetParam().name + " f64", DType::f64);
  // Without the optional outputs.
  TopkOutputs out(p, p.spec.topk);
  indexer_topk(p.inputs(), {out.ids.view(), {}, {}}, p.options());
  const BruteTopk want = brute_force_topk(p, p.options(), p.spec.topk);
  for (size_t i = 0; i < want.ids.size(); ++i) ASSERT_EQ(out.ids.data<int32_t>()[i], want.ids[i]);
  const TopkCheck check = check_indexer_topk(p.inputs(), p.options(), {out.ids.view(), {}, {}});
  EXPECT_TRUE(check.pass) << check.first_failure;
  EXPECT_TRUE(q.unchanged() && w.unchanged() && k.unchanged() && st.unchanged() && en.unchanged() && cq.unchanged() &&
              ck.unchanged())
      << "an input written";
}

INSTANTIATE_TEST_SUITE_P(Problems, TopkAgainstDefinition, ::testing::ValuesIn(definition_cases()),
                         [](const auto& info) { return info.param.name; });

// Every key of a row the same: ties go to the smaller ids, in both orders.
TEST(IndexerTopk, ExactTiesGoToSmallerIds) {
  TopkSpec s;
  s.batch = 1, s.s_q = 3, s.s_kv = 12, s.topk = 5, s.causal_offset = 100;
  TopkProblem p = make_topk_problem(s);
  for (int64_t j = 1; j < 12; ++j) {
    for (int64_t d = 0; d < s.head_dim; ++d) p.k_bits()[j * s.head_dim + d] = p.k_bits()[d];
  }
  for (TopkOrder order : {TopkOrder::logit_descending, TopkOrder::id_ascending}) {
    IndexerTopkOptions opt = p.options();
    opt.order = order;
    TopkOutputs out(p, 5);
    indexer_topk(p.inputs(), out.views(), opt);
    for (int64_t r = 0; r < 3; ++r) {
      for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(out.ids.data<int32_t>()[r * 5 + i], i) << "row " << r;
    }
    expect_matches_definition(p, opt, 5, "ties");
  }
}

// Every dot product negative: every logit 0 (products -0.0 where a weight is
// negative, +0.0 elsewhere, all equal), so the smallest ids win.
TEST(IndexerTopk, AllReluZeroRowsTakeTheSmallestIds) {
  TopkSpec s;
  s.batch = 2, s.s_q = 4, s.s_kv = 9, s.topk = 4, s.causal_offset = 100;
  TopkProblem p = make_topk_problem(s);
  for (int64_t e = 0; e < p.index_q.numel(); ++e) p.q_bits()[e] = detail::float_to_bf16(0.5f + 0.01f * float(e % 7));
  for (int64_t e = 0; e < p.index_k.numel(); ++e) p.k_bits()[e] = detail::float_to_bf16(-0.25f - 0.01f * float(e % 5));
  TopkOutputs out(p, 4);
  indexer_topk(p.inputs(), out.views(), p.options());
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t i = 0; i < 4; ++i) {
      EXPECT_EQ(out.ids.data<int32_t>()[r * 4 + i], i);
      const float l = out.logits.data<float>()[r * 4 + i];
      EXPECT_EQ(l, 0.0f);
      EXPECT_FALSE(std::signbit(l)) << "a -0.0 logit written";
    }
  }
  expect_matches_definition(p, p.options(), 4, "relu zero");
}

// Causal rows seeing fewer keys than topk: -1 and -inf past the count.
TEST(IndexerTopk, FewerKeysThanTopkArePadded) {
  TopkSpec s;
  s.batch = 1, s.s_q = 6, s.s_kv = 6, s.topk = 4;
  const TopkProblem p = make_topk_problem(s);
  TopkOutputs out(p, 4);
  indexer_topk(p.inputs(), out.views(), p.options());
  for (int64_t t = 0; t < 6; ++t) {
    const int64_t count = std::min<int64_t>(t + 1, 4);
    EXPECT_EQ(out.lengths.data<int32_t>()[t], count);
    for (int64_t i = count; i < 4; ++i) {
      EXPECT_EQ(out.ids.data<int32_t>()[t * 4 + i], -1);
      EXPECT_EQ(out.logits.data<float>()[t * 4 + i], -INFINITY);
    }
  }
}

// Empty rows: start >= end, a range outside the sequence, a sequence without keys.
TEST(IndexerTopk, EmptyRows) {
  TopkSpec s = thd_spec(TopkSpec{});
  s.ranges = true;
  TopkProblem p = make_topk_problem(s);
  int32_t* st = p.starts.data<int32_t>();
  int32_t* en = p.ends.data<int32_t>();
  st[0] = 5, en[0] = 5;      // empty
  st[1] = 7, en[1] = 3;      // start > end: empty
  st[2] = 50, en[2] = 60;    // past the sequence: clipped to nothing
  TopkOutputs out(p, s.topk);
  indexer_topk(p.inputs(), out.views(), p.options());
  for (int64_t r : {0, 1, 2, 9, 10}) {  // rows 9, 10: the sequence without keys
    EXPECT_EQ(out.lengths.data<int32_t>()[r], 0) << r;
    for (int64_t i = 0; i < s.topk; ++i) EXPECT_EQ(out.ids.data<int32_t>()[r * s.topk + i], -1);
  }
  expect_matches_definition(p, p.options(), s.topk, "empty rows");
}

// BSHD without query rows holds no bytes whatever B is: the call needs no host
// memory that grows with B.
TEST(IndexerTopk, EmptyProblemOfHugeBatchNeedsNoMemoryPerBatch) {
  if (kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (const bool ranges : {false, true}) {
    TopkSpec s;
    s.batch = 1, s.s_q = 0, s.s_kv = 0, s.topk = 2, s.ranges = ranges;
    const TopkProblem p = make_topk_problem(s);
    TopkOutputs o(p, s.topk);
    IndexerTopkInputs in = p.inputs();
    IndexerTopkOutputs out = o.views();
    set_batch({&in.index_q, &in.weights, &in.index_k, &in.starts, &in.ends, &out.topk_indices, &out.topk_logits,
               &out.topk_lengths},
              (int64_t{1} << 31) - 1);
    EXPECT_EXIT(exit_with_call_status_under_address_limit(size_t{64} << 20,
                                                          [&] { indexer_topk(in, out, p.options()); }),
                ::testing::ExitedWithCode(0), "")
        << (ranges ? "starts/ends" : "causal");
  }
}

// A zero-element input holds nothing to read: any strides, as DLPack gives a
// numpy array without keys (all 0), and as is_contiguous() takes it.
TEST(IndexerTopk, ZeroElementInputsTakeAnyStrides) {
  for (const bool e4m3 : {false, true}) {
    TopkSpec s;
    s.batch = 2, s.s_q = 3, s.s_kv = 0, s.topk = 2, s.e4m3 = e4m3;
    const TopkProblem p = make_topk_problem(s);
    IndexerTopkInputs in = p.inputs();
    for (int i = 0; i < 3; ++i) in.index_k.strides[i] = 0;
    if (e4m3) in.index_k_scale.strides[0] = in.index_k_scale.strides[1] = 0;
    TopkOutputs out(p, 2);
    ASSERT_NO_THROW(indexer_topk(in, out.views(), p.options())) << e4m3;
    for (int64_t e = 0; e < out.ids.numel(); ++e) EXPECT_EQ(out.ids.data<int32_t>()[e], -1);
    for (int64_t r = 0; r < out.lengths.numel(); ++r) EXPECT_EQ(out.lengths.data<int32_t>()[r], 0);
  }
}

TEST(IndexerTopk, TopkOneAndTopk8192) {
  TopkSpec s;
  s.batch = 1, s.s_q = 3, s.s_kv = 9000, s.heads = 2, s.head_dim = 4, s.causal_offset = 8997;
  const TopkProblem p = make_topk_problem(s);
  expect_matches_definition(p, p.options(), 1, "topk 1");
  expect_matches_definition(p, p.options(), 8192, "topk 8192");
  IndexerTopkOptions opt = p.options();
  opt.order = TopkOrder::id_ascending;
  expect_matches_definition(p, opt, 8192, "topk 8192 id_ascending");
}

// S_kv 262144: the partial selection keeps this to about a second.
TEST(IndexerTopk, LongRows) {
  TopkSpec s;
  s.batch = 1, s.s_q = 2, s.s_kv = 262144, s.heads = 1, s.head_dim = 4, s.causal_offset = 262142;
  const TopkProblem p = make_topk_problem(s);
  expect_matches_definition(p, p.options(), 2048, "S_kv 262144");
}

// A context-parallel shard: the rows of the second half of a sequence against
// all its keys, as starts/ends, as an explicit causal_offset and as the default.
TEST(IndexerTopk, ContextParallelShardRanges) {
  TopkSpec s;
  s.batch = 2, s.s_q = 8, s.s_kv = 16, s.topk = 5;
  TopkProblem p = make_topk_problem(s);
  TopkOutputs auto_out(p, 5);
  indexer_topk(p.inputs(), auto_out.views(), p.options());
  IndexerTopkOptions explicit_opt = p.options();
  explicit_opt.causal_offset = 8;
  TopkOutputs explicit_out(p, 5);
  indexer_topk(p.inputs(), explicit_out.views(), explicit_opt);
  p.starts = HostTensor(DType::i32, {2, 8});
  p.ends = HostTensor(DType::i32, {2, 8});
  for (int64_t r = 0; r < 16; ++r) p.starts.data<int32_t>()[r] = 0, p.ends.data<int32_t>()[r] = int32_t(8 + r % 8 + 1);
  TopkOutputs range_out(p, 5);
  indexer_topk(p.inputs(), range_out.views(), p.options());
  EXPECT_TRUE(bitwise_equal(auto_out.ids, range_out.ids));
  EXPECT_TRUE(bitwise_equal(explicit_out.ids, range_out.ids));
  EXPECT_TRUE(bitwise_equal(auto_out.logits, range_out.logits));
  EXPECT_TRUE(bitwise_equal(auto_out.lengths, range_out.lengths));
  expect_matches_definition(p, p.options(), 5, "cp shard");
}

// Ranges reaching outside the sequence: clipped by default, an error with strict_ranges.
TEST(IndexerTopk, ClippingAndStrictRanges) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    TopkSpec s = layout == Layout::thd ? thd_spec(TopkSpec{}) : TopkSpec{};
    s.ranges = true;
    TopkProblem p = make_topk_problem(s);
    const int64_t base = layout == Layout::thd ? p.k_start[2] : 0;  // row 3 is in sequence 2 (THD) / 0 (BSHD)
    const int64_t b = layout == Layout::thd ? 2 : 0, t = layout == Layout::thd ? 0 : 3, n = p.k_len[b];
    for (int64_t r = 0; r < p.rows; ++r) {  // every range valid ...
      const int64_t rb = p.seq_of(r), rbase = layout == Layout::thd ? p.k_start[rb] : 0;
      p.starts.data<int32_t>()[r] = int32_t(rbase);
      p.ends.data<int32_t>()[r] = int32_t(rbase + p.k_len[rb]);
    }
    IndexerTopkOptions strict = p.options();
    strict.strict_ranges = true;
    {
      TopkOutputs out(p, s.topk);
      EXPECT_NO_THROW(indexer_topk(p.inputs(), out.views(), strict));
    }
    struct Bad {
      int64_t start, end;
      const char* arg;
    };
    for (const Bad& bad : {Bad{-1, 3, "starts"}, Bad{2, n + 1, "ends"}, Bad{4, 3, "ends"}, Bad{n + 1, n + 2, "starts"}}) {
      p.starts.data<int32_t>()[3] = int32_t(base + bad.start);  // ... but row 3's
      p.ends.data<int32_t>()[3] = int32_t(base + bad.end);
      TopkOutputs out(p, s.topk);
      const Snapshot ids(out.ids), logits(out.logits), lengths(out.lengths);
      try {
        indexer_topk(p.inputs(), out.views(), strict);
        ADD_FAILURE() << "strict_ranges accepted " << bad.start << ", " << bad.end;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::index_out_of_range) << e.what();
        EXPECT_EQ(e.argument(), bad.arg) << e.what();
        const std::string want = "(b=" + std::to_string(b) + ", t=" + std::to_string(t) + "): expected " +
                                 std::to_string(base) + " <= start <= end <= " + std::to_string(base + n) +
                                 (layout == Layout::thd ? " (flat rows of index_k)" : " (key positions)") + ", got start " +
                                 std::to_string(base + bad.start) + ", end " + std::to_string(base + bad.end);
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
      EXPECT_TRUE(ids.unchanged() && logits.unchanged() && lengths.unchanged());
      // Clipped without strict_ranges.
      expect_matches_definition(p, p.options(), s.topk, "clipped");
    }
  }
}

// A NaN logit ranks above +inf, NaNs among themselves by id; the logits carry it.
TEST(IndexerTopk, NanRanksAboveInfinity) {
  TopkSpec s;
  s.batch = 1, s.s_q = 2, s.s_kv = 10, s.heads = 1, s.topk = 4, s.causal_offset = 100;
  TopkProblem p = make_topk_problem(s);
  const int64_t D = s.head_dim;
  for (int64_t e = 0; e < p.index_q.numel(); ++e) p.q_bits()[e] = detail::float_to_bf16(0.5f);
  p.weights.data<float>()[0] = 1.0f;
  p.weights.data<float>()[1] = 1.0f;
  p.k_bits()[7 * D + 2] = detail::float_to_bf16(NAN);       // key 7: NaN logit
  p.k_bits()[5 * D + 1] = detail::float_to_bf16(INFINITY);  // key 5: +inf logit
  p.k_bits()[8 * D + 0] = detail::float_to_bf16(NAN);       // key 8: NaN logit
  TopkOutputs out(p, 4);
  indexer_topk(p.inputs(), out.views(), p.options());
  for (int64_t r = 0; r < 2; ++r) {
    EXPECT_EQ(out.ids.data<int32_t>()[r * 4 + 0], 7);
    EXPECT_EQ(out.ids.data<int32_t>()[r * 4 + 1], 8);
    EXPECT_EQ(out.ids.data<int32_t>()[r * 4 + 2], 5);
    EXPECT_TRUE(std::isnan(out.logits.data<float>()[r * 4 + 0]));
    EXPECT_EQ(out.logits.data<float>()[r * 4 + 2], INFINITY);
  }
  expect_matches_definition(p, p.options(), 4, "nan");
  // A NaN weight makes every logit of its row NaN: the smallest ids.
  p.weights.data<float>()[1] = NAN;
  TopkOutputs all_nan(p, 4);
  indexer_topk(p.inputs(), all_nan.views(), p.options());
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(all_nan.ids.data<int32_t>()[4 + i], i);
  expect_matches_definition(p, p.options(), 4, "nan weight");
  // The checker never accepts a NaN key left out for a finite one.
  std::swap(all_nan.ids.data<int32_t>()[0], all_nan.ids.data<int32_t>()[2]);  // row 0: 5 first, then 8, 7
  all_nan.ids.data<int32_t>()[0] = 0;  // row 0: key 0 (finite) instead of key 5 (+inf)
  const TopkCheck check = check_indexer_topk(p.inputs(), p.options(), {all_nan.ids.view(), {}, {}});
  EXPECT_FALSE(check.pass);
}

// -0.0 ranks as +0.0: in the checker's reading of a candidate's logits, equal
// zeros of either sign go by id.
TEST(IndexerTopk, NegativeZeroRanksAsPositiveZero) {
  TopkSpec s;
  s.batch = 1, s.s_q = 1, s.s_kv = 6, s.heads = 1, s.topk = 2, s.causal_offset = 100;
  TopkProblem p = make_topk_problem(s);
  for (int64_t e = 0; e < p.index_q.numel(); ++e) p.q_bits()[e] = detail::float_to_bf16(1.0f);
  for (int64_t e = 0; e < p.index_k.numel(); ++e) p.k_bits()[e] = detail::float_to_bf16(-1.0f);  // every logit 0
  p.weights.data<float>()[0] = -2.0f;  // w * ReLU = -0.0 in every product
  TopkOutputs out(p, 2);
  indexer_topk(p.inputs(), out.views(), p.options());
  EXPECT_EQ(out.ids.data<int32_t>()[0], 0);
  EXPECT_EQ(out.ids.data<int32_t>()[1], 1);
  auto check = [&](float l0, float l1, int32_t i0, int32_t i1) {
    out.logits.data<float>()[0] = l0, out.logits.data<float>()[1] = l1;
    out.ids.data<int32_t>()[0] = i0, out.ids.data<int32_t>()[1] = i1;
    return check_indexer_topk(p.inputs(), p.options(), out.views()).pass;
  };
  EXPECT_TRUE(check(-0.0f, 0.0f, 0, 1));
  EXPECT_TRUE(check(0.0f, -0.0f, 0, 1));
  EXPECT_FALSE(check(0.0f, -0.0f, 1, 0));  // equal: by id
  EXPECT_FALSE(check(-0.0f, 0.0f, 1, 0));
  EXPECT_TRUE(check(0.0f, 0.0f, 0, 2));  // bounds above 0 (the products are not 0): a near-tie
  // Keys of zeros: logits and bounds exactly 0, so the tie goes by id only.
  for (int64_t e = 0; e < p.index_k.numel(); ++e) p.k_bits()[e] = detail::float_to_bf16(e % 2 ? 0.0f : -0.0f);
  EXPECT_TRUE(check(-0.0f, 0.0f, 0, 1));
  EXPECT_FALSE(check(0.0f, 0.0f, 0, 2));
  EXPECT_FALSE(check(0.0f, 0.0f, 1, 0));
}

// Megatron's sequence-first [S, B, H, D] index_q viewed as (B, S, H, D), and
// a padded index_k: the same bits as the contiguous tensors.
TEST(IndexerTopk, SequenceFirstStridedIndexQ) {
  TopkSpec s;
  s.batch = 3, s.s_q = 5, s.s_kv = 11, s.topk = 4;
  const TopkProblem p = make_topk_problem(s);
  const int64_t B = 3, S = 5, H = s.heads, D = s.head_dim;
  HostTensor sbhd(DType::bf16, {S, B, H, D});
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < S; ++t) {
      std::memcpy(sbhd.data<uint16_t>() + (t * B + b) * H * D, p.index_q.data<uint16_t>() + (b * S + t) * H * D, H * D * 2);
    }
  }
  HostTensor k_padded(DType::bf16, {B, s.s_kv, D + 8});
  for (int64_t j = 0; j < B * s.s_kv; ++j) {
    std::memcpy(k_padded.data<uint16_t>() + j * (D + 8), p.index_k.data<uint16_t>() + j * D, D * 2);
  }
  IndexerTopkInputs in = p.inputs();
  in.index_q = sbhd.view();
  in.index_q.shape[0] = B, in.index_q.shape[1] = S;
  in.index_q.strides[0] = H * D, in.index_q.strides[1] = B * H * D;
  in.index_k = k_padded.view();
  in.index_k.shape[2] = D;
  in.index_k.strides[0] = s.s_kv * (D + 8), in.index_k.strides[1] = D + 8;
  TopkOutputs strided(p, 4), dense(p, 4);
  indexer_topk(in, strided.views(), p.options());
  indexer_topk(p.inputs(), dense.views(), p.options());
  EXPECT_TRUE(bitwise_equal(strided.ids, dense.ids));
  EXPECT_TRUE(bitwise_equal(strided.logits, dense.logits));
  EXPECT_TRUE(bitwise_equal(strided.lengths, dense.lengths));
  EXPECT_TRUE(check_indexer_topk(in, p.options(), strided.views()).pass);
}

TEST(IndexerTopk, BitwiseDeterministicOverThreadCounts) {
  TopkSpec s = thd_spec(TopkSpec{});
  s.q_lens = {40, 0, 70, 9};
  s.k_lens = {90, 5, 120, 30};
  s.topk = 16;
  s.ranges = true;
  const TopkProblem p = make_topk_problem(s);
  IndexerTopkOptions opt = p.options();
  opt.num_threads = 1;
  TopkOutputs one(p, 16);
  indexer_topk(p.inputs(), one.views(), opt);
  for (int32_t threads : {2, 3, 7, 0}) {
    opt.num_threads = threads;
    TopkOutputs many(p, 16);
    indexer_topk(p.inputs(), many.views(), opt);
    EXPECT_TRUE(bitwise_equal(one.ids, many.ids)) << threads;
    EXPECT_TRUE(bitwise_equal(one.logits, many.logits)) << threads;
    EXPECT_TRUE(bitwise_equal(one.lengths, many.lengths)) << threads;
    const ReferenceTopk a = reference_indexer_topk(p.inputs(), opt, 16);
    opt.num_threads = 1;
    const ReferenceTopk b = reference_indexer_topk(p.inputs(), opt, 16);
    EXPECT_EQ(a.topk_indices, b.topk_indices);
    EXPECT_EQ(0, std::memcmp(a.topk_logits.data(), b.topk_logits.data(), a.topk_logits.size() * 8));
  }
}

TEST(IndexerTopk, WorkspaceAndWeightsDtypes) {
  TopkSpec s;
  const TopkProblem p = make_topk_problem(s);
  TopkOutputs out(p, s.topk);
  EXPECT_EQ(indexer_topk_workspace_size(p.inputs(), out.views(), p.options()), 0u);
  // f64 weights on the cpu backend: read as they are.
  HostTensor w64(DType::f64, p.weights.shape);
  for (int64_t e = 0; e < w64.numel(); ++e) w64.data<double>()[e] = p.weights.data<float>()[e];
  IndexerTopkInputs in = p.inputs();
  in.weights = w64.view();
  TopkOutputs out64(p, s.topk);
  indexer_topk(in, out64.views(), p.options());
  indexer_topk(p.inputs(), out.views(), p.options());
  EXPECT_TRUE(bitwise_equal(out.ids, out64.ids));
  EXPECT_TRUE(bitwise_equal(out.logits, out64.logits));
}

TEST(IndexerTopk, OrderWords) {
  EXPECT_STREQ(topk_order_name(TopkOrder::logit_descending), "logit_descending");
  EXPECT_STREQ(topk_order_name(TopkOrder::id_ascending), "id_ascending");
  TopkOrder o = TopkOrder::logit_descending;
  EXPECT_TRUE(parse_topk_order("id_ascending", &o));
  EXPECT_EQ(o, TopkOrder::id_ascending);
  EXPECT_FALSE(parse_topk_order("ascending", &o));
  EXPECT_EQ(o, TopkOrder::id_ascending);
}

}  // namespace
}  // namespace dsaib::test
