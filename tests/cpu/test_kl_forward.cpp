// The indexer KL forward on the cpu backend and its fp64 reference: against an
// fp64 computation written from the definition (tests/support/kl_forward_check.hpp)
// on fresh random problems, BSHD/THD, local/global ids, invalid and
// out-of-range slots, rows without a valid slot; the loss of
// dsaib::indexer_kl_loss; validation before any write; the C ABI.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "dsaib/dsaib.h"
#include "support/kl_forward_check.hpp"

namespace dsaib::test {
namespace {

struct FwdCase {
  std::string name;
  GenerateSpec spec;
  void (*mutate)(GeneratedProblem&) = nullptr;
};

void invalid_slots(GeneratedProblem& p) {
  add_invalid_slots(p);
  set_out_of_range(p, 1, topk(p) - 1, 5);  // and an id past the sequence at the row's end
}

std::vector<FwdCase> cases() {
  const IdPattern perm = IdPattern::random_permutation, causal = IdPattern::causal_topk;
  return {
      {"bshd_h8_d64_local", small_ragged_spec(Layout::bshd, 8, 64, 16, IdMode::local, perm, 11)},
      {"bshd_h64_d128_global_invalid", small_ragged_spec(Layout::bshd, 64, 128, 24, IdMode::global, perm, 12), invalid_slots},
      {"bshd_h128_d128_causal", small_ragged_spec(Layout::bshd, 128, 128, 32, IdMode::local, causal, 13)},
      {"bshd_topk1", small_ragged_spec(Layout::bshd, 16, 64, 1, IdMode::local, perm, 14)},
      {"bshd_topk_past_skv", small_ragged_spec(Layout::bshd, 24, 64, 48, IdMode::local, perm, 15)},
      {"thd_h40_d64_local_invalid", small_ragged_spec(Layout::thd, 40, 64, 20, IdMode::local, perm, 16), invalid_slots},
      {"thd_h120_d128_global", small_ragged_spec(Layout::thd, 120, 128, 12, IdMode::global, causal, 17)},
  };
}

TEST(KlForward, ReferenceMatchesTheDefinitionInFp64) {
  for (const FwdCase& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    if (c.mutate) c.mutate(p);
    IndexerOptions opt = p.options();
    opt.loss_coeff = 0.7f;
    const Fp64Forward want = fp64_forward(p, opt);
    const ReferenceKLForward got = reference_kl_forward(forward_inputs(p), opt);
    EXPECT_LE(rel_error(got.loss, want.loss), 1e-12) << c.name << " loss " << got.loss << " vs " << want.loss;
    EXPECT_LE(max_error(got.row_lse, want.lse, false), 1e-12) << c.name << " row_lse";
    EXPECT_LE(max_error(got.row_target_mass, want.mass, false), 1e-12) << c.name << " row_target_mass";
    EXPECT_LE(max_error(got.index_score, want.p, true, 1e-300), 1e-11) << c.name << " index_score";
    if (c.spec.topk > 1) EXPECT_NE(want.loss, 0.0) << c.name;  // topk 1: P = 1, a zero loss
  }
}

TEST(KlForward, CpuBackendWritesTheReferenceInF32) {
  for (const FwdCase& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    if (c.mutate) c.mutate(p);
    IndexerOptions opt = p.options();
    opt.normalization_count = 5;
    const Fp64Forward want = fp64_forward(p, opt);
    ForwardBuffers b = make_forward_buffers(p);
    indexer_kl_forward(forward_inputs(p), b.views(), opt);
    const double loss = to_doubles(b.loss)[0];
    const std::vector<double> lse = to_doubles(b.row_lse), mass = to_doubles(b.row_target_mass),
                              pr = to_doubles(b.index_score);
    EXPECT_LE(rel_error(loss, want.loss), 1e-7) << c.name;
    EXPECT_LE(max_error(lse, want.lse, false), 1e-6) << c.name;
    // The mass divided by the sum of exp(z - LSE) with the LSE as written (f32).
    EXPECT_LE(max_error(mass, target_mass_for_lse(want, lse), true, 1e-30), 1e-7) << c.name;
    EXPECT_LE(max_error(pr, want.p, true, 1e-30), 1e-7) << c.name;
    EXPECT_LE(max_abs_error_below(pr, want.p, 1e-30), 1e-37) << c.name;
  }
}

/// Logits with a large common part (give_logits_a_common_part): z ~ 4700, so
/// the f32 row_lse is off by up to 2.4e-4 (half its ulp), the same for every
/// slot of the row.
GeneratedProblem large_lse_problem(Layout layout, uint64_t seed) {
  GeneratedProblem p = make_problem(small_ragged_spec(layout, 64, 128, 24, IdMode::local, IdPattern::random_permutation, seed));
  give_logits_a_common_part(p, /*q_common=*/16, /*sm_scale_log2=*/-4, seed);
  return p;
}

TEST(KlForward, TargetMassIsDividedByTheSumOfPRebuiltFromTheF32Lse) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    GeneratedProblem p = large_lse_problem(layout, 71);
    invalid_slots(p);
    const IndexerOptions opt = p.options();
    const Fp64Forward want = fp64_forward(p, opt);
    ForwardBuffers b = make_forward_buffers(p);
    indexer_kl_forward(forward_inputs(p), b.views(), opt);
    const std::vector<double> lse = to_doubles(b.row_lse), mass = to_doubles(b.row_target_mass),
                              pr = to_doubles(b.index_score);
    double lse_min = std::numeric_limits<double>::infinity(), rounding = 0;
    for (size_t r = 0; r < lse.size(); ++r) {
      if (!std::isfinite(want.lse[r])) continue;
      lse_min = std::min(lse_min, want.lse[r]);
      EXPECT_EQ(lse[r], static_cast<double>(static_cast<float>(want.lse[r]))) << r;  // the f32 rounding of the LSE
      rounding = std::max(rounding, std::abs(lse[r] - want.lse[r]));
    }
    ASSERT_GT(lse_min, 4000.0);
    ASSERT_GT(rounding, 2e-5);  // the case at hand: the written LSE is off by far more than 1e-7 of a P's worth
    // row_target_mass by its definition (to its f32 rounding); the plain mass
    // sum T~ m differs from it by exp(row_lse - LSE) - 1, up to ~2.4e-4.
    EXPECT_LE(max_error(mass, target_mass_for_lse(want, lse), true, 1e-30), 1e-7);
    EXPECT_GT(max_error(mass, want.mass, true, 1e-30), 1e-5);
    // P and the loss carry no LSE rounding: f32 rounding alone.
    EXPECT_LE(max_error(pr, want.p, true, 1e-30), 1e-7);
    EXPECT_LE(rel_error(to_doubles(b.loss)[0], want.loss), 1e-7);
    // The fp64 reference: the LSE unrounded, the sum of exp(z - LSE) 1 to its fp64 rounding.
    const ReferenceKLForward ref = reference_kl_forward(forward_inputs(p), opt);
    EXPECT_LE(max_error(ref.row_target_mass, want.mass, true, 1e-30), 1e-12);  // |LSE| 2^-53 ~ 5e-13
    EXPECT_LE(max_error(ref.row_lse, want.lse, false), 1e-9);
  }
}

