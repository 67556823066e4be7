// check_indexer_topk's negative controls: it fails on a clearly worse key, a
// duplicate id, a wrong order, a wrong count and a logit outside its bound; it
// passes the cpu backend, a near-tie exchange within the bounds, and a
// selection computed in fp32 as the cuda backend computes it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/bf16.hpp"
#include "dsaib/indexer_topk.hpp"
#include "support/test_support.hpp"
#include "support/topk_check.hpp"

namespace dsaib::test {
namespace {

struct CheckerFixture {
  TopkProblem p;
  TopkOutputs out;
  IndexerTopkOptions opt;
  CheckerFixture(TopkOrder order = TopkOrder::logit_descending)
      : p(make_topk_problem([&] {
          TopkSpec s;
          s.batch = 1, s.s_q = 4, s.s_kv = 40, s.topk = 6, s.causal_offset = 100, s.order = order, s.seed = 77;
          return s;
        }())),
        out(p, 6), opt(p.options()) {
    indexer_topk(p.inputs(), out.views(), opt);
  }
  int32_t* ids(int64_t r) { return out.ids.data<int32_t>() + r * 6; }
  float* logits(int64_t r) { return out.logits.data<float>() + r * 6; }
  TopkCheck check(bool with_logits = true) {
    return check_indexer_topk(p.inputs(), opt, {out.ids.view(), with_logits ? out.logits.view() : TensorView{}, out.lengths.view()});
  }
};

TEST(TopkChecker, AcceptsTheCpuBackend) {
  CheckerFixture f;
  EXPECT_TRUE(f.check().pass) << f.check().first_failure;
  CheckerFixture g(TopkOrder::id_ascending);
  EXPECT_TRUE(g.check().pass) << g.check().first_failure;
}

TEST(TopkChecker, FailsOnAClearlyWorseKey) {
  for (bool with_logits : {true, false}) {
    CheckerFixture f;
    // the row's worst key, far below its k-th
    const BruteTopk all = brute_force_topk(f.p, f.opt, 40);
    const int32_t worst = all.ids[1 * 40 + 39];
    f.ids(1)[3] = worst;
    f.logits(1)[3] = float(all.logits[1 * 40 + 39]);
    std::vector<std::pair<int32_t, float>> row;  // keep the candidate's own order valid
    for (int i = 0; i < 6; ++i) row.push_back({f.ids(1)[i], f.logits(1)[i]});
    std::sort(row.begin(), row.end(), [](auto a, auto b) { return a.second > b.second; });
    for (int i = 0; i < 6; ++i) f.ids(1)[i] = row[i].first, f.logits(1)[i] = row[i].second;
    const TopkCheck c = f.check(with_logits);
    EXPECT_FALSE(c.pass);
    EXPECT_NE(c.first_failure.find("row 1"), std::string::npos) << c.first_failure;
    EXPECT_NE(c.first_failure.find("near-tie"), std::string::npos) << c.first_failure;
  }
}

TEST(TopkChecker, FailsOnADuplicateId) {
  CheckerFixture f;
  f.ids(2)[4] = f.ids(2)[1];
  const TopkCheck c = f.check(false);
  EXPECT_FALSE(c.pass);
  EXPECT_NE(c.first_failure.find("distinct"), std::string::npos) << c.first_failure;
}

TEST(TopkChecker, FailsOnAWrongOrder) {
  {
    CheckerFixture f;
    std::swap(f.ids(0)[0], f.ids(0)[1]);
    std::swap(f.logits(0)[0], f.logits(0)[1]);
    EXPECT_FALSE(f.check(true).pass);
    EXPECT_FALSE(f.check(false).pass);
  }
  {
    CheckerFixture f(TopkOrder::id_ascending);
    std::swap(f.ids(3)[2], f.ids(3)[4]);
    const TopkCheck c = f.check(false);
    EXPECT_FALSE(c.pass);
    EXPECT_NE(c.first_failure.find("ids ascending"), std::string::npos) << c.first_failure;
  }
  {  // the candidate in id order while logit order is asked
    CheckerFixture f(TopkOrder::id_ascending);
    f.opt.order = TopkOrder::logit_descending;
    EXPECT_FALSE(f.check(true).pass);
  }
}

TEST(TopkChecker, FailsOnAWrongCount) {
  {
    CheckerFixture f;
    f.out.lengths.data<int32_t>()[1] = 5;
    EXPECT_FALSE(f.check().pass);
  }
  {
    CheckerFixture f;
    f.ids(1)[5] = -1;  // one key short, count left as it is
    f.logits(1)[5] = -INFINITY;
    EXPECT_FALSE(f.check().pass);
    f.out.lengths.data<int32_t>()[1] = 5;
    EXPECT_FALSE(f.check().pass);
  }
  {
    CheckerFixture f;
    f.ids(0)[1] = 3;  // row 0 sees keys [0, 37): an id past the visible range
    EXPECT_FALSE(f.check(false).pass);
  }
}

TEST(TopkChecker, FailsOnALogitOutsideItsBound) {
  CheckerFixture f;
  f.logits(2)[2] = f.logits(2)[2] * (1.0f + 1e-3f);
  const TopkCheck c = f.check();
  EXPECT_FALSE(c.pass);
  EXPECT_EQ(c.max_logit_error_rows, 1);
  EXPECT_GT(c.max_logit_error, 1.0);
  CheckerFixture g;
  g.logits(2)[5] = NAN;
  EXPECT_FALSE(g.check().pass);
}

// Two keys whose exact logits differ by less than their bounds: either may be
// selected (a cuda result may differ so); a third clearly apart may not.
TEST(TopkChecker, AcceptsANearTieExchange) {
  TopkSpec s;
  s.batch = 1, s.s_q = 1, s.s_kv = 8, s.heads = 1, s.head_dim = 8, s.topk = 2, s.causal_offset = 100;
  TopkProblem p = make_topk_problem(s);
  const int64_t D = 8;
  p.weights.data<float>()[0] = 1.0f;
  for (int64_t d = 0; d < D; ++d) p.q_bits()[d] = detail::float_to_bf16(1.0f);
  for (int64_t j = 0; j < 8; ++j) {
    for (int64_t d = 0; d < D; ++d) p.k_bits()[j * D + d] = detail::float_to_bf16(0.125f * float(j) / 8.0f);
  }
  for (int64_t d = 0; d < D; ++d) p.k_bits()[6 * D + d] = p.k_bits()[5 * D + d] = detail::float_to_bf16(0.5f);
  p.k_bits()[6 * D + 7] = detail::float_to_bf16(std::ldexp(1.0f, -20));  // key 6 above key 5 by 2^-20 - ... < beta
  p.k_bits()[5 * D + 7] = detail::float_to_bf16(std::ldexp(1.0f, -21));
  p.k_bits()[7 * D + 0] = detail::float_to_bf16(4.0f);  // key 7 the clear best
  TopkOutputs out(p, 2);
  indexer_topk(p.inputs(), out.views(), p.options());
  ASSERT_EQ(out.ids.data<int32_t>()[0], 7);
  ASSERT_EQ(out.ids.data<int32_t>()[1], 6);
  const ReferenceTopk ref = reference_indexer_topk(p.inputs(), p.options(), 2);
  EXPECT_LT(definition_logit(p, 0, 6) - definition_logit(p, 0, 5), ref.topk_bounds[1]);
  out.ids.data<int32_t>()[1] = 5;  // the near-tie exchanged
  TopkCheck c = check_indexer_topk(p.inputs(), p.options(), out.views());
  EXPECT_TRUE(c.pass) << c.first_failure;
  EXPECT_EQ(c.exchanged_ids, 1);
  out.ids.data<int32_t>()[1] = 4;  // 0.0546875 * 8 vs 0.5 * 7: far outside the bounds
  out.logits.data<float>()[1] = float(definition_logit(p, 0, 4));
  c = check_indexer_topk(p.inputs(), p.options(), out.views());
  EXPECT_FALSE(c.pass);
}

// The cpu backend ranks by fp64 logits and writes f32 ones: two keys whose
// fp64 logits differ below f32's resolution come back as equal f32 logits in
// their fp64 order, which the checker accepts from the cpu backend; the other
// order of the same two keys is refused.
TEST(TopkChecker, AcceptsCpuLogitsTiedOnlyByTheirF32Rounding) {
  for (int larger : {0, 1}) {
    TopkSpec s;
    s.batch = 1, s.s_q = 1, s.s_kv = 2, s.heads = 1, s.head_dim = 2, s.topk = 2, s.causal_offset = 100;
    TopkProblem p = make_topk_problem(s);
    p.weights.data<float>()[0] = 1.0f;
    const uint16_t one = detail::float_to_bf16(1.0f);
    p.q_bits()[0] = p.q_bits()[1] = one;
    // I = 1 + 2^-39 for key `larger`, 1 + 2^-40 for the other: both 1.0f in f32
    p.k_bits()[0] = p.k_bits()[2] = one;
    p.k_bits()[2 * larger + 1] = detail::float_to_bf16(std::ldexp(1.0f, -39));
    p.k_bits()[2 * (1 - larger) + 1] = detail::float_to_bf16(std::ldexp(1.0f, -40));
    TopkOutputs out(p, 2);
    IndexerTopkOptions opt = p.options();
    opt.backend = Backend::cpu;
    indexer_topk(p.inputs(), out.views(), opt);
    int32_t* ids = out.ids.data<int32_t>();
    ASSERT_EQ(ids[0], larger);
    ASSERT_EQ(ids[1], 1 - larger);
    ASSERT_EQ(out.logits.data<float>()[0], out.logits.data<float>()[1]);
    const TopkCheck c = check_indexer_topk(p.inputs(), opt, out.views());
    EXPECT_TRUE(c.pass) << "larger " << larger << ": " << c.first_failure;
    // ids descending under equal f32 logits: right only where fp64 ranks them so
    ids[0] = 1, ids[1] = 0;
    const TopkCheck d = check_indexer_topk(p.inputs(), opt, out.views());
    EXPECT_EQ(d.pass, larger == 1) << d.first_failure;
    if (larger == 0) {
      EXPECT_NE(d.first_failure.find("the candidate's logits descending, equal ones by id"), std::string::npos)
          << d.first_failure;
    }
  }
}

// A selection computed as the cuda backend computes it (fp32 accumulation of
// the bf16 products, here in reverse order, f32 weights and sum): it may
// differ from the fp64 one only by near-ties, and its f32 logits lie within
// their bounds, so the checker accepts it.
TEST(TopkChecker, AcceptsAnFp32Selection) {
  int64_t exchanged = 0;
  for (uint64_t seed : {101, 102, 103, 104, 105, 106}) {
    TopkSpec s;
    s.batch = 1, s.s_q = 16, s.s_kv = 700, s.heads = 16, s.head_dim = 64, s.topk = 95, s.causal_offset = 684, s.seed = seed;
    TopkProblem p = make_topk_problem(s);
    // Exact ties that fp32 rounds apart: pairs of keys with elements 0 and 1
    // swapped, against queries whose elements 0 and 1 are equal; element 2
    // (8 * 8) makes each dot large, so that the last two products (d = 1, 0)
    // are rounded as they are added, in either order.
    for (int64_t e = 0; e < p.index_q.numel(); e += 64) {
      p.q_bits()[e + 1] = p.q_bits()[e];
      p.q_bits()[e + 2] = detail::float_to_bf16(8.0f);
    }
    for (int64_t e = 0; e < p.index_k.numel(); e += 64) p.k_bits()[e + 2] = detail::float_to_bf16(8.0f);
    for (int64_t j = 0; j + 1 < 700; j += 2) {
      for (int64_t d = 0; d < 64; ++d) p.k_bits()[(j + 1) * 64 + d] = p.k_bits()[j * 64 + (d < 2 ? 1 - d : d)];
    }
    const int64_t H = 16, D = 64, K = 95;  // odd: the k-th boundary splits a tied pair
    TopkOutputs out(p, K);
    for (int64_t r = 0; r < p.rows; ++r) {
      const int64_t hi = std::min<int64_t>(700, r + 684 + 1);
      std::vector<std::pair<float, int32_t>> keys;
      for (int64_t j = 0; j < hi; ++j) {
        float sum = 0.0f;
        for (int64_t h = 0; h < H; ++h) {
          float dot = 0.0f;
          for (int64_t d = D - 1; d >= 0; --d) {
            dot += detail::bf16_to_float(p.q_bits()[(r * H + h) * D + d]) * detail::bf16_to_float(p.k_bits()[j * D + d]);
          }
          sum += p.weights.data<float>()[r * H + h] * std::max(dot, 0.0f);
        }
        keys.push_back({sum, int32_t(j)});
      }
      std::sort(keys.begin(), keys.end(), [](auto a, auto b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
      for (int64_t i = 0; i < K; ++i) {
        out.ids.data<int32_t>()[r * K + i] = keys[i].second;
        out.logits.data<float>()[r * K + i] = keys[i].first;
      }
      out.lengths.data<int32_t>()[r] = int32_t(K);
    }
    const TopkCheck c = check_indexer_topk(p.inputs(), p.options(), out.views());
    EXPECT_TRUE(c.pass) << "seed " << seed << ": " << c.first_failure;
    EXPECT_LE(c.max_logit_error, 1.0);
    EXPECT_GT(c.max_logit_error, 0.0) << "fp32 logits should differ from fp64 ones somewhere";
    exchanged += c.exchanged_ids;
    // Each logit moved by twice its bound: refused.
    const ReferenceTopk ref = reference_indexer_topk(p.inputs(), p.options(), K);
    for (int64_t i = 0; i < K; ++i) {
      const size_t e = size_t(3 * K + i);
      if (out.ids.data<int32_t>()[e] == ref.topk_indices[e]) {
        out.logits.data<float>()[e] = float(ref.topk_logits[e] + 2 * ref.topk_bounds[e]);
        break;
      }
    }
    EXPECT_FALSE(check_indexer_topk(p.inputs(), p.options(), out.views()).pass);
  }
  EXPECT_GT(exchanged, 0) << "no exact tie rounded apart: the case does not exercise the exchange";
}

}  // namespace
}  // namespace dsaib::test
