// When the persistent CTAs start out of phase. The plan is host code,
// header-only (launch_plan.cpp decides per launch, and the CPU tests check it
// without a GPU); start_delay_ns is also compiled for the device, where the
// producer computes its own CTA's delay with it.
//
// All CTAs of the persistent grid start their first task at the same moment and
// then do the same kind of work at the same time (stage 1's streamed loads, then
// the gathers, then the dK reds); they drift apart only over many waves. CTAs
// held in step (a gate at every chunk of every wave) cost ~7% at S 65536 with
// shuffled ids, and delaying the start of most CTAs by up to about half a task
// took random ids at S 4096 (31 waves) -1.2% (8-pair A/B on the H200); three
// quarters of a task took another -1.0% there (8-pair A/B; kTaskShare).
//
// With num_tasks = waves * grid + tail (0 < tail < grid), CTAs 0 .. tail-1 run
// one task more than the others (CTA b runs tasks b, b + grid, ...). Only the
// others are delayed, CTA b by ((37 b) mod 32) / 32 of max_ns (a scrambled
// spread over CTA ids), where max_ns is kTaskShare (3/4) of the estimated time of
// the cheapest of those extra tasks. When the tasks cost about the same (BSHD, or THD with
// equal sequences) the delayed CTAs still finish before the ones with an extra
// task, so the delay costs no time; with unequal tasks it can cost up to max_ns
// once, which the plan bounds by asking for at least kMinWaves waves. No delay
// with tail 0, fewer waves, or a max_ns under kMinDelayNs (the timer and
// __nanosleep granularity would dominate it).
//
// IndexerOptions::start_stagger = off turns the delays off (for A/B runs
// and debugging).
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

/// One CTA's time per valid slot of a task (one query row, up to 64 heads) while
/// the whole grid runs, in ns, measured on the H200 with one CTA per SM: ~0.176 ns
/// per slot and row at D 128 (~360 ns per row at topk 2048, random ids) and
/// ~0.113 at D 64 (~231), each times the 132 CTAs that share that rate.
inline constexpr double kTaskNsPerSlotD128 = 0.176 * 132;
inline constexpr double kTaskNsPerSlotD64 = 0.113 * 132;
/// The delay's share of the cheapest extra task. Measured against 0.5, 8 pairs
/// at S 4096: 0.75 random -3.7 [-6.4, -1.0] ns/row, causal +0.7 [-2.1, +3.4];
/// 1.0 random -2.9 [-5.2, -0.6], causal +1.5 [-0.8, +3.9]. Below 1, a delayed
/// CTA still ends before the CTAs with an extra task when the tasks cost the
/// same.
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