TEST(KlForward, RowsWithoutValidSlotGiveMinusInfinityAndNoTerm) {
  GeneratedProblem p = make_problem(small_ragged_spec(Layout::bshd, 8, 64, 8, IdMode::local, IdPattern::random_permutation, 21));
  IndexerOptions opt = p.options();
  const double full = reference_kl_forward(forward_inputs(p), opt).loss;
  invalidate_row(p, 4);
  ForwardBuffers b = make_forward_buffers(p);
  indexer_kl_forward(forward_inputs(p), b.views(), opt);
  const std::vector<double> lse = to_doubles(b.row_lse), mass = to_doubles(b.row_target_mass), pr = to_doubles(b.index_score);
  EXPECT_EQ(lse[4], -std::numeric_limits<double>::infinity());
  EXPECT_EQ(mass[4], 0.0);
  for (int64_t i = 0; i < topk(p); ++i) EXPECT_EQ(pr[4 * topk(p) + i], 0.0) << i;
  const double loss = to_doubles(b.loss)[0];
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_NE(loss, static_cast<float>(full));  // the row's term is gone
  // every row without a valid slot: the loss is +0
  for (int64_t r = 0; r < num_q_rows(p); ++r) invalidate_row(p, r);
  indexer_kl_forward(forward_inputs(p), b.views(), opt);
  EXPECT_EQ(to_doubles(b.loss)[0], 0.0);
  EXPECT_FALSE(std::signbit(to_doubles(b.loss)[0]));
}

