// The P-free form of the backward (row_lse and row_target_mass instead of
// index_score) and the one-call loss and gradients, on the cpu backend: against
// the P form fed the forward's P, BSHD/THD, local/global ids, invalid slots, H up
// to 128; logits with a large common part (|LSE| ~ 4700) against the exact
// gradients; the validation of the two forms and the cuda backend's key-row
// limit; the C ABI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>

#include "core/problem.hpp"
#include "dsaib/dsaib.h"
#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "support/kl_forward_check.hpp"

namespace dsaib::test {
namespace {

struct Case {
  std::string name;
  GenerateSpec spec;
};

std::vector<Case> cases() {
  return {{"bshd_h8_d64_local", small_ragged_spec(Layout::bshd, 8, 64, 16, IdMode::local, IdPattern::causal_topk, 21)},
          {"bshd_h64_d128_global", small_ragged_spec(Layout::bshd, 64, 128, 24, IdMode::global, IdPattern::causal_topk, 22)},
          {"thd_h40_d64_local", small_ragged_spec(Layout::thd, 40, 64, 20, IdMode::local, IdPattern::causal_topk, 23)},
          {"thd_h128_d128_global", small_ragged_spec(Layout::thd, 128, 128, 12, IdMode::global, IdPattern::causal_topk, 24)}};
}

/// The P-free inputs of a problem: its inputs without index_score, with the
/// forward's row statistics.
IndexerInputs p_free_inputs(const GeneratedProblem& p, const ForwardBuffers& f) {
  IndexerInputs in = forward_inputs(p);
  in.row_lse = f.row_lse.view();
  in.row_target_mass = f.row_target_mass.view();
  return in;
}

TEST(PFree, MatchesThePFormFedTheForwardsP) {
  for (const Case& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    add_invalid_slots(p);
    IndexerOptions opt = p.options();
    opt.loss_coeff = 0.7f;
    opt.grad_loss = 1.3f;
    ForwardBuffers f = make_forward_buffers(p);
    indexer_kl_forward(forward_inputs(p), f.views(), opt);
    // The P form with the forward's P (the f32 P it wrote) ...
    IndexerInputs p_form = forward_inputs(p);
    p_form.index_score = f.index_score.view();
    const ReferenceGradients want = reference_backward(p_form, opt);
    // ... and the P-free form with the forward's f32 LSE and mass: the same
    // gradients up to the f32 rounding of P, LSE and the mass.
    OutputBuffers got = make_outputs(p);
    indexer_backward(p_free_inputs(p, f), got.views(), opt);
    for (auto [name, out, ref] : {std::tuple{"d_index_q", &got.d_index_q, &want.d_index_q},
                                  std::tuple{"d_weights", &got.d_weights, &want.d_weights},
                                  std::tuple{"d_index_k", &got.d_index_k, &want.d_index_k}}) {
      const ErrorStats e = compare(*out, *ref);
      EXPECT_TRUE(e.ok(2e-6)) << c.name << " " << name << " " << e.str();
    }
  }
}

TEST(PFree, OneCallEqualsForwardThenPFreeBackward) {
  for (const Case& c : cases()) {
    GeneratedProblem p = make_problem(c.spec);
    add_invalid_slots(p);
    IndexerOptions opt = p.options();
    opt.loss_coeff = 0.9f;
    float grad_loss = 0.6f;
    opt.grad_loss_device = &grad_loss;
    HostTensor loss(DType::f32, {});
    poison(loss);
    OutputBuffers one = make_outputs(p);
    EXPECT_EQ(indexer_kl_loss_and_grad_workspace_size(forward_inputs(p), {loss.view(), one.d_index_q.view(),
                                                      one.d_weights.view(), one.d_index_k.view()}, opt), 0u);
    indexer_kl_loss_and_grad(forward_inputs(p),
                             {loss.view(), one.d_index_q.view(), one.d_weights.view(), one.d_index_k.view()}, opt);
    const ReferenceKLForward fwd = reference_kl_forward(forward_inputs(p), opt);
    EXPECT_EQ(to_doubles(loss)[0], static_cast<double>(static_cast<float>(fwd.loss))) << c.name;
    // The fp64 path of the one call (statistics unrounded) against the P-free
    // backward given the f32 statistics.
    ForwardBuffers f = make_forward_buffers(p);
    indexer_kl_forward(forward_inputs(p), f.views(), opt);
    OutputBuffers two = make_outputs(p);
    indexer_backward(p_free_inputs(p, f), two.views(), opt);
    EXPECT_TRUE(compare(one.d_index_q, to_doubles(two.d_index_q)).ok(2e-6)) << c.name;
    EXPECT_TRUE(compare(one.d_weights, to_doubles(two.d_weights)).ok(2e-6)) << c.name;
    EXPECT_TRUE(compare(one.d_index_k, to_doubles(two.d_index_k)).ok(2e-6)) << c.name;
    // grad_loss scales the gradients, not the loss.
    grad_loss = 1.2f;
    OutputBuffers doubled = make_outputs(p);
    indexer_kl_loss_and_grad(forward_inputs(p),
                             {loss.view(), doubled.d_index_q.view(), doubled.d_weights.view(), doubled.d_index_k.view()},
                             opt);
    std::vector<double> twice = to_doubles(one.d_index_q);
    for (double& v : twice) v *= 2;
    EXPECT_TRUE(compare(doubled.d_index_q, twice).ok(1e-6)) << c.name;
  }
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

/// The f32 row statistics of the forward with logits of a large common part
/// (give_logits_a_common_part: z ~ 4700 at H 64, D 128; the f32 LSE is off by
/// up to 2.4e-4, the same for every slot of a row, and the keys' and queries'
/// common part turns that into an error of d_weights and d_index_q relative to
/// their size ~(q.k) / (its spread over the keys) ~ 190 times larger). The
/// P-free backward given those statistics against the exact gradients (the
/// one-call function's fp64 path: the fp64 statistics, nothing rounded).
TEST(PFree, LargeCommonLogitPartKeepsTheGradientsExact) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    GeneratedProblem p = make_problem(small_ragged_spec(layout, 64, 128, 24, IdMode::local, IdPattern::causal_topk, 81));
    give_logits_a_common_part(p, /*q_common=*/16, /*sm_scale_log2=*/-4, 81);
    add_invalid_slots(p);
    IndexerOptions opt = p.options();
    opt.loss_coeff = 0.7f;
    HostTensor loss(DType::f32, {});
    OutputBuffers exact = make_outputs(p);
    indexer_kl_loss_and_grad(forward_inputs(p),
                             {loss.view(), exact.d_index_q.view(), exact.d_weights.view(), exact.d_index_k.view()}, opt);
    ForwardBuffers f = make_forward_buffers(p);
    indexer_kl_forward(forward_inputs(p), f.views(false), opt);
    const std::vector<double> lse = to_doubles(f.row_lse);
    ASSERT_GT(*std::max_element(lse.begin(), lse.end()), 4000.0);
    OutputBuffers got = make_outputs(p);
    indexer_backward(p_free_inputs(p, f), got.views(), opt);
    for (auto [name, out, ref] : {std::tuple{"d_index_q", &got.d_index_q, &exact.d_index_q},
                                  std::tuple{"d_weights", &got.d_weights, &exact.d_weights},
                                  std::tuple{"d_index_k", &got.d_index_k, &exact.d_index_k}}) {
      const ErrorStats e = compare(*out, to_doubles(*ref));
      std::printf("[large LSE] %s %s %s\n", layout == Layout::thd ? "thd" : "bshd", name, e.str().c_str());
      EXPECT_TRUE(e.ok(1e-5)) << name << " " << e.str();
      EXPECT_LE(e.max_abs, 1e-4 * e.max_abs_ref) << name << " " << e.str();
    }
  }
}

/// The cuda backend's limit of 2^31 key rows is a validation rule: the
/// validation behind every call and workspace query raises it (checked here on
/// views of device memory that is never touched, so no GPU is needed).
TEST(PFree, CudaKeyRowLimitIsAValidationRule) {
  const int64_t rows = int64_t{1} << 31;
  auto at = [](int64_t gib) { return reinterpret_cast<void*>(static_cast<uintptr_t>(gib) << 30); };
  auto dev = [&](int64_t gib, DType t, std::initializer_list<int64_t> shape) {
    return contiguous_view(at(gib), t, shape, DeviceType::cuda, 0);
  };
  IndexerInputs in{};
  in.index_q = dev(1, DType::bf16, {1, 1, 8, 64});
  in.weights = dev(2, DType::bf16, {1, 1, 8});
  in.index_k = dev(1024, DType::bf16, {1, rows, 64});  // 256 GiB of addresses
  in.topk_indices = dev(3, DType::i32, {1, 1, 1});
  in.attn_score = dev(4, DType::f32, {1, 1, 1});
  const IndexerBackwardOutputs grads{dev(5, DType::f32, {1, 1, 8, 64}), dev(6, DType::f32, {1, 1, 8}),
                                     dev(2048, DType::f32, {1, rows, 64})};
  IndexerOptions opt;
  opt.backend = Backend::cuda;
  const std::string want = "index_k: expected fewer than 2^31 key rows on the cuda backend, got 2147483648";
  IndexerInputs p_form = in, p_free = in;
  p_form.index_score = dev(7, DType::f32, {1, 1, 1});
  p_free.row_lse = dev(8, DType::f32, {1, 1});
  p_free.row_target_mass = dev(9, DType::f32, {1, 1});
  EXPECT_EQ(error_of([&] { (void)detail::validate_problem(p_form, grads, opt); }), want);
  EXPECT_EQ(error_of([&] { (void)detail::validate_problem(p_free, grads, opt); }), want);
  const IndexerKLForwardOutputs fwd{dev(10, DType::f32, {}), dev(11, DType::f32, {1, 1}), dev(12, DType::f32, {1, 1}), {}};
  EXPECT_EQ(error_of([&] { (void)detail::validate_kl_forward_problem(in, fwd, opt); }), want);
  const IndexerKLLossAndGradOutputs one{dev(13, DType::f32, {}), grads.d_index_q, grads.d_weights, grads.d_index_k};
  EXPECT_EQ(error_of([&] { (void)detail::validate_kl_loss_and_grad_problem(in, one, opt, nullptr, false); }), want);
  // One key row fewer passes these rules.
  in.index_k.shape[1] = rows - 1;
  IndexerKLForwardOutputs fwd_ok = fwd;
  EXPECT_EQ(error_of([&] { (void)detail::validate_kl_forward_problem(in, fwd_ok, opt); }), "");
  // The cpu backend has no such limit (cpu views of the same sizes).
  for (TensorView* v : {&in.index_q, &in.weights, &in.index_k, &in.topk_indices, &in.attn_score}) v->device = DeviceType::cpu;
  for (TensorView* v : {&fwd_ok.loss, &fwd_ok.row_lse, &fwd_ok.row_target_mass}) v->device = DeviceType::cpu;
  in.index_k.shape[1] = rows;
  opt.backend = Backend::cpu;
  EXPECT_EQ(error_of([&] { (void)detail::validate_kl_forward_problem(in, fwd_ok, opt); }), "");
}

TEST(PFree, ValidationNamesTheForms) {
  GeneratedProblem p = make_problem(cases()[0].spec);
  IndexerOptions opt = p.options();
  ForwardBuffers f = make_forward_buffers(p);
  indexer_kl_forward(forward_inputs(p), f.views(), opt);
  OutputBuffers out = make_outputs(p);
  poison(out);
  const OutputBuffers before = out;

  IndexerInputs neither = forward_inputs(p);
  EXPECT_NE(error_of([&] { indexer_backward(neither, out.views(), opt); })
                .find("index_score: expected a tensor, or row_lse and row_target_mass instead (the P-free form), got nothing"),
            std::string::npos);
  IndexerInputs both = p.inputs();
  both.row_lse = f.row_lse.view();
  both.row_target_mass = f.row_target_mass.view();
  EXPECT_NE(error_of([&] { indexer_backward(both, out.views(), opt); }).find("row_lse: expected absent when index_score is given"),
            std::string::npos);
  IndexerInputs half = p_free_inputs(p, f);
  half.row_target_mass = {};
  EXPECT_NE(error_of([&] { indexer_backward(half, out.views(), opt); }).find("row_target_mass: expected a tensor"),
            std::string::npos);
  HostTensor wrong(DType::f32, {p.spec.batch, p.spec.s_q + 1});
  IndexerInputs shaped = p_free_inputs(p, f);
  shaped.row_lse = wrong.view();
  EXPECT_NE(error_of([&] { indexer_backward(shaped, out.views(), opt); }).find("row_lse: expected shape"), std::string::npos);
  HostTensor ints(DType::i32, {p.spec.batch, p.spec.s_q});
  IndexerInputs typed = p_free_inputs(p, f);
  typed.row_target_mass = ints.view();
  EXPECT_NE(error_of([&] { indexer_backward(typed, out.views(), opt); }).find("row_target_mass: expected dtype f32"),
            std::string::npos);
  HostTensor loss(DType::f32, {});
  EXPECT_NE(error_of([&] {
              indexer_kl_loss_and_grad(p.inputs(), {loss.view(), out.d_index_q.view(), out.d_weights.view(),
                                                    out.d_index_k.view()}, opt);
            }).find("index_score: expected absent in the inputs of indexer_kl_loss_and_grad"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              indexer_kl_loss_and_grad(forward_inputs(p), {out.d_weights.view(), out.d_index_q.view(),
                                                           out.d_weights.view(), out.d_index_k.view()}, opt);
            }).find("loss:"),
            std::string::npos);
  EXPECT_NE(error_of([&] { indexer_kl_forward(p_free_inputs(p, f), f.views(), opt); }).find("row_lse: expected absent"),
            std::string::npos);
  // Nothing was written by any of the failed calls.
  EXPECT_TRUE(bitwise_equal(out.d_index_q, before.d_index_q));
  EXPECT_TRUE(bitwise_equal(out.d_index_k, before.d_index_k));
}

