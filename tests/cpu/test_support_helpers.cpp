// The test helpers themselves (tests/support): a metric that let NaN pass or a
// snapshot that missed a change would silently weaken every other test.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

TEST(SupportHelpers, CompareNeverPassesNaNOrInf) {
  HostTensor t(DType::f32, {4});
  fill(t, 1.0);
  const std::vector<double> ref = {1, 1, 1, 1};
  EXPECT_TRUE(compare(t, ref).ok(0.0));
  t.data<float>()[2] = std::numeric_limits<float>::quiet_NaN();
  ErrorStats st = compare(t, ref);
  EXPECT_FALSE(st.all_finite);
  EXPECT_FALSE(st.ok(1e300));
  t.data<float>()[2] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(compare(t, ref).ok(1e300));
  fill(t, 1.0);
  EXPECT_FALSE(compare(t, {1, 1, 1}).ok(1e300)) << "size mismatch";
  EXPECT_FALSE(compare(t, {1, 1, std::nan(""), 1}).ok(1e300)) << "NaN reference";
}

TEST(SupportHelpers, CompareMetrics) {
  HostTensor t(DType::bf16, {2});
  t.data<uint16_t>()[0] = 0x3f80;  // 1.0
  t.data<uint16_t>()[1] = 0x4000;  // 2.0
  const ErrorStats st = compare(t, {1.0, 2.5});
  EXPECT_DOUBLE_EQ(st.max_abs, 0.5);
  EXPECT_DOUBLE_EQ(st.max_abs_ref, 2.5);
  EXPECT_DOUBLE_EQ(st.rel_rms, 0.5 / std::sqrt(1 + 6.25));
  HostTensor z(DType::f32, {3});
  EXPECT_TRUE(compare(z, {0, 0, 0}).ok(0.0)) << "0/0 counts as exact";
  z.data<float>()[1] = 1e-30f;
  EXPECT_FALSE(compare(z, {0, 0, 0}).ok(1e300)) << "x/0 is infinite";
}

TEST(SupportHelpers, SnapshotSeesEveryByte) {
  HostTensor t(DType::bf16, {3, 5});
  const Snapshot s(t);
  EXPECT_TRUE(s.unchanged());
  t.bytes.back() ^= 1;
  EXPECT_FALSE(s.unchanged());
  t.bytes.back() ^= 1;
  // A strided view covers from its lowest to its highest element.
  TensorView v = t.view();
  v.shape[1] = 2;
  v.strides[1] = 2;  // elements 0, 2 of each row; last element: 2*5 + 2 = 12
  const Snapshot sv(v);
  t.bytes[12 * 2] ^= 0x80;
  EXPECT_FALSE(sv.unchanged());
  t.bytes[12 * 2] ^= 0x80;
  t.bytes[13 * 2] ^= 0x80;  // outside the view's span
  EXPECT_TRUE(sv.unchanged());
}

TEST(SupportHelpers, StridedCopyRoundTrips) {
  HostTensor t(DType::f32, {2, 3, 4});
  for (int64_t e = 0; e < t.numel(); ++e) t.data<float>()[e] = static_cast<float>(e);
  const StridedCopy c = strided_copy(t, {2, 1, 3}, {1, 2, 0});
  EXPECT_FALSE(c.view.is_contiguous());
  EXPECT_EQ(to_doubles(c.view), to_doubles(t));
  int nan = 0;
  for (double v : to_doubles(c.storage)) nan += std::isnan(v);
  EXPECT_EQ(nan, c.storage.numel() - t.numel()) << "gaps hold NaN";
}

TEST(SupportHelpers, MutationsAndCompaction) {
  GenerateSpec s = small_spec(3);
  s.ids = IdPattern::random_permutation;
  GeneratedProblem p = make_problem(s);
  invalidate_run(p, 30, Where::middle, 4);
  for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(get_id(p, 30, i) == -1, i >= 6 && i < 10) << i;
  invalidate_run(p, 31, Where::end, 3);
  EXPECT_EQ(get_id(p, 31, 15), -1);
  EXPECT_NE(get_id(p, 31, 12), -1);
  const GeneratedProblem c = compacted(p);
  EXPECT_EQ(get_id(c, 30, 6), get_id(p, 30, 10));
  EXPECT_EQ(get_id(c, 30, 12), -1);
  const GeneratedProblem g = with_id_mode(p, IdMode::global);
  EXPECT_EQ(get_id(g, 30, 0), get_id(p, 30, 0) + 24);
  EXPECT_EQ(get_id(g, 30, 7), -1);
  EXPECT_TRUE(slot_valid(g, 30, 0));
  EXPECT_FALSE(slot_valid(g, 30, 7));
}

}  // namespace
}  // namespace dsaib::test
