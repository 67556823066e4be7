// f64 on the cpu backend: its fp64 results written unrounded into f64 outputs
// of every entry point, f64 float inputs read as they are, and the cuda
// backend's refusal of f64, which names the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/problem.hpp"
#include "dsaib/attention_target.hpp"
#include "dsaib/indexer_kl_forward.hpp"
#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "dsaib/reference.hpp"
#include "support/attention_target_check.hpp"
#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

GeneratedProblem f64_problem(Layout layout, uint64_t seed = 5) {
  GenerateSpec s = small_spec(seed);
  s.layout = layout;
  if (layout == Layout::thd) {
    s.seqlens_q = {3, 17};
    s.seqlens_k = {4, 30};
  }
  return make_problem(s);
}

/// Every element of `out` (f64) equals `want` bitwise; and at least one of
/// them is not an f32 value, so that an output rounded to f32 would fail.
void expect_exact_f64(const HostTensor& out, const std::vector<double>& want, const char* name) {
  ASSERT_EQ(out.dtype, DType::f64) << name;
  ASSERT_EQ(static_cast<size_t>(out.numel()), want.size()) << name;
  const double* got = out.data<double>();
  size_t differ = 0, beyond_f32 = 0;
  for (size_t e = 0; e < want.size(); ++e) {
    if (std::memcmp(&got[e], &want[e], 8) != 0) ++differ;
    if (static_cast<double>(static_cast<float>(want[e])) != want[e]) ++beyond_f32;
  }
  EXPECT_EQ(differ, 0u) << name << ": elements that differ from the fp64 reference";
  EXPECT_GT(beyond_f32, 0u) << name << ": the reference holds only f32 values, the test cannot see rounding";
}

HostTensor as_f64(const HostTensor& t) {
  HostTensor out(DType::f64, t.shape);
  const std::vector<double> v = to_doubles(t);
  std::memcpy(out.data<double>(), v.data(), v.size() * 8);
  return out;
}

class F64Layouts : public ::testing::TestWithParam<Layout> {};

TEST_P(F64Layouts, BackwardWritesTheFp64ReferenceUnrounded) {
  const GeneratedProblem p = f64_problem(GetParam());
  IndexerOptions opt = p.options();
  opt.num_threads = 2;
  opt.loss_coeff = 0.7f;
  opt.grad_loss = 1.5f;
  const ReferenceGradients ref = reference_backward(p.inputs(), opt);
  const OutputBuffers o = run_cpu(p, opt, DType::f64, DType::f64, DType::f64);
  expect_exact_f64(o.d_index_q, ref.d_index_q, "d_index_q");
  expect_exact_f64(o.d_weights, ref.d_weights, "d_weights");
  expect_exact_f64(o.d_index_k, ref.d_index_k, "d_index_k");
  // Mixed: an f32 d_index_q beside an f64 d_index_k, each in its own dtype.
  const OutputBuffers mixed = run_cpu(p, opt, DType::f32, DType::bf16, DType::f64);
  expect_exact_f64(mixed.d_index_k, ref.d_index_k, "d_index_k beside f32 and bf16 outputs");
  const std::vector<double> dq = to_doubles(mixed.d_index_q);
  for (size_t e = 0; e < dq.size(); ++e) ASSERT_EQ(dq[e], static_cast<double>(static_cast<float>(ref.d_index_q[e])));
}

