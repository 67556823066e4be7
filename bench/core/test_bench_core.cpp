// CPU tests of the benchmark core's pure functions (no GPU is touched): the
// sustained run's launch count, the floor formulas and the op words.
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
  EXPECT_EQ(bench_op_list(), "backward, forward, step, one-call, target");
}

}  // namespace
}  // namespace dsaib::bench
