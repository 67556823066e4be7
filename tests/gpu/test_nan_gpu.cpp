// A NaN in one input on the cuda backend (label gpu): the loss and the
// gradients are NaN exactly where torch's float64 autograd puts NaN
// (docs/math.md, "NaN and infinities"; the masks: support/nan_cases.hpp), for
// the backward given P, the loss forward, and the loss and gradients in one
// call. Outputs are NaN-poisoned before each run, so the masks also prove that
// every other element was written with a finite value. Without a
// compute-capability-9.0 GPU every test is SKIPPED (never passed).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include "dsaib/indexer_kl_forward.hpp"
#include "dsaib/indexer_kl_loss_and_grad.hpp"
#include "gpu/device_problem.hpp"
#include "support/nan_cases.hpp"

namespace dsaib::test {
namespace {

class NanPropagationGpu : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  }
  static IndexerOptions cuda_options(const GeneratedProblem& p) {
    IndexerOptions o = p.options();
    o.backend = Backend::cuda;
    return o;
  }
};

TEST_P(NanPropagationGpu, BackwardGivenP) {
  const GeneratedProblem p = nan_problem(GetParam());
  const Masks want = torch_masks(p);
  const OutputBuffers o = run_cuda(p, cuda_options(p), DType::f32, DType::f32, DType::f32);
  const std::string at = std::string("NaN in ") + GetParam();
  expect_masks(at + ", d_index_q", o.d_index_q, want.dq);
  expect_masks(at + ", d_weights", o.d_weights, want.dw);
  expect_masks(at + ", d_index_k", o.d_index_k, want.dk);
}

TEST_P(NanPropagationGpu, LossForwardAndOneCall) {
  const GeneratedProblem p = nan_problem(GetParam());
  const Masks want = torch_masks(p);
  ASSERT_TRUE(want.loss);
  const DeviceProblem d(p);
  IndexerInputs in = d.inputs();
  in.index_score = TensorView{};  // the forward forms P itself
  // One value per query row: (B, S_q) in BSHD, (T_q) in THD, the shape of weights less its head axis.
  const std::vector<int64_t> row_shape(p.weights.shape.begin(), p.weights.shape.end() - 1);

  DeviceTensor loss(DType::f32, {}), row_lse(DType::f32, row_shape), mass(DType::f32, row_shape);
  for (DeviceTensor* t : {&loss, &row_lse, &mass}) t->fill_bytes(0xff);  // NaN
  indexer_kl_forward(in, IndexerKLForwardOutputs{loss.view, row_lse.view, mass.view, TensorView{}}, cuda_options(p));
  check_cuda(cudaDeviceSynchronize(), "indexer_kl_forward");
  EXPECT_TRUE(std::isnan(to_doubles(loss.to_host())[0])) << "the loss forward's loss, NaN in " << GetParam();

  DeviceTensor loss2(DType::f32, {}), dq(DType::f32, p.index_q.shape), dw(DType::f32, p.weights.shape),
      dk(DType::f32, p.index_k.shape);
  for (DeviceTensor* t : {&loss2, &dq, &dw, &dk}) t->fill_bytes(0xff);
  indexer_kl_loss_and_grad(in, IndexerKLLossAndGradOutputs{loss2.view, dq.view, dw.view, dk.view}, cuda_options(p));
  check_cuda(cudaDeviceSynchronize(), "indexer_kl_loss_and_grad");
  const std::string at = std::string("one call, NaN in ") + GetParam();
  EXPECT_TRUE(std::isnan(to_doubles(loss2.to_host())[0])) << at << ": the loss";
  expect_masks(at + ", d_index_q", dq.to_host(), want.dq);
  expect_masks(at + ", d_weights", dw.to_host(), want.dw);
  expect_masks(at + ", d_index_k", dk.to_host(), want.dk);
}

INSTANTIATE_TEST_SUITE_P(Inputs, NanPropagationGpu, ::testing::Values("index_q", "weights", "index_k", "attn_score"));

}  // namespace
}  // namespace dsaib::test
