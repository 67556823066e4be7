// A NaN in one input reaches the loss and the gradients as torch's float64
// autograd takes it (docs/math.md, "NaN and infinities"): relu(NaN) = NaN, and
// relu's derivative passes a NaN logit. The expected NaN masks follow torch's
// rule, computed here from the inputs; python/tests/test_nan_propagation.py
// checks the same against torch itself.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "dsaib/indexer_backward.hpp"
#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

constexpr uint16_t kBf16Nan = 0x7fc0;

struct Masks {
  bool loss = false;
  std::vector<bool> dq, dw, dk;
};

/// torch's NaN masks for the problem (every slot valid or invalid by its id;
/// P >= eps wherever T is NaN in these problems).
Masks torch_masks(const GeneratedProblem& p) {
  const auto q = to_doubles(p.index_q), w = to_doubles(p.weights), k = to_doubles(p.index_k);
  const auto T = to_doubles(p.attn_score);
  const int64_t R = num_q_rows(p), K = topk(p), H = p.spec.heads, D = p.spec.head_dim;
  Masks m;
  m.dq.assign(R * H * D, false), m.dw.assign(R * H, false), m.dk.assign(num_k_rows(p) * D, false);
  for (int64_t r = 0; r < R; ++r) {
    int64_t begin = 0, end = 0;
    key_range(p, r, &begin, &end);
    bool row_nan = false;
    std::vector<double> x(H * K, 0.0);
    for (int64_t i = 0; i < K; ++i) {
      if (!slot_valid(p, r, i)) continue;
      const int64_t kr = begin + get_id(p, r, i);
      double z = 0;
      for (int64_t h = 0; h < H; ++h) {
        double xh = 0;
        for (int64_t d = 0; d < D; ++d) xh += q[(r * H + h) * D + d] * k[kr * D + d];
        x[h * K + i] = xh;
        z += w[r * H + h] * (xh < 0 ? 0.0 : xh);
      }
      row_nan = row_nan || std::isnan(z) || std::isnan(T[r * K + i]);
    }
    if (!row_nan) continue;
    m.loss = true;
    for (int64_t h = 0; h < H; ++h) m.dw[r * H + h] = true;
    for (int64_t i = 0; i < K; ++i) {
      if (!slot_valid(p, r, i)) continue;
      const int64_t kr = begin + get_id(p, r, i);
      for (int64_t h = 0; h < H; ++h) {
        if (x[h * K + i] <= 0) continue;  // torch's relu backward: 0 exactly
        for (int64_t d = 0; d < D; ++d) m.dq[(r * H + h) * D + d] = m.dk[kr * D + d] = true;
      }
    }
  }
  return m;
}

void expect_masks(const std::string& what, const HostTensor& got, const std::vector<bool>& want) {
  const auto v = to_doubles(got);
  ASSERT_EQ(v.size(), want.size()) << what;
  int nan = 0, wrong = 0;
  for (size_t e = 0; e < v.size(); ++e) {
    nan += want[e];
    if (std::isnan(v[e]) != want[e]) ++wrong;
  }
  EXPECT_GT(nan, 0) << what << ": the case must make some entries NaN";
  EXPECT_LT(nan, static_cast<int>(v.size())) << what << ": and leave some finite";
  EXPECT_EQ(wrong, 0) << what << ": " << wrong << " entries NaN where torch's are not, or finite where torch's are NaN";
}

GeneratedProblem nan_problem(const std::string& where) {
  GenerateSpec s = small_spec(91);
  s.batch = 1, s.s_q = 6, s.s_kv = 16, s.topk = 3, s.heads = 8, s.head_dim = 64;
  s.ids = IdPattern::random_permutation;
  GeneratedProblem p = make_problem(s);
  if (where == "index_q") p.index_q.data<uint16_t>()[(2 * 8 + 3) * 64 + 5] = kBf16Nan;
  if (where == "weights") p.weights.data<uint16_t>()[2 * 8 + 4] = kBf16Nan;
  if (where == "index_k") p.index_k.data<uint16_t>()[get_id(p, 1, 0) * 64 + 7] = kBf16Nan;
  if (where == "attn_score") p.attn_score.data<float>()[3 * 3 + 1] = std::numeric_limits<float>::quiet_NaN();
  refresh_index_score(p);
  return p;
}

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