TEST_P(F64Layouts, Float64InputsAreReadAsTheyAre) {
  // weights, attn_score and index_score holding the same values in f64: the
  // same results bitwise; then an f64 attn_score value that f32 cannot hold
  // changes them (its low bits are read).
  const GeneratedProblem p = f64_problem(GetParam(), 9);
  IndexerOptions opt = p.options();
  opt.num_threads = 1;
  const OutputBuffers want = run_cpu(p, opt, DType::f64, DType::f64, DType::f64);
  GeneratedProblem wide = p;
  wide.weights = as_f64(p.weights);
  wide.attn_score = as_f64(p.attn_score);
  wide.index_score = as_f64(p.index_score);
  const OutputBuffers got = run_cpu(wide, opt, DType::f64, DType::f64, DType::f64);
  EXPECT_TRUE(bitwise_equal(got.d_index_q, want.d_index_q));
  EXPECT_TRUE(bitwise_equal(got.d_weights, want.d_weights));
  EXPECT_TRUE(bitwise_equal(got.d_index_k, want.d_index_k));
  // The last row's largest target (causal ids: early rows have one valid slot,
  // whose gradient is 0 whatever its target).
  const int64_t row = num_q_rows(p) - 1, K = topk(p);
  const double* T = wide.attn_score.data<double>() + row * K;
  int64_t slot = -1;
  for (int64_t i = 0; i < K; ++i) {
    if (slot_valid(p, row, i) && (slot < 0 || T[i] > T[slot])) slot = i;
  }
  ASSERT_GE(slot, 0);
  wide.attn_score.data<double>()[row * K + slot] *= 1.0 + 0x1p-30;  // below f32's resolution
  const OutputBuffers moved = run_cpu(wide, opt, DType::f64, DType::f64, DType::f64);
  EXPECT_FALSE(bitwise_equal(moved.d_index_q, want.d_index_q) && bitwise_equal(moved.d_weights, want.d_weights) &&
               bitwise_equal(moved.d_index_k, want.d_index_k));
}

TEST_P(F64Layouts, KLForwardWritesTheFp64ReferenceUnrounded) {
  const GeneratedProblem p = f64_problem(GetParam());
  IndexerOptions opt = p.options();
  opt.loss_coeff = 0.7f;
  IndexerInputs in = p.inputs();
  in.index_score = {};
  const ReferenceKLForward ref = reference_kl_forward(in, opt);
  const int64_t R = num_q_rows(p), K = topk(p);
  const std::vector<int64_t> rows = GetParam() == Layout::thd ? std::vector<int64_t>{R}
                                                              : std::vector<int64_t>{p.spec.batch, p.spec.s_q};
  std::vector<int64_t> scores = rows;
  scores.push_back(K);
  HostTensor loss(DType::f64, {}), lse(DType::f64, rows), mass(DType::f64, rows), P(DType::f64, scores);
  for (HostTensor* t : {&loss, &lse, &mass, &P}) poison(*t);
  indexer_kl_forward(in, {loss.view(), lse.view(), mass.view(), P.view()}, opt);
  expect_exact_f64(loss, {ref.loss}, "loss");
  expect_exact_f64(lse, ref.row_lse, "row_lse");
  expect_exact_f64(mass, ref.row_target_mass, "row_target_mass");
  expect_exact_f64(P, ref.index_score, "index_score");

  // The one-call loss and gradients: its f64 loss is the forward's, its f64
  // gradients the P-free backward's from these f64 row statistics.
  OutputBuffers g = make_outputs(p, DType::f64, DType::f64, DType::f64);
  poison(g);
  HostTensor loss2(DType::f64, {});
  poison(loss2);
  indexer_kl_loss_and_grad(in, {loss2.view(), g.d_index_q.view(), g.d_weights.view(), g.d_index_k.view()}, opt);
  expect_exact_f64(loss2, {ref.loss}, "loss (indexer_kl_loss_and_grad)");
  IndexerInputs p_free = in;
  p_free.row_lse = lse.view();
  p_free.row_target_mass = mass.view();
  const ReferenceGradients want = reference_backward(p_free, opt);
  expect_exact_f64(g.d_index_q, want.d_index_q, "d_index_q (indexer_kl_loss_and_grad)");
  expect_exact_f64(g.d_weights, want.d_weights, "d_weights (indexer_kl_loss_and_grad)");
  expect_exact_f64(g.d_index_k, want.d_index_k, "d_index_k (indexer_kl_loss_and_grad)");
}

INSTANTIATE_TEST_SUITE_P(Layouts, F64Layouts, ::testing::Values(Layout::bshd, Layout::thd),
                         [](const auto& info) { return std::string(layout_name(info.param)); });

