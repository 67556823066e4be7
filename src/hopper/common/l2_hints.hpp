// When the backward kernel's dK reds carry their L2 policy (option l2_hints;
// device side: l2_policy.cuh), and which share. Host code, header-only, so that
// the CPU tests check it. The hint pays only once the dK and K rows in flight
// crowd the L2 (docs/hopper-kernel.md §4, docs/design-decisions.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dsaib/indexer_backward.hpp"

namespace dsaib::hopper {

/// Where the windows of key_rows_in_flight start within a sequence.
enum class WindowStart {
  last_row,   // the worst window: a sequence's last row and the rows after it (the hint's gate)
  first_row,  // the window for most of a launch: a sequence's first row onwards (the evict_last share;
              // with long sequences, B2 S 65536, one sequence's keys where the worst window counts two)
};

/// The most key rows that `rows_in_flight` consecutive flat query rows can touch:
/// the largest sum of k_len over the sequences one window of that many rows meets
/// (sequences with no query rows are never met), over the windows that start at
/// each sequence's last row (`start` last_row, the default) or first row. q_len and
/// k_len: per sequence, in flat order (BSHD: B times S_q and S_kv). The persistent
/// grid hands out tasks in row order, so about grid / head_groups rows are in
/// flight at once.
inline int64_t key_rows_in_flight(const std::vector<int64_t>& q_len, const std::vector<int64_t>& k_len,
                                  int64_t rows_in_flight, WindowStart start = WindowStart::last_row) {
  const std::size_t n = std::min(q_len.size(), k_len.size());
  int64_t most = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (q_len[i] <= 0) continue;
    // The window's rows of sequence i, then the rows that follow.
    int64_t keys = k_len[i], rows_left = rows_in_flight - (start == WindowStart::last_row ? 1 : q_len[i]);
    for (std::size_t j = i + 1; j < n && rows_left > 0; ++j) {
      if (q_len[j] <= 0) continue;
      keys += k_len[j];
      rows_left -= q_len[j];
    }
    most = std::max(most, keys);
  }
  return most;
}

/// Whether a launch takes the hinted kernel: `mode` is
/// IndexerOptions::l2_hints (on: always; off: never); automatic: when
/// those key rows' dK (fp32) and K (bf16) bytes exceed half of `l2_bytes`
/// (cudaDevAttrL2CacheSize; 0 = unknown: no hints), or when the context's L2
/// set-aside for persisting lines (`set_aside_bytes`,
/// cudaLimitPersistingL2CacheSize) holds all of dK and dK and K exceed half of
/// the L2 that the set-aside leaves to the other lines: a set-aside holds its
/// share away from normal lines, and the hinted kernel then keeps all of dK
/// there. The second clause never holds at the H200's default 11.25 MiB.
inline bool l2_hints_pay(L2Hints mode, int64_t key_rows, int64_t head_dim, int64_t l2_bytes,
                         int64_t set_aside_bytes) {
  if (mode != L2Hints::automatic) return mode == L2Hints::on;
  if (l2_bytes <= 0) return false;
  const int64_t dk_bytes = key_rows * head_dim * static_cast<int64_t>(sizeof(float));
  const int64_t bytes = key_rows * head_dim * static_cast<int64_t>(sizeof(float) + 2);
  if (bytes > l2_bytes / 2) return true;
  return set_aside_bytes > 0 && set_aside_bytes >= dk_bytes && bytes > (l2_bytes - set_aside_bytes) / 2;
}

/// The key rows that the CTAs in flight can touch at once (key_rows_in_flight over
/// ceil(sms / head_groups) consecutive query rows): the basis of both L2 decisions,
/// the gate with the worst windows, the evict_last share with those from a first row.
inline int64_t key_rows_for_launch(const std::vector<int64_t>& q_len, const std::vector<int64_t>& k_len,
                                   int64_t head_groups, int64_t sms, WindowStart start = WindowStart::last_row) {
  const int64_t groups = std::max<int64_t>(head_groups, 1);
  const int64_t rows_in_flight = std::max<int64_t>((sms + groups - 1) / groups, 1);
  return key_rows_in_flight(q_len, k_len, rows_in_flight, start);
}

/// The whole decision for one launch, from the problem and the device: `mode`,
/// the per-sequence q_len / k_len, head_groups tasks per query row, `sms`
/// resident CTAs (one per SM), `l2_bytes`, the head dim, `set_aside_bytes`. The
/// rows in flight are ceil(sms / head_groups) consecutive query rows.
inline bool l2_hints_for_launch(L2Hints mode, const std::vector<int64_t>& q_len, const std::vector<int64_t>& k_len,
                                int64_t head_groups, int64_t sms, int64_t l2_bytes, int64_t head_dim,
                                int64_t set_aside_bytes) {
  if (mode != L2Hints::automatic) return mode == L2Hints::on;
  return l2_hints_pay(mode, key_rows_for_launch(q_len, k_len, head_groups, sms), head_dim, l2_bytes,
                      set_aside_bytes);
}

/// The share of the hinted kernel's dK reds that carry evict_last. evict_last
/// lines live in the context's persisting set-aside, which holds its share of
/// the L2 away from other lines, so the share follows the set-aside in force.
enum class L2KeepFraction : int32_t {
  f035 = 0,  // the set-aside holds less than 3/4 of dK (the default 11.25 MiB at every hinted launch)
  f075 = 1,  // 3/4 of dK or more
  f100 = 2,  // all of dK
};

/// The fraction as a number (0.35, 0.75, 1.0).
inline float l2_keep_fraction_value(L2KeepFraction f) {
  switch (f) {
    case L2KeepFraction::f100: return 1.0f;
    case L2KeepFraction::f075: return 0.75f;
    case L2KeepFraction::f035: break;
  }
  return 0.35f;
}

/// The fraction for `set_aside_bytes` of persisting L2 and `key_rows` key rows of
/// fp32 dK at `head_dim` (key_rows_for_launch from a first row): f100 when the set-aside
/// holds all their dK bytes (also when there are none), f075 when it holds 3/4
/// of them, f035 otherwise (no set-aside included).
inline L2KeepFraction l2_keep_fraction(int64_t set_aside_bytes, int64_t key_rows, int64_t head_dim) {
  const int64_t dk_bytes = key_rows * head_dim * static_cast<int64_t>(sizeof(float));
  if (set_aside_bytes >= dk_bytes) return L2KeepFraction::f100;
  if (4 * set_aside_bytes >= 3 * dk_bytes) return L2KeepFraction::f075;
  return L2KeepFraction::f035;
}

}  // namespace dsaib::hopper
