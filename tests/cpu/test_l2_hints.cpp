// The cuda backend's L2-hint decision (src/hopper/common/l2_hints.hpp: whether the dK reds
// carry their L2 policy), host code only: the working-set estimate over sequences,
// the threshold, and the option's words (IndexerOptions::l2_hints).
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "hopper/common/l2_hints.hpp"

namespace dsaib::hopper {
namespace {

constexpr int64_t kH200L2 = 62914560;  // cudaDevAttrL2CacheSize on the H200 (60 MiB)
constexpr int64_t kH200SetAside = 11796480;  // cudaLimitPersistingL2CacheSize in a fresh context (11.25 MiB)

TEST(L2Hints, OneSequenceTouchesItsWholeKeyTable) {
  EXPECT_EQ(key_rows_in_flight({65536}, {65536}, 132), 65536);
  EXPECT_EQ(key_rows_in_flight({1}, {300}, 132), 300);
}

TEST(L2Hints, ConsecutiveRowsMeetOnlyTheSequencesOfOneWindow) {
  // B4, S 16384: a window of 132 rows meets at most two sequences.
  EXPECT_EQ(key_rows_in_flight(std::vector<int64_t>(4, 16384), std::vector<int64_t>(4, 16384), 132), 32768);
  // Short query sequences: 132 rows over sequences of 10 rows meet 15 of them
  // (the last row of one, then 131 rows: 13 whole sequences and one row of a 15th).
  EXPECT_EQ(key_rows_in_flight(std::vector<int64_t>(40, 10), std::vector<int64_t>(40, 1000), 132), 15 * 1000);
  // Every sequence met when the window covers them all.
  EXPECT_EQ(key_rows_in_flight({3, 2, 4}, {100, 200, 300}, 132), 600);
  // The largest window wins, wherever it is.
  EXPECT_EQ(key_rows_in_flight({100, 100, 1, 1}, {10, 10, 5000, 7000}, 2), 12000);
}

TEST(L2Hints, SequencesWithoutQueryRowsAreNeverMet) {
  EXPECT_EQ(key_rows_in_flight({0, 5, 0}, {100000, 7, 100000}, 132), 7);
  EXPECT_EQ(key_rows_in_flight({}, {}, 132), 0);
}

TEST(L2Hints, AutomaticTakesTheHintsAboveHalfTheL2) {
  // Measured: S 65536 D128 (48 MiB of dK + K) gains; S 16384 (12 MiB) fits.
  EXPECT_TRUE(l2_hints_pay(L2Hints::automatic, 65536, 128, kH200L2, kH200SetAside));
  EXPECT_FALSE(l2_hints_pay(L2Hints::automatic, 16384, 128, kH200L2, kH200SetAside));
  EXPECT_FALSE(l2_hints_pay(L2Hints::automatic, 65536, 64, kH200L2, kH200SetAside));  // 24 MiB
  EXPECT_TRUE(l2_hints_pay(L2Hints::automatic, 98304, 64, kH200L2, kH200SetAside));   // 36 MiB
  // The boundary: 30 MiB is half, so 40960 rows at D128 (30 MiB) stay unhinted.
  EXPECT_FALSE(l2_hints_pay(L2Hints::automatic, 40960, 128, kH200L2, kH200SetAside));
  EXPECT_TRUE(l2_hints_pay(L2Hints::automatic, 40961, 128, kH200L2, kH200SetAside));
  EXPECT_FALSE(l2_hints_pay(L2Hints::automatic, 1 << 20, 128, 0, kH200SetAside));  // unknown L2 size: no hints
}

TEST(L2Hints, ASetAsideThatHoldsDkTakesTheHintsEarlier) {
  constexpr int64_t kMiB = 1 << 20;
  const int64_t cap = 37 * kMiB + kMiB / 2;  // the H200's largest set-aside
  // 22.5 MiB left to normal lines: dK + K above 11.25 MiB (15360 rows at D128)
  // take the hinted kernel while the 37.5 MiB hold dK (up to 76800 rows).
  EXPECT_FALSE(l2_hints_pay(L2Hints::automatic, 15360, 128, kH200L2, cap));
  EXPECT_TRUE(l2_hints_pay(L2Hints::automatic, 15361, 128, kH200L2, cap));
  EXPECT_TRUE(l2_hints_pay(L2Hints::automatic, 24576, 128, kH200L2, cap));
  EXPECT_TRUE(l2_hints_pay(L2Hints::automatic, 40960, 128, kH200L2, cap));
  EXPECT_TRUE(l2_hints_pay(L2Hints::automatic, 76800, 128, kH200L2, cap));
  // Past the set-aside the first clause decides (dK + K above 30 MiB).
  EXPECT_TRUE(l2_hints_pay(L2Hints::automatic, 100000, 128, kH200L2, cap));
  // The default set-aside never moves the gate: 40960 rows stay unhinted, as do
  // the rows whose dK fits 11.25 MiB.
  for (int64_t rows : {1, 15361, 23040, 30000, 40960}) {
    EXPECT_FALSE(l2_hints_pay(L2Hints::automatic, rows, 128, kH200L2, kH200SetAside)) << rows;
    EXPECT_FALSE(l2_hints_pay(L2Hints::automatic, rows, 128, kH200L2, 0)) << rows;
  }
  // Unknown L2 size: no hints, whatever the set-aside.
  EXPECT_FALSE(l2_hints_pay(L2Hints::automatic, 24576, 128, 0, cap));
  // A set-aside larger than the L2 (not possible on a device; the arithmetic
  // stays defined): dK fits, nothing is left to normal lines.
  EXPECT_TRUE(l2_hints_pay(L2Hints::automatic, 1024, 128, kH200L2, 2 * kH200L2));
}

TEST(L2Hints, OnAndOffOverrideTheSize) {
  EXPECT_TRUE(l2_hints_pay(L2Hints::on, 1, 64, kH200L2, kH200SetAside));
  EXPECT_FALSE(l2_hints_pay(L2Hints::off, 1 << 20, 128, kH200L2, kH200SetAside));
}

TEST(L2Hints, LaunchDecisionCountsRowsInFlightPerHeadGroup) {
  // B1 S 65536 D128 on 132 SMs: one window meets the whole table (48 MiB).
  EXPECT_TRUE(l2_hints_for_launch(L2Hints::automatic, {65536}, {65536}, 1, 132, kH200L2, 128, kH200SetAside));
  // B4 S 16384: 132 rows in flight meet two sequences (24 MiB, under half the L2).
  const std::vector<int64_t> four(4, 16384);
  EXPECT_FALSE(l2_hints_for_launch(L2Hints::automatic, four, four, 1, 132, kH200L2, 128, kH200SetAside));
  // Sequences of 40 query rows: 132 rows in flight meet 5 sequences (60 MiB); with
  // 4 head groups per row only ceil(132 / 4) = 33 rows are in flight, which meet
  // 2 sequences (the last row of one and 32 of the next: 24 MiB).
  const std::vector<int64_t> q40(8, 40), k16k(8, 16384);
  EXPECT_TRUE(l2_hints_for_launch(L2Hints::automatic, q40, k16k, 1, 132, kH200L2, 128, kH200SetAside));
  EXPECT_FALSE(l2_hints_for_launch(L2Hints::automatic, q40, k16k, 4, 132, kH200L2, 128, kH200SetAside));
  // on / off override; head_groups 0 and sms 0 are treated as 1.
  EXPECT_TRUE(l2_hints_for_launch(L2Hints::on, {1}, {1}, 1, 132, kH200L2, 64, kH200SetAside));
  EXPECT_FALSE(l2_hints_for_launch(L2Hints::off, {65536}, {65536}, 1, 132, kH200L2, 128, kH200SetAside));
  EXPECT_TRUE(l2_hints_for_launch(L2Hints::automatic, {65536}, {65536}, 0, 0, kH200L2, 128, kH200SetAside));
}

TEST(L2Hints, KeepFractionFollowsTheSetAside) {
  constexpr int64_t kMiB = 1 << 20;
  // B1 S 65536 D128: 32 MiB of dK. The H200's default set-aside (11.25 MiB) keeps
  // the measured 0.35; its cap (37.5 MiB) holds all of dK: 1.0.
  EXPECT_EQ(l2_keep_fraction(11 * kMiB + kMiB / 4, 65536, 128), L2KeepFraction::f035);
  EXPECT_EQ(l2_keep_fraction(37 * kMiB + kMiB / 2, 65536, 128), L2KeepFraction::f100);
  EXPECT_EQ(l2_keep_fraction(0, 65536, 128), L2KeepFraction::f035);
  // The boundaries: all of dK (32 MiB) and 3/4 of it (24 MiB).
  EXPECT_EQ(l2_keep_fraction(32 * kMiB, 65536, 128), L2KeepFraction::f100);
  EXPECT_EQ(l2_keep_fraction(32 * kMiB - 1, 65536, 128), L2KeepFraction::f075);
  EXPECT_EQ(l2_keep_fraction(24 * kMiB, 65536, 128), L2KeepFraction::f075);
  EXPECT_EQ(l2_keep_fraction(24 * kMiB - 1, 65536, 128), L2KeepFraction::f035);
  // Every automatic hinted launch has more than 30 MiB of dK + K, i.e. more than
  // 20 MiB of dK at D128: the default 11.25 MiB never reaches 3/4 of it.
  EXPECT_EQ(l2_keep_fraction(11 * kMiB + kMiB / 4, 40961, 128), L2KeepFraction::f035);
  // A small table forced on (l2_hints on) fits the default set-aside whole.
  EXPECT_EQ(l2_keep_fraction(11 * kMiB + kMiB / 4, 300, 128), L2KeepFraction::f100);
  EXPECT_FLOAT_EQ(l2_keep_fraction_value(L2KeepFraction::f035), 0.35f);
  EXPECT_FLOAT_EQ(l2_keep_fraction_value(L2KeepFraction::f075), 0.75f);
  EXPECT_FLOAT_EQ(l2_keep_fraction_value(L2KeepFraction::f100), 1.0f);
  // The fraction's basis is the typical window: B2 S 65536 touches one
  // sequence's 32 MiB of dK for all but ~132 rows of each sequence, so the
  // H200's cap holds it (1.0), though the worst window meets both sequences.
  const std::vector<int64_t> b2(2, 65536);
  EXPECT_EQ(key_rows_for_launch(b2, b2, 1, 132), 2 * 65536);
  EXPECT_EQ(key_rows_for_launch(b2, b2, 1, 132, WindowStart::first_row), 65536);
  EXPECT_EQ(l2_keep_fraction(37 * kMiB + kMiB / 2, key_rows_for_launch(b2, b2, 1, 132, WindowStart::first_row), 128),
            L2KeepFraction::f100);
  // Short sequences: a window from the first row of one meets the next ones
  // (40 query rows each: 132 rows cover 4 sequences from a first row, 5 from
  // a last row).
  const std::vector<int64_t> q40(8, 40), k16k(8, 16384);
  EXPECT_EQ(key_rows_for_launch(q40, k16k, 1, 132, WindowStart::first_row), 4 * 16384);
  EXPECT_EQ(key_rows_for_launch(q40, k16k, 1, 132), 5 * 16384);
  EXPECT_EQ(key_rows_for_launch({65536}, {65536}, 1, 132, WindowStart::first_row), 65536);
  EXPECT_EQ(key_rows_for_launch({0, 5}, {100000, 7}, 1, 132, WindowStart::first_row), 7);
  EXPECT_EQ(key_rows_for_launch({}, {}, 1, 132, WindowStart::first_row), 0);
  // key_rows_for_launch is the estimate of the hint decision.
  EXPECT_EQ(key_rows_for_launch({65536}, {65536}, 1, 132), 65536);
  EXPECT_EQ(key_rows_for_launch(q40, k16k, 4, 132), 2 * 16384);
}

TEST(L2Hints, NamesAndParsesTheOptionWords) {
  for (const auto& [word, mode] : {std::pair{"auto", L2Hints::automatic}, std::pair{"on", L2Hints::on},
                                   std::pair{"off", L2Hints::off}}) {
    EXPECT_STREQ(l2_hints_name(mode), word);
    L2Hints got = mode == L2Hints::on ? L2Hints::off : L2Hints::on;
    ASSERT_TRUE(parse_l2_hints(word, &got)) << word;
    EXPECT_EQ(got, mode) << word;
  }
  for (const char* bad : {"", "yes", "ON", "automatic", "auto "}) {
    L2Hints got = L2Hints::on;
    EXPECT_FALSE(parse_l2_hints(bad, &got)) << '"' << bad << '"';
    EXPECT_EQ(got, L2Hints::on) << "unchanged on failure";
  }
  EXPECT_STREQ(l2_hints_name(static_cast<L2Hints>(7)), "invalid");
  EXPECT_EQ(IndexerOptions{}.l2_hints, L2Hints::automatic);
}

}  // namespace
}  // namespace dsaib::hopper
