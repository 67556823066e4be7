// The loss forward and the one call given the top-k's logits (topk_logits): the
// same results as recomputing them, to the logits' rounding, on BSHD/THD,
// local/global ids, invalid slots (whose logits are never read); the chain
// from indexer_topk's outputs; validation (the argument named, nothing
// written; every other entry point refuses the input); the C ABI.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <functional>
#include <string>
#include <tuple>
#include <utility>

#include "dsaib/dsaib.h"
#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "dsaib/indexer_topk.hpp"
#include "support/kl_forward_check.hpp"

namespace dsaib::test {
namespace {

struct Case {
  std::string name;
  GenerateSpec spec;
};

std::vector<Case> cases() {
  const IdPattern perm = IdPattern::random_permutation, causal = IdPattern::causal_topk;
  return {
      {"bshd_h8_d64_local", small_ragged_spec(Layout::bshd, 8, 64, 16, IdMode::local, perm, 81)},
      {"bshd_h64_d128_global", small_ragged_spec(Layout::bshd, 64, 128, 24, IdMode::global, perm, 82)},
      {"bshd_topk1", small_ragged_spec(Layout::bshd, 16, 64, 1, IdMode::local, perm, 83)},
      {"thd_h40_d64_local", small_ragged_spec(Layout::thd, 40, 64, 20, IdMode::local, causal, 84)},
      {"thd_h120_d128_global", small_ragged_spec(Layout::thd, 120, 128, 12, IdMode::global, perm, 85)},
  };
}

/// The selected keys' logits I (no sm_scale) from the fp64 reference, in
/// `dtype`, shaped like topk_indices; NaN at the invalid slots, which no
/// backend may read.
HostTensor logits_of(const GeneratedProblem& p, DType dtype) {
  IndexerOptions unscaled = p.options();
  unscaled.sm_scale = 1.0f;
  const std::vector<double> z = reference_index_logits(p.inputs(), unscaled);
  HostTensor t(dtype, p.topk_indices.shape);
  for (size_t e = 0; e < z.size(); ++e) {
    const double v = std::isinf(z[e]) && z[e] < 0 ? std::numeric_limits<double>::quiet_NaN() : z[e];
    if (dtype == DType::f64) t.data<double>()[e] = v;
    else t.data<float>()[e] = static_cast<float>(v);
  }
  return t;
}

IndexerInputs with_logits(const GeneratedProblem& p, const HostTensor& logits) {
  IndexerInputs in = forward_inputs(p);
  in.topk_logits = logits.view();
  return in;
}

TEST(KlForwardFromLogits, ExactLogitsGiveTheRecomputedForward) {
  for (const Case& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    add_invalid_slots(p);
    IndexerOptions opt = p.options();
    opt.loss_coeff = 0.7f;
    const HostTensor logits = logits_of(p, DType::f64);
    const ReferenceKLForward want = reference_kl_forward(forward_inputs(p), opt);
    const ReferenceKLForward got = reference_kl_forward(with_logits(p, logits), opt);
    EXPECT_LE(rel_error(got.loss, want.loss), 1e-12) << c.name;
    EXPECT_LE(max_error(got.row_lse, want.row_lse, false), 1e-12) << c.name;
    EXPECT_LE(max_error(got.row_target_mass, want.row_target_mass, false), 1e-12) << c.name;
    EXPECT_LE(max_error(got.index_score, want.index_score, true, 1e-300), 1e-11) << c.name;
    EXPECT_TRUE(std::isfinite(got.loss)) << c.name;  // the invalid slots' NaN logits were not read
  }
}

TEST(KlForwardFromLogits, CpuBackendWritesItsReferenceInF32) {
  for (const Case& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    add_invalid_slots(p);
    IndexerOptions opt = p.options();
    opt.normalization_count = 5;
    const HostTensor logits = logits_of(p, DType::f32);
    const IndexerInputs in = with_logits(p, logits);
    const ReferenceKLForward want = reference_kl_forward(in, opt);
    ForwardBuffers b = make_forward_buffers(p);
    indexer_kl_forward(in, b.views(), opt);
    EXPECT_LE(rel_error(to_doubles(b.loss)[0], want.loss), 1e-7) << c.name;
    EXPECT_LE(max_error(to_doubles(b.row_lse), want.row_lse, false), 1e-6) << c.name;
    EXPECT_LE(max_error(to_doubles(b.index_score), want.index_score, true, 1e-30), 1e-7) << c.name;
    // f32 logits against the recomputed fp64 ones: their rounding, no more.
    const ReferenceKLForward exact = reference_kl_forward(forward_inputs(p), opt);
    EXPECT_LE(rel_error(want.loss, exact.loss), 1e-6) << c.name;
    if (c.spec.topk > 1) EXPECT_GT(std::abs(want.loss - exact.loss), 0.0) << c.name;  // the given logits were used
  }
}

TEST(KlForwardFromLogits, FollowsTheIndexerTopkOutputs) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    GeneratedProblem p = make_problem(small_ragged_spec(layout, 16, 64, 12, IdMode::local, IdPattern::causal_topk, 91));
    const bool thd = layout == Layout::thd;
    IndexerTopkInputs tin{p.index_q.view(), p.weights.view(), p.index_k.view(), {}, {},
                          thd ? p.cu_seqlens_q.view() : TensorView{}, thd ? p.cu_seqlens_k.view() : TensorView{}};
    IndexerTopkOptions topt;
    topt.layout = layout;
    HostTensor ids(DType::i32, p.topk_indices.shape), logits(DType::f64, p.topk_indices.shape);
    indexer_topk(tin, {ids.view(), logits.view(), {}}, topt);
    // The selection becomes the problem's ids, the target is renormalised over them.
    p.topk_indices = ids;
    renormalize_attn_score(p);
    IndexerOptions opt = p.options();
    const ReferenceKLForward want = reference_kl_forward(forward_inputs(p), opt);
    IndexerInputs in = forward_inputs(p);
    in.topk_logits = logits.view();
    const ReferenceKLForward got = reference_kl_forward(in, opt);
    EXPECT_LE(rel_error(got.loss, want.loss), 1e-12);
    EXPECT_LE(max_error(got.row_lse, want.row_lse, false), 1e-12);
    EXPECT_LE(max_error(got.index_score, want.index_score, true, 1e-300), 1e-11);
    // The one call from the same logits: the loss of the forward from them, and
    // the gradients of the call that recomputes them.
    HostTensor loss_a(DType::f64, {}), loss_b(DType::f64, {});
    OutputBuffers a = make_outputs(p, DType::f64, DType::f64, DType::f64);
    OutputBuffers b = make_outputs(p, DType::f64, DType::f64, DType::f64);
    indexer_kl_loss_and_grad(in, {loss_a.view(), a.d_index_q.view(), a.d_weights.view(), a.d_index_k.view()}, opt);
    indexer_kl_loss_and_grad(forward_inputs(p), {loss_b.view(), b.d_index_q.view(), b.d_weights.view(),
                                                 b.d_index_k.view()}, opt);
    EXPECT_EQ(to_doubles(loss_a)[0], got.loss);
    EXPECT_LE(rel_error(to_doubles(loss_a)[0], to_doubles(loss_b)[0]), 1e-12);
    EXPECT_TRUE(compare(a.d_index_q, to_doubles(b.d_index_q)).ok(1e-10));
    EXPECT_TRUE(compare(a.d_weights, to_doubles(b.d_weights)).ok(1e-10));
    EXPECT_TRUE(compare(a.d_index_k, to_doubles(b.d_index_k)).ok(1e-10));
  }
}

