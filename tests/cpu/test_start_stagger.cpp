// The start-delay plan of the persistent CTAs (src/hopper/common/start_stagger.hpp) and
// the option's words (IndexerOptions::start_stagger, and ::forward_fusion).
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dsaib/indexer_backward.hpp"
#include "hopper/common/start_stagger.hpp"

namespace {

using dsaib::hopper::fewest_slots_of_tasks;
using dsaib::hopper::kTaskNsPerSlotD128;
using dsaib::hopper::kTaskNsPerSlotD64;
using dsaib::hopper::kTaskShare;
using dsaib::hopper::start_delay_ns;
using dsaib::hopper::start_delays_for_launch;
using dsaib::hopper::StartDelays;
using Lens = std::vector<int64_t>;

StartDelays bshd(int64_t batch, int64_t s, int64_t heads, int64_t topk, int64_t dim, int64_t grid = 132) {
  const int64_t groups = (heads + 63) / 64;
  return start_delays_for_launch(batch * s * groups, grid, groups, topk, Lens(batch, s), Lens(batch, s), dim);
}

TEST(StartStagger, DeepSeekShapeDelaysOnlyTheCtasWithATaskFewer) {
  // B1 S 4096 H64: 4096 tasks on 132 CTAs = 31 waves and 4 tasks more.
  const StartDelays s = bshd(1, 4096, 64, 2048, 128);
  EXPECT_EQ(s.first_delayed_cta, 4);
  EXPECT_EQ(s.max_ns, static_cast<uint32_t>(0.75 * 0.176 * 132 * 2048));  // 3/4 of a task, ~35.7 us
  for (int b = 0; b < 4; ++b) EXPECT_EQ(start_delay_ns(s.max_ns, s.first_delayed_cta, b), 0u) << "CTA " << b;
  // exact steps: (37 b) mod 32 thirty-seconds of max_ns
  EXPECT_EQ(start_delay_ns(s.max_ns, 4, 4), s.max_ns * 20ull / 32);   // 148 mod 32 = 20
  EXPECT_EQ(start_delay_ns(s.max_ns, 4, 5), s.max_ns * 25ull / 32);   // 185 mod 32 = 25
  EXPECT_EQ(start_delay_ns(s.max_ns, 4, 32), 0u);                     // 1184 mod 32 = 0
  EXPECT_EQ(start_delay_ns(s.max_ns, 4, 131), s.max_ns * 15ull / 32); // 4847 mod 32 = 15
  std::set<uint32_t> delays;
  for (int b = 4; b < 132; ++b) {
    const uint32_t d = start_delay_ns(s.max_ns, s.first_delayed_cta, b);
    EXPECT_LT(d, s.max_ns) << "CTA " << b;
    delays.insert(d);
  }
  EXPECT_EQ(delays.size(), 32u);  // all 32 steps of the spread are used
  // neighbouring CTAs are far apart in the spread (37 = 5 mod 32): no run of equal steps
  for (int b = 5; b < 132; ++b) {
    EXPECT_NE(start_delay_ns(s.max_ns, 4, b), start_delay_ns(s.max_ns, 4, b - 1)) << "CTA " << b;
  }
}

TEST(StartStagger, NoDelayWithoutSlackOrWithFewWaves) {
  EXPECT_EQ(bshd(1, 132, 64, 2048, 128).max_ns, 0u);       // one full wave
  EXPECT_EQ(bshd(1, 100, 64, 2048, 128).max_ns, 0u);       // one partial wave
  EXPECT_EQ(bshd(1, 132 * 31, 64, 2048, 128).max_ns, 0u);  // equal waves: tail 0
  EXPECT_EQ(bshd(1, 132 * 3 + 5, 64, 2048, 128).max_ns, 0u);  // 3 waves: under kMinWaves
  EXPECT_GT(bshd(1, 132 * 4 + 5, 64, 2048, 128).max_ns, 0u);  // 4 waves
  EXPECT_EQ(bshd(1, 4096, 64, 2048, 128, /*grid=*/0).max_ns, 0u);
  EXPECT_EQ(start_delay_ns(0, 4, 77), 0u);
  EXPECT_EQ(bshd(1, 4096, 64, 64, 128).max_ns, 0u);  // topk 64: ~0.75 us, under kMinDelayNs
}

TEST(StartStagger, ScalesWithTheTaskAndIsCapped) {
  const StartDelays d128 = bshd(1, 16384, 64, 2048, 128), d64 = bshd(1, 16384, 64, 2048, 64);
  EXPECT_EQ(d128.first_delayed_cta, 16384 % 132);
  EXPECT_EQ(d64.max_ns, static_cast<uint32_t>(kTaskShare * kTaskNsPerSlotD64 * 2048));
  EXPECT_EQ(bshd(1, 16384, 64, 512, 128).max_ns, static_cast<uint32_t>(kTaskShare * kTaskNsPerSlotD128 * 512));
  EXPECT_EQ(start_delays_for_launch(16384, 132, 1, 1 << 30, Lens{16384}, Lens{1 << 30}, 128).max_ns,
            1000000u);  // at most 1 ms
  // H128: two tasks per row, tasks = rows x 2
  const StartDelays h128 = bshd(1, 4096, 128, 2048, 128);
  EXPECT_EQ(h128.first_delayed_cta, (4096 * 2) % 132);
  EXPECT_EQ(h128.max_ns, d128.max_ns);
}

TEST(StartStagger, SizedForTheCheapestExtraTask) {
  // Sequences shorter than topk: a row has at most k_len valid slots.
  const StartDelays s256 = bshd(64, 256, 64, 2048, 128);
  EXPECT_EQ(s256.max_ns, static_cast<uint32_t>(kTaskShare * kTaskNsPerSlotD128 * 256));
  // THD: 20 sequences of 512 rows and keys, then one of 1 row and 65536 keys. The
  // extra tasks (the last tail = 10241 mod 132 = 77) are rows of both kinds: the
  // cheapest has 512 slots, not 2048.
  Lens q(20, 512), k(20, 512);
  q.push_back(1);
  k.push_back(65536);
  EXPECT_EQ(fewest_slots_of_tasks(10241 - 77, 10241, 1, 2048, q, k), 512);
  const StartDelays thd = start_delays_for_launch(10241, 132, 1, 2048, q, k, 128);
  EXPECT_EQ(thd.first_delayed_cta, 77);
  EXPECT_EQ(thd.max_ns, static_cast<uint32_t>(kTaskShare * kTaskNsPerSlotD128 * 512));
  // A sequence with no query rows holds no task, whatever its keys.
  Lens q0 = {4096, 0}, k0 = {4096, 65536};
  EXPECT_EQ(fewest_slots_of_tasks(4092, 4096, 1, 8192, q0, k0), 4096);
  // Extra tasks all in the long sequence: sized for it.
  Lens q1 = {128, 4096}, k1 = {128, 4096};
  EXPECT_EQ(fewest_slots_of_tasks(4200, 4224, 1, 2048, q1, k1), 2048);
  EXPECT_EQ(fewest_slots_of_tasks(100, 200, 1, 2048, q1, k1), 128);  // straddles both
  // head groups: task t is row t / groups
  EXPECT_EQ(fewest_slots_of_tasks(2 * 4100, 2 * 4224, 2, 2048, q1, k1), 2048);
  EXPECT_EQ(fewest_slots_of_tasks(2 * 127, 2 * 129, 2, 2048, q1, k1), 128);
}

TEST(StartStagger, NamesAndParsesTheOptionWords) {
  using dsaib::StartStagger;
  for (const auto& [word, mode] : {std::pair{"auto", StartStagger::automatic}, std::pair{"off", StartStagger::off}}) {
    EXPECT_STREQ(dsaib::start_stagger_name(mode), word);
    StartStagger got = mode == StartStagger::off ? StartStagger::automatic : StartStagger::off;
    ASSERT_TRUE(dsaib::parse_start_stagger(word, &got)) << word;
    EXPECT_EQ(got, mode) << word;
  }
  for (const char* bad : {"", "on", "OFF", "automatic"}) {  // "on" is not a word: auto is the only way on
    StartStagger got = StartStagger::off;
    EXPECT_FALSE(dsaib::parse_start_stagger(bad, &got)) << '"' << bad << '"';
    EXPECT_EQ(got, StartStagger::off) << "unchanged on failure";
  }
  EXPECT_STREQ(dsaib::start_stagger_name(static_cast<StartStagger>(5)), "invalid");
  EXPECT_EQ(dsaib::IndexerOptions{}.start_stagger, StartStagger::automatic);
}

TEST(ForwardFusion, NamesAndParsesTheOptionWords) {
  using dsaib::ForwardFusion;
  for (const auto& [word, mode] : {std::pair{"auto", ForwardFusion::automatic}, std::pair{"off", ForwardFusion::off}}) {
    EXPECT_STREQ(dsaib::forward_fusion_name(mode), word);
    ForwardFusion got = mode == ForwardFusion::off ? ForwardFusion::automatic : ForwardFusion::off;
    ASSERT_TRUE(dsaib::parse_forward_fusion(word, &got)) << word;
    EXPECT_EQ(got, mode) << word;
  }
  for (const char* bad : {"", "on", "OFF", "automatic", "fused"}) {
    ForwardFusion got = ForwardFusion::off;
    EXPECT_FALSE(dsaib::parse_forward_fusion(bad, &got)) << '"' << bad << '"';
    EXPECT_EQ(got, ForwardFusion::off) << "unchanged on failure";
  }
  EXPECT_STREQ(dsaib::forward_fusion_name(static_cast<ForwardFusion>(5)), "invalid");
  EXPECT_EQ(dsaib::IndexerOptions{}.forward_fusion, ForwardFusion::automatic);
}

}  // namespace
