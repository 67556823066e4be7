// CPU tests of the benchmark core's pure functions (no GPU is touched): the
// sustained run's launch count, the floor formulas, the op words and the top-k's
// counts and case rules.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "bench_core.hpp"
#include "dsaib/error.hpp"

namespace dsaib::bench {
namespace {

TEST(BenchCore, SustainedLaunchesCoverTheTimeWithinTheClamp) {
  EXPECT_EQ(sustained_launches(0.0, 5.0), kSustainedMinLaunches);      // off: the caller skips; at least 20
  EXPECT_EQ(sustained_launches(3000.0, 24.0), 125);                    // ceil(3000 / 24)
  EXPECT_EQ(sustained_launches(3000.0, 23.9), 126);                    // ceil(125.52)
  EXPECT_EQ(sustained_launches(2000.0, 1000.0), kSustainedMinLaunches);  // 2 -> 20
  EXPECT_EQ(sustained_launches(600000.0, 0.001), kSustainedMaxLaunches);  // 6e8 -> 20000
  EXPECT_EQ(sustained_launches(600000.0, std::numeric_limits<double>::denorm_min()), kSustainedMaxLaunches);
  EXPECT_EQ(sustained_launches(1e-300, 1.0), kSustainedMinLaunches);
}

TEST(BenchCore, SustainedLaunchesRejectBadTimes) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (double ms : {-1.0, nan, inf}) {
    try {
      (void)sustained_launches(ms, 1.0);
      ADD_FAILURE() << "sustained_ms " << ms << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_EQ(e.argument(), "sustained_ms");
    }
  }
  for (double launch : {0.0, -1.0, nan, inf}) {
    try {
      (void)sustained_launches(100.0, launch);
      ADD_FAILURE() << "launch_ms " << launch << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_EQ(e.argument(), "launch_ms");
    }
  }
}

TEST(BenchCore, FloorIsTheSlowerOfTheReduceAndTheGemms) {
  // H64 D128 topk 2048 at 3.77 TB/s (kFixedFloorNsPerRow's rate): 2048*128*4 B / 3.77e3 B/ns = 278.1 ns.
  const Floor f = floor_per_row(2048, 64, 128, 3.77, 800.0);
  EXPECT_NEAR(f.scatter_ns, 2048.0 * 512.0 / 3770.0, 1e-9);
  EXPECT_NEAR(f.gemm_ns, 6.0 * 64 * 128 * 2048 / 800e3, 1e-9);  // 125.8 ns
  EXPECT_DOUBLE_EQ(f.ns, f.scatter_ns);
  EXPECT_STREQ(f.bound, "scatter");
  const Floor g = floor_per_row(2048, 256, 128, 3.77, 200.0);  // 4x the heads at a quarter of the rate
  EXPECT_DOUBLE_EQ(g.ns, g.gemm_ns);
  EXPECT_STREQ(g.bound, "gemm");
}

TEST(BenchCore, TrafficFloorIsTheReduceBytesAtTheKeyReadRate) {
  // The same bytes as the floor's reduce, at the rate measured with the key reads.
  EXPECT_NEAR(traffic_floor_ns_per_row(2048, 128, 3.5), 2048.0 * 512.0 / 3500.0, 1e-9);
  EXPECT_NEAR(traffic_floor_ns_per_row(1000.5, 64, 2.0), 1000.5 * 256.0 / 2000.0, 1e-9);
  EXPECT_GT(traffic_floor_ns_per_row(2048, 128, 3.5), floor_per_row(2048, 64, 128, 3.77, 800.0).ns);
  EXPECT_EQ(traffic_floor_ns_per_row(2048, 128, 0.0), 0.0);  // no rate measured
}

TEST(BenchCore, GatherFloorIsTheSlowerOfTheGatherAndGemm1) {
  // H64 D128, 2048 slots at 800 TFLOP/s: GEMM1 2*64*128*2048 / 800e3 = 41.9 ns.
  const ForwardFloor f = forward_floor_per_row(80.0, 2048, 64, 128, 800.0);
  EXPECT_NEAR(f.gemm_ns, 2.0 * 64 * 128 * 2048 / 800e3, 1e-9);
  EXPECT_DOUBLE_EQ(f.ns, 80.0);
  EXPECT_STREQ(f.bound, "gather");
  const ForwardFloor g = forward_floor_per_row(30.0, 2048, 128, 576, 700.0);  // the target's shape: GEMM-bound
  EXPECT_DOUBLE_EQ(g.ns, g.gemm_ns);
  EXPECT_STREQ(g.bound, "gemm");
}

TEST(BenchCore, StepFloorAddsGemm1AndTheGatherToTheBackwardsTerms) {
  const StepFloor f = step_floor_per_row(2048, 64, 128, 3.77, 800.0, 80.0);
  EXPECT_NEAR(f.scatter_ns, floor_per_row(2048, 64, 128, 3.77, 800.0).scatter_ns, 1e-9);
  EXPECT_NEAR(f.gemm_ns, 8.0 * 64 * 128 * 2048 / 800e3, 1e-9);  // 167.8 ns
  EXPECT_DOUBLE_EQ(f.gather_ns, 80.0);
  EXPECT_DOUBLE_EQ(f.ns, f.scatter_ns);
  EXPECT_STREQ(f.bound, "scatter");
  EXPECT_STREQ(step_floor_per_row(2048, 64, 128, 3.77, 800.0, 400.0).bound, "gather");
  EXPECT_STREQ(step_floor_per_row(2048, 128, 128, 3.77, 200.0, 80.0).bound, "gemm");
}

TEST(BenchCore, OpWordsRoundTrip) {
  for (BenchOp op : kBenchOps) {
    BenchOp parsed = BenchOp::backward;
    EXPECT_TRUE(parse_bench_op(bench_op_name(op), &parsed)) << bench_op_name(op);
    EXPECT_EQ(parsed, op);
  }
  BenchOp unchanged = BenchOp::target;
  EXPECT_FALSE(parse_bench_op("loss", &unchanged));
  EXPECT_EQ(unchanged, BenchOp::target);
  EXPECT_EQ(bench_op_list(), "backward, forward, step, one-call, target, topk");
}

TEST(BenchCore, TopkRangesWordsRoundTrip) {
  for (TopkRanges r : kTopkRanges) {
    TopkRanges parsed = TopkRanges::causal;
    EXPECT_TRUE(parse_topk_ranges(topk_ranges_name(r), &parsed)) << topk_ranges_name(r);
    EXPECT_EQ(parsed, r);
  }
  TopkRanges unchanged = TopkRanges::cp_shard;
  for (const char* word : {"random", "cp_shard", "", "Causal"}) {
    EXPECT_FALSE(parse_topk_ranges(word, &unchanged)) << word;
  }
  EXPECT_EQ(unchanged, TopkRanges::cp_shard);
  EXPECT_EQ(topk_ranges_list(), "causal, cp-shard");
}

TEST(BenchCore, TopkRowsAndVisibleKeys) {
  // causal: S rows, row t sees t + 1 keys; cp-shard: the S/2 rows of the second half, row t
  // seeing S/2 + t + 1 keys. Against the sums written out.
  for (int64_t s : {1, 2, 7, 16384, 131072}) {
    for (TopkRanges r : kTopkRanges) {
      if (r == TopkRanges::cp_shard && s < 2) continue;
      const int64_t q = topk_query_rows(r, s);
      EXPECT_EQ(q, r == TopkRanges::causal ? s : s / 2);
      double sum = 0;
      for (int64_t t = 0; t < q; ++t) sum += static_cast<double>(s - q + t + 1);
      EXPECT_DOUBLE_EQ(topk_visible_keys(r, s), sum) << topk_ranges_name(r) << " S " << s;
    }
  }
  EXPECT_DOUBLE_EQ(topk_visible_keys(TopkRanges::causal, 4), 10.0);   // 1 + 2 + 3 + 4
  EXPECT_DOUBLE_EQ(topk_visible_keys(TopkRanges::cp_shard, 4), 7.0);  // 3 + 4
}

TEST(BenchCore, TopkFloorIsTheLogitFlopsAtTheGemmRate) {
  // H64 D128, a causal row of S 131072 seeing 65536.5 keys on average, at 800 TFLOP/s:
  // 65536.5 * 64 * 128 * 2 / 800e3 ns.
  EXPECT_NEAR(topk_floor_ns_per_row(65536.5, 64, 128, 800.0), 65536.5 * 64 * 128 * 2 / 800e3, 1e-9);
  EXPECT_NEAR(topk_floor_ns_per_row(100, 32, 64, 400.0), 100.0 * 32 * 64 * 2 / 400e3, 1e-12);
  EXPECT_EQ(topk_floor_ns_per_row(100, 32, 64, 0.0), 0.0);  // no rate measured
}

TEST(BenchCore, TopkCaseRulesNeedNoGpu) {
  OpCase c;
  c.op = BenchOp::topk;
  c.seq = 4096;
  c.heads = 64;
  c.dim = 128;
  c.topk = 2048;
  for (TopkRanges r : kTopkRanges) {
    c.ranges = r;
    EXPECT_NO_THROW(check_case(c)) << topk_ranges_name(r);
  }
  auto refused = [](OpCase bad, const char* argument) {
    try {
      check_case(bad);
      ADD_FAILURE() << "accepted: H " << bad.heads << " D " << bad.dim << " topk " << bad.topk << " B " << bad.batch
                    << " S " << bad.seq;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_EQ(e.argument(), argument);
    }
  };
  OpCase bad = c;
  bad.heads = 12;
  refused(bad, "shapes");
  bad = c;
  bad.dim = 96;
  refused(bad, "shapes");
  bad = c;
  bad.topk = 8193;
  refused(bad, "topk");
  bad = c;
  bad.batch = 2;
  refused(bad, "batch");
  bad = c;
  bad.ranges = TopkRanges::cp_shard;
  bad.seq = 1;
  refused(bad, "seq");
}

}  // namespace
}  // namespace dsaib::bench
