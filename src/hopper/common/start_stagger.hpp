// When the persistent CTAs start out of phase (option start_stagger,
// docs/hopper-kernel.md §3). Host code, header-only, so that the CPU tests check
// the plan; start_delay_ns is also the producer's, on the device.
//
// CTAs that start together run the same phase (streamed loads, gathers, dK reds)
// at the same time, which costs the L2. With num_tasks = waves * grid + tail,
// CTAs 0 .. tail-1 run one task more; the others start up to kTaskShare of the
// cheapest extra task late, so with tasks of equal cost the delay costs no time.
// Unequal tasks can lose up to max_ns once, hence kMinWaves; under kMinDelayNs
// the timer's granularity would dominate.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define DSAIB_START_STAGGER_HD __host__ __device__
#else
#define DSAIB_START_STAGGER_HD
#endif

namespace dsaib::hopper {

/// One CTA's ns per valid slot of a task while the whole grid runs: the H200's
/// per-row rate times its 132 CTAs (docs/hopper-kernel.md §3).
inline constexpr double kTaskNsPerSlotD128 = 0.176 * 132;
inline constexpr double kTaskNsPerSlotD64 = 0.113 * 132;
/// The delay's share of the cheapest extra task (docs/design-decisions.md): below
/// 1, a delayed CTA still ends first when the tasks cost the same.
inline constexpr double kTaskShare = 0.75;
inline constexpr int64_t kMinWaves = 4;
inline constexpr double kMinDelayNs = 2000.0;
inline constexpr double kMaxDelayNs = 1.0e6;

/// The start delays of one launch (IndexerParams::start_stagger_*).
struct StartDelays {
  uint32_t max_ns = 0;            // 0: no CTA is delayed
  int64_t first_delayed_cta = 0;  // CTAs b >= this one (the ones with a task fewer) are delayed
};

/// CTA b's delay in ns: ((37 b) mod 32) / 32 of max_ns for b >= first_delayed_cta,
/// else 0. Host (tests) and device (the producer) use this one definition.
DSAIB_START_STAGGER_HD inline uint32_t start_delay_ns(uint32_t max_ns, int64_t first_delayed_cta, int64_t b) {
  if (max_ns == 0 || b < first_delayed_cta) return 0;
  return static_cast<uint32_t>((static_cast<uint64_t>(max_ns) * static_cast<uint64_t>((b * 37) % 32)) / 32);
}

/// The fewest valid slots any task in [first_task, num_tasks) can have: task t is
/// query row t / head_groups, and a row of sequence s has at most min(topk,
/// k_len[s]) valid slots. q_len / k_len: per sequence, in flat order (BSHD: B
/// times S_q and S_kv); sequences without query rows hold no task.
inline int64_t fewest_slots_of_tasks(int64_t first_task, int64_t num_tasks, int64_t head_groups, int64_t topk,
                                     const std::vector<int64_t>& q_len, const std::vector<int64_t>& k_len) {
  const int64_t groups = std::max<int64_t>(head_groups, 1);
  if (first_task >= num_tasks) return 0;
  const int64_t first_row = first_task / groups, last_row = (num_tasks - 1) / groups;
  int64_t fewest = topk, row0 = 0;
  for (std::size_t s = 0; s < std::min(q_len.size(), k_len.size()) && row0 <= last_row; ++s) {
    const int64_t row1 = row0 + std::max<int64_t>(q_len[s], 0);  // this sequence's rows: [row0, row1)
    if (row1 > first_row && row0 < row1) fewest = std::min(fewest, std::min(topk, k_len[s]));
    row0 = row1;
  }
  return std::max<int64_t>(fewest, 0);
}

/// The delay plan of one launch of `grid` persistent CTAs over `num_tasks` tasks
/// (head_groups per query row; q_len / k_len as for fewest_slots_of_tasks).
inline StartDelays start_delays_for_launch(int64_t num_tasks, int64_t grid, int64_t head_groups, int64_t topk,
                                           const std::vector<int64_t>& q_len, const std::vector<int64_t>& k_len,
                                           int64_t head_dim) {
  StartDelays s;
  if (grid <= 0 || num_tasks < kMinWaves * grid) return s;  // too few waves for the delay to be safe
  const int64_t tail = num_tasks % grid;
  if (tail == 0) return s;  // every CTA runs the same number of tasks: no slack
  const int64_t slots = fewest_slots_of_tasks(num_tasks - tail, num_tasks, head_groups, topk, q_len, k_len);
  const double per_slot = head_dim == 64 ? kTaskNsPerSlotD64 : kTaskNsPerSlotD128;
  const double delay = std::min(kTaskShare * per_slot * static_cast<double>(slots), kMaxDelayNs);
  if (delay < kMinDelayNs) return s;
  s.max_ns = static_cast<uint32_t>(delay);
  s.first_delayed_cta = tail;
  return s;
}

}  // namespace dsaib::hopper