TEST(KlForward, LossEqualsIndexerKlLoss) {
  for (const FwdCase& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    if (c.mutate) c.mutate(p);
    IndexerOptions opt = p.options();
    opt.loss_coeff = 1.5f;
    opt.normalization_count = 3;
    const double want = indexer_kl_loss(p.inputs(), opt, /*recompute_p=*/true);
    EXPECT_LE(rel_error(reference_kl_forward(forward_inputs(p), opt).loss, want), 1e-12) << c.name;
  }
}

TEST(KlForward, IndexScoreIsOptionalAndThreadsDoNotMatter) {
  GeneratedProblem p = make_problem(small_ragged_spec(Layout::thd, 32, 128, 16, IdMode::local, IdPattern::causal_topk, 31));
  IndexerOptions opt = p.options();
  opt.num_threads = 1;
  ForwardBuffers a = make_forward_buffers(p), b = make_forward_buffers(p);
  indexer_kl_forward(forward_inputs(p), a.views(), opt);
  opt.num_threads = 3;
  const Snapshot untouched(b.index_score);
  indexer_kl_forward(forward_inputs(p), b.views(/*with_p=*/false), opt);
  EXPECT_TRUE(untouched.unchanged());
  EXPECT_TRUE(bitwise_equal(a.loss, b.loss));
  EXPECT_TRUE(bitwise_equal(a.row_lse, b.row_lse));
  EXPECT_TRUE(bitwise_equal(a.row_target_mass, b.row_target_mass));
}

TEST(KlForward, NanTargetAtAValidSlotMakesTheLossNan) {
  GeneratedProblem p = make_problem(small_ragged_spec(Layout::bshd, 8, 64, 8, IdMode::local, IdPattern::random_permutation, 41));
  p.attn_score.data<float>()[3 * topk(p) + 2] = std::numeric_limits<float>::quiet_NaN();
  ForwardBuffers b = make_forward_buffers(p);
  indexer_kl_forward(forward_inputs(p), b.views(), p.options());
  EXPECT_TRUE(std::isnan(to_doubles(b.loss)[0]));
  EXPECT_TRUE(std::isnan(to_doubles(b.row_target_mass)[3]));
  EXPECT_TRUE(std::isfinite(to_doubles(b.row_lse)[3]));
}