TEST(KlForwardFromLogits, OneCallTakesThemToo) {
  for (const Case& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    add_invalid_slots(p);
    IndexerOptions opt = p.options();
    opt.grad_loss = 0.5f;
    const HostTensor logits = logits_of(p, DType::f32);
    HostTensor loss(DType::f32, {});
    poison(loss);
    OutputBuffers got = make_outputs(p);
    indexer_kl_loss_and_grad(with_logits(p, logits),
                             {loss.view(), got.d_index_q.view(), got.d_weights.view(), got.d_index_k.view()}, opt);
    const ReferenceKLForward fwd = reference_kl_forward(with_logits(p, logits), opt);
    EXPECT_EQ(to_doubles(loss)[0], static_cast<double>(static_cast<float>(fwd.loss))) << c.name;
    // The gradients: those of the recomputing call, to the f32 logits' rounding.
    OutputBuffers want = make_outputs(p);
    HostTensor loss2(DType::f32, {});
    indexer_kl_loss_and_grad(forward_inputs(p),
                             {loss2.view(), want.d_index_q.view(), want.d_weights.view(), want.d_index_k.view()}, opt);
    for (auto [name, out, ref] : {std::tuple{"d_index_q", &got.d_index_q, &want.d_index_q},
                                  std::tuple{"d_weights", &got.d_weights, &want.d_weights},
                                  std::tuple{"d_index_k", &got.d_index_k, &want.d_index_k}}) {
      const ErrorStats e = compare(*out, to_doubles(*ref));
      if (c.spec.topk > 1) {
        EXPECT_TRUE(e.ok(1e-5)) << c.name << " " << name << " rel_rms " << e.rel_rms;
      } else {
        // topk 1: P = 1 and the exact gradient is 0; the rebuilt P carries the
        // logits' rounding (the backward recomputes them), about 1e-7 of c T.
        EXPECT_TRUE(e.all_finite) << c.name << " " << name;
        EXPECT_LE(e.max_abs, 1e-6) << c.name << " " << name;
      }
    }
  }
}

