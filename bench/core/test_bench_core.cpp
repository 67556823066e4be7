// CPU tests of the benchmark core's pure functions (no GPU is touched): the
// sustained run's launch count and the input-set rotation.
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

}  // namespace
}  // namespace dsaib::bench
