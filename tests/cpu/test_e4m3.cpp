// The float8 e4m3 ("fn") conversions of the host side (src/core/e4m3.hpp):
// every code against the format written out (tests/support/topk_check.hpp),
// round trips, round-to-nearest-even ties, the range's edge (448, saturation
// beyond it), subnormals, doubles rounded to float first, and a table of
// torch's float8_e4m3fn conversions; the dtype's name, size, element access
// and a safetensors round trip.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "core/e4m3.hpp"
#include "core/element_access.hpp"
#include "dsaib/safetensors.hpp"
#include "support/topk_check.hpp"

namespace dsaib::test {
namespace {

using detail::double_to_e4m3;
using detail::e4m3_to_double;

TEST(E4m3, EveryCodeDecodesAsTheFormatSays) {
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3_value(static_cast<uint8_t>(c)), got = e4m3_to_double(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      EXPECT_TRUE((c & 0x7f) == 0x7f) << c;
    } else {
      EXPECT_EQ(got, want) << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << c;  // -0 too
    }
  }
  EXPECT_EQ(e4m3_to_double(0x7e), 448.0);
  EXPECT_EQ(e4m3_to_double(0x01), std::ldexp(1.0, -9));
  EXPECT_EQ(e4m3_to_double(0x38), 1.0);
}

TEST(E4m3, EveryValueRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    EXPECT_EQ(double_to_e4m3(e4m3_to_double(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(E4m3, RoundsToNearestEven) {
  for (int c = 0; c < 0x7e; ++c) {  // each gap between two positive finite codes
    const double lo = e4m3_to_double(static_cast<uint8_t>(c)), hi = e4m3_to_double(static_cast<uint8_t>(c + 1));
    const double mid = (lo + hi) / 2;
    EXPECT_EQ(double_to_e4m3(mid), (c % 2 == 0) ? c : c + 1) << "tie above code " << c;
    // the floats next to the tie (a double that close rounds to the tie as a float first)
    const float below = std::nextafter(static_cast<float>(mid), static_cast<float>(lo));
    const float above = std::nextafter(static_cast<float>(mid), static_cast<float>(hi));
    EXPECT_EQ(double_to_e4m3(below), c) << c;
    EXPECT_EQ(double_to_e4m3(above), c + 1) << c;
    EXPECT_EQ(double_to_e4m3(-above), 0x80 | (c + 1)) << c;
  }
}

TEST(E4m3, BeyondTheRangeSaturates) {
  EXPECT_EQ(double_to_e4m3(448.0), 0x7e);
  EXPECT_EQ(double_to_e4m3(464.0), 0x7e);  // the tie with the NaN code goes to the even 448
  EXPECT_EQ(double_to_e4m3(std::nextafter(464.0f, 1e9f)), 0x7e);
  EXPECT_EQ(double_to_e4m3(-1e9), 0xfe);
  EXPECT_EQ(double_to_e4m3(std::numeric_limits<double>::infinity()), 0x7e);
  EXPECT_EQ(double_to_e4m3(std::numeric_limits<double>::quiet_NaN()) & 0x7f, 0x7f);
  EXPECT_EQ(double_to_e4m3(std::ldexp(1.0, -10)), 0x00);      // the tie between 0 and the least subnormal
  EXPECT_EQ(double_to_e4m3(3 * std::ldexp(1.0, -10)), 0x02);  // between 1 and 2 subnormal steps: to 2
  EXPECT_EQ(double_to_e4m3(-0.0), 0x80);
}

// x.to(torch.float8_e4m3fn) of float64 tensors, torch 2.15: a double is rounded
// to float, then to e4m3; beyond 448 (and +-inf) saturates to +-448.
TEST(E4m3, EqualsTorchsConversion) {
  const double kInf = std::numeric_limits<double>::infinity();
  const struct {
    double x;
    int code;
  } torch_codes[] = {
      {1.0625 + 0x1p-40, 0x38},  // just above a tie in double, the tie itself in float: to even
      {1.0625 - 0x1p-40, 0x38},
      {1.1875 - 0x1p-40, 0x3a},
      {0x1p-10 + 0x1p-60, 0x00},
      {0x3p-10 - 0x1p-60, 0x02},
      {240.0 * (1 + 0x1p-30), 0x77},
      {0.0625, 0x18},
      {-0.0, 0x80},
      {0x1p-9, 0x01},
      {0x1p-10, 0x00},
      {0x3p-10, 0x02},
      {0x1p-11, 0x00},
      {0x1p-6 - 0x1p-11, 0x08},
      {1e-300, 0x00},
      {448.0, 0x7e},
      {449.0, 0x7e},
      {464.0, 0x7e},
      {464.0 + 0x1p-30, 0x7e},
      {465.0, 0x7e},
      {479.0, 0x7e},
      {480.0, 0x7e},
      {1e9, 0x7e},
      {-1e9, 0xfe},
      {1e300, 0x7e},
      {-1e300, 0xfe},
      {kInf, 0x7e},
      {-kInf, 0xfe},
      {0.3, 0x2a},
      {-3.7, 0xc7},
      {100.0, 0x6c},
      {-300.0, 0xf9},
  };
  for (const auto& t : torch_codes) EXPECT_EQ(double_to_e4m3(t.x), t.code) << std::hexfloat << t.x;
  EXPECT_EQ(double_to_e4m3(std::numeric_limits<double>::quiet_NaN()), 0x7f);
  EXPECT_EQ(double_to_e4m3(-std::numeric_limits<double>::quiet_NaN()), 0xff);
}

TEST(E4m3, IsADTypeOfOneByte) {
  EXPECT_EQ(dtype_size(DType::e4m3), 1u);
  EXPECT_STREQ(dtype_name(DType::e4m3), "e4m3");
  HostTensor t(DType::e4m3, {2, 3});
  for (int64_t e = 0; e < t.numel(); ++e) detail::store_element(DType::e4m3, t.bytes.data(), e, 0.5 * double(e) - 1);
  for (int64_t e = 0; e < t.numel(); ++e) EXPECT_EQ(detail::load_element(DType::e4m3, t.bytes.data(), e), 0.5 * double(e) - 1);
  const std::string path = ::testing::TempDir() + "dsaib_e4m3.safetensors";
  write_safetensors(path, {{"x", t}});
  const auto back = read_safetensors(path);
  std::remove(path.c_str());
  ASSERT_EQ(back.at("x").dtype, DType::e4m3);
  EXPECT_EQ(back.at("x").bytes, t.bytes);
}

}  // namespace
}  // namespace dsaib::test
