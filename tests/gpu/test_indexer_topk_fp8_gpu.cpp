// The top-k forward's float8 e4m3 kernel (label gpu): random e4m3 index_q and
// index_k with and without their scales (negative ones too), BSHD and THD,
// causal rows and ranges, H 32 / 64 / 128 at D 128, judged by
// check_indexer_topk against the fp64 reference (tests/support/topk_check.hpp's
// problems); buffer cuts and ring wraps; bitwise determinism. Without a compute-capability-9.0 GPU every
// test is SKIPPED (never passed).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dsaib/indexer_topk.hpp"
#include "gpu/device_problem.hpp"
#include "support/topk_check.hpp"

namespace dsaib::test {
namespace {

class IndexerTopkFp8Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  }
};

/// The problem's inputs on the device, run on the cuda backend; host copies of the outputs.
struct Fp8Run {
  HostTensor ids, logits, lengths;
};

Fp8Run run_cuda(const TopkProblem& p, int64_t topk) {
  const DeviceTensor q(p.index_q), w(p.weights), k(p.index_k), st(p.starts), en(p.ends), cq(p.cu_q), ck(p.cu_k),
      qs(p.index_q_scale), ks(p.index_k_scale);
  DeviceTensor ids(DType::i32, p.out_shape(topk)), logits(DType::f32, p.out_shape(topk)),
      lengths(DType::i32, p.row_shape());
  ids.fill_bytes(0x7f);
  logits.fill_bytes(0xff);
  lengths.fill_bytes(0x7f);
  IndexerTopkInputs in{q.view, w.view, k.view, st.view, en.view, cq.view, ck.view, qs.view, ks.view};
  if (p.spec.layout == Layout::bshd) in.cu_seqlens_q = in.cu_seqlens_k = TensorView{};
  IndexerTopkOptions opt = p.options();
  opt.backend = Backend::cuda;
  indexer_topk(in, {ids.view, logits.view, lengths.view}, opt);
  check_cuda(cudaDeviceSynchronize(), "indexer_topk (e4m3)");
  return {ids.to_host(), logits.to_host(), lengths.to_host()};
}

void expect_checked(const TopkProblem& p, const Fp8Run& r, const std::string& what) {
  const TopkCheck c = check_indexer_topk(p.inputs(), p.options(), {r.ids.view(), r.logits.view(), r.lengths.view()});
  EXPECT_TRUE(c.pass) << what << ": " << c.first_failure << " (exchanged ids " << c.exchanged_ids
                      << ", max logit error " << c.max_logit_error << " bounds)";
  EXPECT_EQ(c.rows, p.rows) << what;
}

TopkSpec fp8_spec(Layout layout, int64_t heads, uint64_t seed) {
  TopkSpec s = layout == Layout::thd ? thd_spec(TopkSpec{}) : TopkSpec{};
  if (layout == Layout::thd) {
    s.q_lens = {70, 0, 130, 9};
    s.k_lens = {200, 40, 300, 0};
  } else {
    s.batch = 2, s.s_q = 96, s.s_kv = 400;
  }
  s.e4m3 = true, s.heads = heads, s.head_dim = 128, s.topk = 100, s.seed = seed;
  return s;
}

TEST_F(IndexerTopkFp8Gpu, MatchesTheFp64Reference) {
  for (Layout layout : {Layout::bshd, Layout::thd}) {
    for (int64_t heads : {32, 64, 128}) {
      for (int scales = 0; scales < 3; ++scales) {
        TopkSpec s = fp8_spec(layout, heads, 1000 + heads + scales);
        s.q_scale = scales == 0, s.k_scale = scales < 2, s.ranges = scales == 1;
        const TopkProblem p = make_topk_problem(s);
        expect_checked(p, run_cuda(p, s.topk), std::string(layout_name(layout)) + " H" + std::to_string(heads) +
                                                   " scales " + std::to_string(scales));
      }
    }
  }
}

TEST_F(IndexerTopkFp8Gpu, NegativeScalesAndBitwiseDeterminism) {
  TopkSpec s = fp8_spec(Layout::bshd, 64, 77);
  s.negative_scales = true;
  const TopkProblem p = make_topk_problem(s);
  const Fp8Run a = run_cuda(p, s.topk), b = run_cuda(p, s.topk);
  expect_checked(p, a, "negative scales");
  EXPECT_TRUE(bitwise_equal(a.ids, b.ids));
  EXPECT_TRUE(bitwise_equal(a.logits, b.logits));
}

// Enough keys per row for the candidate buffers to be cut many times (topk 1
// and 129: buffers of 320 and 322 keys), more tasks than CTAs and more tiles
// per task than K stages, so both rings wrap.
TEST_F(IndexerTopkFp8Gpu, BufferCutsAndRingWraps) {
  for (int64_t topk : {1, 129}) {
    TopkSpec s = fp8_spec(Layout::bshd, 64, 300 + topk);
    s.batch = 1, s.s_q = 540, s.s_kv = 1536, s.topk = topk;
    const TopkProblem p = make_topk_problem(s);
    expect_checked(p, run_cuda(p, topk), "topk " + std::to_string(topk));
  }
}

TEST(Sanitized, IndexerTopkFp8) {
  if (!gpu_available()) GTEST_SKIP() << "no compute-capability-9.0 GPU visible";
  const TopkProblem p = make_topk_problem(fp8_spec(Layout::thd, 64, 5));
  expect_checked(p, run_cuda(p, p.spec.topk), "sanitized");
}

}  // namespace
}  // namespace dsaib::test