TEST(F64, AttentionTargetWritesTheFp64ReferenceUnrounded) {
  TargetSpec s;
  s.heads = 16, s.head_dim = 64;
  const TargetProblem p = make_target_problem(s);
  AttentionTargetOptions opt;
  opt.sm_scale = p.sm_scale;
  const ReferenceAttentionTarget ref = reference_attention_target(p.inputs(), opt);
  HostTensor T(DType::f64, p.topk_indices.shape);
  poison(T);
  attention_target(p.inputs(), {T.view()}, opt);
  expect_exact_f64(T, ref.attn_score, "attn_score");
  // An f64 lse holding the same values: the same target.
  AttentionTargetInputs wide = p.inputs();
  const HostTensor lse64 = as_f64(p.lse);
  wide.lse = lse64.view();
  HostTensor T2(DType::f64, p.topk_indices.shape);
  attention_target(wide, {T2.view()}, opt);
  EXPECT_TRUE(bitwise_equal(T2, T));
}

TEST(F64, CpuNamesF64AmongTheDtypesItTakes) {
  const GeneratedProblem p = f64_problem(Layout::bshd);
  OutputBuffers o = make_outputs(p);
  o.d_index_k = HostTensor(DType::i32, p.index_k.shape);
  try {
    indexer_backward(p.inputs(), o.views(), p.options());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_STREQ(e.what(), "d_index_k: expected dtype bf16 or f32 or f64, got dtype i32");
  }
  // index_q and index_k stay bf16: f64 is no input the kernels' operands take.
  GeneratedProblem wide = p;
  wide.index_q = as_f64(p.index_q);
  try {
    run_cpu(wide, p.options());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "index_q: expected dtype bf16, got dtype f64");
  }
}

/// The views of `v` as if they were cuda tensors of device 0 (never read:
/// BSHD, no strict ids, so validation touches no element).
TensorView on_cuda(TensorView v) {
  if (v.present()) v.device = DeviceType::cuda;
  return v;
}

std::string cuda_validation_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    return e.what();
  }
  return "no error";
}