/// indexer_kl_forward raises invalid_argument naming `arg`, and writes nothing.
void expect_rejected(const GeneratedProblem& p, const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                     const ForwardBuffers& b, const std::string& arg, const std::string& needle) {
  const Snapshot s0(b.loss), s1(b.row_lse), s2(b.row_target_mass), s3(b.index_score);
  try {
    indexer_kl_forward(in, out, p.options());
    ADD_FAILURE() << "no error for " << arg;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  EXPECT_TRUE(s0.unchanged() && s1.unchanged() && s2.unchanged() && s3.unchanged()) << arg;
}

TEST(KlForward, ValidationNamesTheArgumentBeforeAnyWrite) {
  GeneratedProblem p = make_problem(small_ragged_spec(Layout::bshd, 8, 64, 8, IdMode::local, IdPattern::random_permutation, 51));
  ForwardBuffers b = make_forward_buffers(p);
  const IndexerInputs in = forward_inputs(p);
  expect_rejected(p, p.inputs(), b.views(), b, "index_score", "absent");
  {
    IndexerKLForwardOutputs o = b.views();
    o.loss = contiguous_view(b.loss.bytes.data(), DType::f32, {1});
    expect_rejected(p, in, o, b, "loss", "rank 0");
    o.loss = TensorView{};
    expect_rejected(p, in, o, b, "loss", "absent");
  }
  {
    HostTensor bf(DType::bf16, {2, 9});
    IndexerKLForwardOutputs o = b.views();
    o.row_lse = bf.view();
    expect_rejected(p, in, o, b, "row_lse", "f32");
  }
  {
    IndexerKLForwardOutputs o = b.views();
    o.row_target_mass = contiguous_view(b.row_target_mass.bytes.data(), DType::f32, {2, 8});
    expect_rejected(p, in, o, b, "row_target_mass", "(2, 9)");
    o = b.views();
    o.index_score = contiguous_view(b.index_score.bytes.data(), DType::f32, {2, 9, 7});
    expect_rejected(p, in, o, b, "index_score", "(2, 9, 8)");
  }
  {
    IndexerKLForwardOutputs o = b.views();
    o.row_lse.strides[0] = 1;  // (2, 9) with strides (1, 9): not row-major
    o.row_lse.strides[1] = 2;
    expect_rejected(p, in, o, b, "row_lse", "contiguous");
  }
  {
    IndexerKLForwardOutputs o = b.views();
    o.row_target_mass.data = b.row_lse.bytes.data();
    expect_rejected(p, in, o, b, "row_lse", "row_target_mass");
    o = b.views();
    o.index_score.data = p.attn_score.view().data;
    expect_rejected(p, in, o, b, "index_score", "attn_score");
  }
  {
    IndexerOptions opt = p.options();
    opt.sm_scale = std::numeric_limits<float>::infinity();
    const Snapshot s(b.row_lse);
    EXPECT_THROW(indexer_kl_forward(in, b.views(), opt), Error);
    EXPECT_TRUE(s.unchanged());
  }
  EXPECT_THROW(reference_kl_forward(p.inputs(), p.options()), Error);  // index_score present
}

TEST(KlForward, CAbiMatchesTheCppApi) {
  GeneratedProblem p = make_problem(small_ragged_spec(Layout::thd, 16, 64, 12, IdMode::global, IdPattern::random_permutation, 61));
  const IndexerInputs i = forward_inputs(p);
  dsaib_inputs in = {to_c(i.index_q),    to_c(i.weights),     to_c(i.index_k),      to_c(i.topk_indices),
                     to_c(i.attn_score), to_c(i.index_score), to_c(i.cu_seqlens_q), to_c(i.cu_seqlens_k)};
  ForwardBuffers a = make_forward_buffers(p), b = make_forward_buffers(p);
  const IndexerKLForwardOutputs v = b.views();
  dsaib_kl_forward_outputs out = {to_c(v.loss), to_c(v.row_lse), to_c(v.row_target_mass), to_c(v.index_score)};
  dsaib_options opt;
  dsaib_default_options(&opt);
  opt.layout = DSAIB_THD;
  opt.id_mode = DSAIB_IDS_GLOBAL;
  opt.sm_scale = p.sm_scale;
  size_t bytes = 1;
  ASSERT_EQ(dsaib_indexer_kl_forward_workspace_size(&in, &out, &opt, &bytes), DSAIB_OK) << dsaib_last_error();
  EXPECT_EQ(bytes, 0u);
  ASSERT_EQ(dsaib_indexer_kl_forward(&in, &out, &opt, nullptr, 0), DSAIB_OK) << dsaib_last_error();
  indexer_kl_forward(i, a.views(), p.options());
  EXPECT_TRUE(bitwise_equal(a.loss, b.loss));
  EXPECT_TRUE(bitwise_equal(a.row_lse, b.row_lse));
  EXPECT_TRUE(bitwise_equal(a.index_score, b.index_score));
  out.row_lse.dtype = 7;
  EXPECT_EQ(dsaib_indexer_kl_forward(&in, &out, &opt, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dsaib_last_error()).find("row_lse"), std::string::npos) << dsaib_last_error();
  EXPECT_EQ(dsaib_indexer_kl_forward(&in, nullptr, &opt, nullptr, 0), DSAIB_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace dsaib::test