/// `logits` (contiguous, shaped like topk_indices) copied into a buffer of
/// NaN, seen through a view with other strides: a row's slots `col_step`
/// floats apart, rows `row_pad` floats wider than they need, and (BSHD) the
/// batch dimension outermost in memory but after the rows (a (S, B, topk)
/// buffer seen as (B, S, topk)). Read with the wrong stride, the view gives NaN.
struct StridedLogits {
  HostTensor buffer;
  TensorView view;
};
StridedLogits strided_copy(const HostTensor& logits, int64_t col_step, int64_t row_pad) {
  const bool bshd = logits.shape.size() == 3;
  const int64_t K = logits.shape.back(), B = bshd ? logits.shape[0] : 1, S = bshd ? logits.shape[1] : logits.shape[0];
  const int64_t row = K * col_step + row_pad;  // floats per (s, b) row of the buffer
  StridedLogits out;
  out.buffer = HostTensor(DType::f32, {S * B * row + 1});
  float* buf = out.buffer.data<float>();
  for (int64_t e = 0; e < out.buffer.numel(); ++e) buf[e] = std::numeric_limits<float>::quiet_NaN();
  const float* src = logits.data<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < K; ++i) buf[(s * B + b) * row + i * col_step] = src[(b * S + s) * K + i];
    }
  }
  out.view = logits.view();
  out.view.data = buf;
  if (bshd) {
    out.view.strides[0] = row;
    out.view.strides[1] = B * row;
    out.view.strides[2] = col_step;
  } else {
    out.view.strides[0] = row;
    out.view.strides[1] = col_step;
  }
  return out;
}

TEST(KlForwardFromLogits, StridedLogitsAreReadThroughTheirStrides) {
  for (const Case& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    add_invalid_slots(p);
    const IndexerOptions opt = p.options();
    const HostTensor logits = logits_of(p, DType::f32);
    ForwardBuffers want = make_forward_buffers(p);
    indexer_kl_forward(with_logits(p, logits), want.views(), opt);
    HostTensor want_loss(DType::f32, {});
    OutputBuffers want_g = make_outputs(p);
    indexer_kl_loss_and_grad(with_logits(p, logits),
                             {want_loss.view(), want_g.d_index_q.view(), want_g.d_weights.view(),
                              want_g.d_index_k.view()}, opt);
    for (auto [col_step, row_pad] : {std::pair<int64_t, int64_t>{1, 3}, std::pair<int64_t, int64_t>{2, 0}}) {
      const StridedLogits strided = strided_copy(logits, col_step, row_pad);
      IndexerInputs in = forward_inputs(p);
      in.topk_logits = strided.view;
      ForwardBuffers got = make_forward_buffers(p);
      indexer_kl_forward(in, got.views(), opt);
      const std::string at = c.name + " col_step " + std::to_string(col_step);
      EXPECT_TRUE(bitwise_equal(got.loss, want.loss)) << at;
      EXPECT_TRUE(bitwise_equal(got.row_lse, want.row_lse)) << at;
      EXPECT_TRUE(bitwise_equal(got.row_target_mass, want.row_target_mass)) << at;
      EXPECT_TRUE(bitwise_equal(got.index_score, want.index_score)) << at;
      HostTensor loss(DType::f32, {});
      OutputBuffers g = make_outputs(p);
      indexer_kl_loss_and_grad(in, {loss.view(), g.d_index_q.view(), g.d_weights.view(), g.d_index_k.view()}, opt);
      EXPECT_TRUE(bitwise_equal(loss, want_loss)) << at;
      EXPECT_TRUE(bitwise_equal(g.d_index_q, want_g.d_index_q)) << at;
      EXPECT_TRUE(bitwise_equal(g.d_index_k, want_g.d_index_k)) << at;
    }
  }
}

