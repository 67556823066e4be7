// The start-delay plan of the persistent CTAs (src/hopper/start_stagger.hpp, v44).
#include <gtest/gtest.h>

#include <set>

#include "hopper/start_stagger.hpp"

namespace {

using dsaib::hopper::start_delay_ns;
using dsaib::hopper::start_stagger_for_launch;

TEST(StartStagger, DeepSeekShapeDelaysOnlyTheCtasWithATaskFewer) {
  // B1 S 4096 H64: 4096 tasks on 132 CTAs = 31 waves and 4 tasks more.
  const auto s = start_stagger_for_launch(4096, 132, 2048, 128);
  EXPECT_EQ(s.first_delayed_cta, 4);
  // about half of a task (~47.6 us at 0.176 ns per slot and row, 132 CTAs)
  EXPECT_NEAR(s.max_ns, 0.5 * 0.176 * 132 * 2048, 1.0);
  for (int b = 0; b < 4; ++b) EXPECT_EQ(start_delay_ns(s, b), 0u) << "CTA " << b;
  std::set<uint32_t> delays;
  for (int b = 4; b < 132; ++b) {
    const uint32_t d = start_delay_ns(s, b);
    EXPECT_LT(d, s.max_ns) << "CTA " << b;
    delays.insert(d);
  }
  EXPECT_EQ(delays.size(), 32u);  // the 32 steps of the spread are all used
  EXPECT_EQ(*delays.begin(), 0u);
}

TEST(StartStagger, NoDelayWithoutSlack) {
  EXPECT_EQ(start_stagger_for_launch(132, 132, 2048, 128).max_ns, 0u);        // one full wave
  EXPECT_EQ(start_stagger_for_launch(100, 132, 2048, 128).max_ns, 0u);        // one partial wave
  EXPECT_EQ(start_stagger_for_launch(132 * 31, 132, 2048, 128).max_ns, 0u);   // equal waves
  EXPECT_EQ(start_stagger_for_launch(4096, 0, 2048, 128).max_ns, 0u);         // no grid
  const auto none = start_stagger_for_launch(132 * 31, 132, 2048, 128);
  for (int b = 0; b < 132; ++b) EXPECT_EQ(start_delay_ns(none, b), 0u);
}

TEST(StartStagger, ScalesWithTheTaskAndIsCapped) {
  const auto d128 = start_stagger_for_launch(16384, 132, 2048, 128);
  const auto d64 = start_stagger_for_launch(16384, 132, 2048, 64);
  const auto k512 = start_stagger_for_launch(16384, 132, 512, 128);
  EXPECT_EQ(d128.first_delayed_cta, 16384 % 132);
  EXPECT_LT(d64.max_ns, d128.max_ns);
  EXPECT_NEAR(static_cast<double>(k512.max_ns) * 4, static_cast<double>(d128.max_ns), 4.0);
  EXPECT_EQ(start_stagger_for_launch(16384, 132, 1 << 30, 128).max_ns, 1000000u);  // at most 1 ms
}

TEST(StartStagger, ShortSequencesGetADelaySizedForTheirKeys) {
  // topk 2048 over sequences of 256 keys: at most 256 valid slots per row, so the
  // delay is sized for 256 slots (the launcher passes min(topk, longest k_len)).
  const auto s = start_stagger_for_launch(16384, 132, 256, 128);
  EXPECT_NEAR(s.max_ns, 0.5 * 0.176 * 132 * 256, 1.0);
  EXPECT_LT(s.max_ns, start_stagger_for_launch(16384, 132, 2048, 128).max_ns / 7);
  EXPECT_EQ(start_stagger_for_launch(16384, 132, 0, 128).max_ns, 0u);  // no key at all
}

}  // namespace