TEST(PFree, CAbi) {
  GeneratedProblem p = make_problem(cases()[2].spec);
  IndexerOptions opt = p.options();
  ForwardBuffers f = make_forward_buffers(p);
  indexer_kl_forward(forward_inputs(p), f.views(), opt);
  const IndexerInputs in = p_free_inputs(p, f);
  dsaib_inputs ci{};
  ci.index_q = to_c(in.index_q), ci.weights = to_c(in.weights), ci.index_k = to_c(in.index_k);
  ci.topk_indices = to_c(in.topk_indices), ci.attn_score = to_c(in.attn_score);
  ci.cu_seqlens_q = to_c(in.cu_seqlens_q), ci.cu_seqlens_k = to_c(in.cu_seqlens_k);
  ci.row_lse = to_c(in.row_lse), ci.row_target_mass = to_c(in.row_target_mass);
  dsaib_options co;
  dsaib_default_options(&co);
  co.layout = DSAIB_THD;
  co.sm_scale = opt.sm_scale;
  OutputBuffers c_out = make_outputs(p), cpp_out = make_outputs(p);
  const dsaib_outputs cgo{to_c(c_out.d_index_q.view()), to_c(c_out.d_weights.view()), to_c(c_out.d_index_k.view())};
  ASSERT_EQ(dsaib_indexer_backward(&ci, &cgo, &co, nullptr, 0), DSAIB_OK) << dsaib_last_error();
  indexer_backward(in, cpp_out.views(), opt);
  EXPECT_TRUE(bitwise_equal(c_out.d_index_q, cpp_out.d_index_q));
  EXPECT_TRUE(bitwise_equal(c_out.d_index_k, cpp_out.d_index_k));

  HostTensor loss(DType::f32, {});
  dsaib_inputs no_stats = ci;
  no_stats.row_lse = dsaib_tensor{};
  no_stats.row_target_mass = dsaib_tensor{};
  const dsaib_kl_loss_and_grad_outputs clo{to_c(loss.view()), cgo.d_index_q, cgo.d_weights, cgo.d_index_k};
  size_t bytes = 7;
  ASSERT_EQ(dsaib_indexer_kl_loss_and_grad_workspace_size(&no_stats, &clo, &co, &bytes), DSAIB_OK) << dsaib_last_error();
  EXPECT_EQ(bytes, 0u);
  ASSERT_EQ(dsaib_indexer_kl_loss_and_grad(&no_stats, &clo, &co, nullptr, 0), DSAIB_OK) << dsaib_last_error();
  EXPECT_EQ(to_doubles(loss)[0], static_cast<double>(to_doubles(f.loss)[0]));
  EXPECT_EQ(dsaib_indexer_kl_loss_and_grad(&ci, &clo, &co, nullptr, 0), DSAIB_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dsaib_last_error()).find("row_lse"), std::string::npos);
}

}  // namespace
}  // namespace dsaib::test