/// `fn` raises invalid_argument naming `arg` with `needle` in its message.
void expect_invalid(const std::function<void()>& fn, const std::string& arg, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error for " << arg;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(KlForwardFromLogits, ValidationNamesTopkLogitsBeforeAnyWrite) {
  GeneratedProblem p = make_problem(small_ragged_spec(Layout::bshd, 8, 64, 8, IdMode::local, IdPattern::random_permutation, 95));
  const HostTensor logits = logits_of(p, DType::f32);
  ForwardBuffers b = make_forward_buffers(p);
  const IndexerOptions opt = p.options();
  const Snapshot s0(b.loss), s1(b.row_lse), s2(b.index_score);
  {
    HostTensor bf(DType::bf16, p.topk_indices.shape);
    IndexerInputs in = forward_inputs(p);
    in.topk_logits = bf.view();
    expect_invalid([&] { indexer_kl_forward(in, b.views(), opt); }, "topk_logits", "f32");
  }
  {
    HostTensor short_rows(DType::f32, {2, 9, 7});
    IndexerInputs in = forward_inputs(p);
    in.topk_logits = short_rows.view();
    expect_invalid([&] { indexer_kl_forward(in, b.views(), opt); }, "topk_logits", "(2, 9, 8)");
    HostTensor loss(DType::f32, {});
    OutputBuffers g = make_outputs(p);
    expect_invalid([&] {
      indexer_kl_loss_and_grad(in, {loss.view(), g.d_index_q.view(), g.d_weights.view(), g.d_index_k.view()}, opt);
    }, "topk_logits", "(2, 9, 8)");
    expect_invalid([&] { validate_indexer_kl_loss_inputs(in, opt); }, "topk_logits", "(2, 9, 8)");
  }
  {
    // An output on the given logits.
    IndexerKLForwardOutputs o = b.views();
    o.index_score = logits.view();
    expect_invalid([&] { indexer_kl_forward(with_logits(p, logits), o, opt); }, "index_score", "topk_logits");
    HostTensor loss(DType::f32, {});
    OutputBuffers g = make_outputs(p);
    HostTensor big(DType::f32, {2, 9, 8});
    expect_invalid([&] {
      indexer_kl_loss_and_grad(with_logits(p, big), {loss.view(), g.d_index_q.view(), big.view(), g.d_index_k.view()},
                               opt);
    }, "d_weights", "topk_logits");
  }
  EXPECT_TRUE(s0.unchanged() && s1.unchanged() && s2.unchanged());
  // Every other entry point refuses it.
  IndexerInputs backward_in = p.inputs();
  backward_in.topk_logits = logits.view();
  OutputBuffers g = make_outputs(p);
  const Snapshot dq(g.d_index_q);
  expect_invalid([&] { indexer_backward(backward_in, g.views(), opt); }, "topk_logits", "indexer_kl_forward");
  expect_invalid([&] { (void)reference_backward(backward_in, opt); }, "topk_logits", "absent");
  EXPECT_TRUE(dq.unchanged());
  // The loss's own input check takes it.
  EXPECT_NO_THROW(validate_indexer_kl_loss_inputs(with_logits(p, logits), opt));
}

TEST(KlForwardFromLogits, CAbiMatchesTheCppApi) {
  GeneratedProblem p = make_problem(small_ragged_spec(Layout::thd, 16, 64, 12, IdMode::global, IdPattern::random_permutation, 97));
  const HostTensor logits = logits_of(p, DType::f32);
  const IndexerInputs i = with_logits(p, logits);
  dsaib_inputs in{};
  in.index_q = to_c(i.index_q);
  in.weights = to_c(i.weights);
  in.index_k = to_c(i.index_k);
  in.topk_indices = to_c(i.topk_indices);
  in.attn_score = to_c(i.attn_score);
  in.cu_seqlens_q = to_c(i.cu_seqlens_q);
  in.cu_seqlens_k = to_c(i.cu_seqlens_k);
  in.topk_logits = to_c(i.topk_logits);
  ForwardBuffers a = make_forward_buffers(p), b = make_forward_buffers(p);
  const IndexerKLForwardOutputs v = b.views();
  dsaib_kl_forward_outputs out = {to_c(v.loss), to_c(v.row_lse), to_c(v.row_target_mass), to_c(v.index_score)};
  dsaib_options opt;
  dsaib_default_options(&opt);
  opt.layout = DSAIB_THD;
  opt.id_mode = DSAIB_IDS_GLOBAL;
  opt.sm_scale = p.sm_scale;
  ASSERT_EQ(dsaib_indexer_kl_forward(&in, &out, &opt, nullptr, 0), DSAIB_OK) << dsaib_last_error();
  indexer_kl_forward(i, a.views(), p.options());
  EXPECT_TRUE(bitwise_equal(a.loss, b.loss));
  EXPECT_TRUE(bitwise_equal(a.row_lse, b.row_lse));
  EXPECT_TRUE(bitwise_equal(a.index_score, b.index_score));
  in.topk_logits.dtype = 9;
  EXPECT_EQ(dsaib_indexer_kl_forward(&in, &out, &opt, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dsaib_last_error()).find("topk_logits"), std::string::npos) << dsaib_last_error();
}

}  // namespace
}  // namespace dsaib::test