// The validation the cuda backend runs (after its availability check, which a
// machine without a GPU fails first; see CudaEntryPointsRefuseF64 for that path).
TEST(F64, CudaValidationRefusesF64NamingTheTensor) {
  const GeneratedProblem p = f64_problem(Layout::bshd);
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  IndexerInputs in = p.inputs();
  for (TensorView* v : {&in.index_q, &in.weights, &in.index_k, &in.topk_indices, &in.attn_score, &in.index_score}) {
    *v = on_cuda(*v);
  }
  const OutputBuffers f32 = make_outputs(p);
  const OutputBuffers f64 = make_outputs(p, DType::f64, DType::f64, DType::f64);
  IndexerBackwardOutputs out{on_cuda(f32.d_index_q.view()), on_cuda(f32.d_weights.view()), on_cuda(f32.d_index_k.view())};
  EXPECT_EQ(cuda_validation_error([&] { (void)detail::validate_problem(in, out, opt); }), "no error");
  const char* names[] = {"d_index_q", "d_weights", "d_index_k"};
  const HostTensor* wides[] = {&f64.d_index_q, &f64.d_weights, &f64.d_index_k};
  for (int i = 0; i < 3; ++i) {
    IndexerBackwardOutputs o = out;
    *(i == 0 ? &o.d_index_q : i == 1 ? &o.d_weights : &o.d_index_k) = on_cuda(wides[i]->view());
    EXPECT_EQ(cuda_validation_error([&] { (void)detail::validate_problem(in, o, opt); }),
              std::string(names[i]) + ": expected dtype bf16 or f32 on the cuda backend (f64 on the cpu backend only), got dtype f64");
  }
  const HostTensor w64 = as_f64(p.weights), T64 = as_f64(p.attn_score);
  IndexerInputs wide = in;
  wide.weights = on_cuda(w64.view());
  EXPECT_EQ(cuda_validation_error([&] { (void)detail::validate_problem(wide, out, opt); }),
            "weights: expected dtype bf16 or f32 on the cuda backend (f64 on the cpu backend only), got dtype f64");
  wide = in;
  wide.attn_score = on_cuda(T64.view());
  EXPECT_EQ(cuda_validation_error([&] { (void)detail::validate_problem(wide, out, opt); }),
            "attn_score: expected dtype f32 on the cuda backend (f64 on the cpu backend only), got dtype f64");

  // The forward's outputs and the one-call function's loss.
  IndexerInputs fwd_in = in;
  fwd_in.index_score = {};
  HostTensor loss32(DType::f32, {}), loss64(DType::f64, {});
  HostTensor lse(DType::f32, {p.spec.batch, p.spec.s_q}), mass(DType::f32, {p.spec.batch, p.spec.s_q});
  IndexerKLForwardOutputs fo{on_cuda(loss64.view()), on_cuda(lse.view()), on_cuda(mass.view()), {}};
  EXPECT_EQ(cuda_validation_error([&] { (void)detail::validate_kl_forward_problem(fwd_in, fo, opt); }),
            "loss: expected dtype f32 on the cuda backend (f64 on the cpu backend only), got dtype f64");
  IndexerKLLossAndGradOutputs lo{on_cuda(loss64.view()), out.d_index_q, out.d_weights, out.d_index_k};
  EXPECT_EQ(cuda_validation_error([&] { (void)detail::validate_kl_loss_and_grad_problem(fwd_in, lo, opt, nullptr, false); }),
            "loss: expected dtype f32 on the cuda backend (f64 on the cpu backend only), got dtype f64");
  lo.loss = on_cuda(loss32.view());
  EXPECT_EQ(cuda_validation_error([&] { (void)detail::validate_kl_loss_and_grad_problem(fwd_in, lo, opt, nullptr, false); }),
            "no error");
}

// The public entry points on a machine with a usable cuda backend (skipped
// elsewhere: there the availability check comes first, errors.md "Options").
TEST(F64, CudaEntryPointsRefuseF64) {
  if (!cuda_backend_available()) GTEST_SKIP() << "no usable cuda backend";
  const GeneratedProblem p = f64_problem(Layout::bshd);
  IndexerOptions opt = p.options();
  opt.backend = Backend::cuda;
  IndexerInputs in = p.inputs();
  for (TensorView* v : {&in.index_q, &in.weights, &in.index_k, &in.topk_indices, &in.attn_score, &in.index_score}) {
    *v = on_cuda(*v);
  }
  const OutputBuffers f32 = make_outputs(p);
  const OutputBuffers f64 = make_outputs(p, DType::f64, DType::f64, DType::f64);
  const IndexerBackwardOutputs out{on_cuda(f32.d_index_q.view()), on_cuda(f32.d_weights.view()),
                                   on_cuda(f64.d_index_k.view())};
  EXPECT_EQ(cuda_validation_error([&] { indexer_backward(in, out, opt); }),
            "d_index_k: expected dtype bf16 or f32 on the cuda backend (f64 on the cpu backend only), got dtype f64");
  TargetSpec s;
  s.heads = 16, s.head_dim = 64;
  const TargetProblem t = make_target_problem(s);
  AttentionTargetOptions topt;
  topt.backend = Backend::cuda;
  topt.sm_scale = t.sm_scale;
  AttentionTargetInputs tin = t.inputs();
  tin.query = on_cuda(tin.query), tin.kv = on_cuda(tin.kv), tin.lse = on_cuda(tin.lse);
  tin.topk_indices = on_cuda(tin.topk_indices);
  HostTensor T(DType::f64, t.topk_indices.shape);
  EXPECT_EQ(cuda_validation_error([&] { attention_target(tin, {on_cuda(T.view())}, topt); }),
            "attn_score: expected dtype f32 on the cuda backend (f64 on the cpu backend only), got dtype f64");
}

}  // namespace
}  // namespace dsaib::test
