// A NaN in one input reaches the loss and the gradients as torch's float64
// autograd takes it (docs/math.md, "NaN and infinities"): relu(NaN) = NaN, and
// relu's derivative passes a NaN logit. The expected NaN masks follow torch's
// rule, computed here from the inputs; python/tests/test_nan_propagation.py
// checks the same against torch itself.
#include <gtest/gtest.h>

#include <cmath>

#include "dsaib/indexer_backward.hpp"
#include "support/nan_cases.hpp"

namespace dsaib::test {
namespace {

class NanPropagation : public ::testing::TestWithParam<const char*> {};

TEST_P(NanPropagation, LossAndGradientsAreNanWhereTorchsAre) {
  const GeneratedProblem p = nan_problem(GetParam());
  for (int64_t r = 0; r < num_q_rows(p); ++r) {
    for (int64_t i = 0; i < topk(p); ++i) ASSERT_TRUE(slot_valid(p, r, i)) << "every slot valid in these cases";
  }
  const Masks want = torch_masks(p);
  ASSERT_TRUE(want.loss);
  EXPECT_TRUE(std::isnan(indexer_kl_loss(p.inputs(), p.options(), /*recompute_p=*/true)));
  const OutputBuffers o = run_cpu(p, p.options());
  const std::string at = std::string("NaN in ") + GetParam();
  expect_masks(at + ", d_index_q", o.d_index_q, want.dq);
  expect_masks(at + ", d_weights", o.d_weights, want.dw);
  expect_masks(at + ", d_index_k", o.d_index_k, want.dk);
}

INSTANTIATE_TEST_SUITE_P(Inputs, NanPropagation, ::testing::Values("index_q", "weights", "index_k", "attn_score"));

}  // namespace
}  // namespace dsaib::test
