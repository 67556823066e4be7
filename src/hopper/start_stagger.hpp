// When the persistent CTAs start out of phase (v44). Host code only,
// header-only: the launcher decides per launch, and the CPU tests check the plan
// without a GPU.
//
// All CTAs of the persistent grid start their first task at the same moment and
// then do the same kind of work at the same time (stage 1's streamed loads, then
// the gathers, then the dK reds); they drift apart only over many waves. CTAs
// held in step cost ~7% at S 65536 (perf-log, fifteenth session, the epoch-gate
// probes), and delaying the start of most CTAs by up to about half a task took
// random ids at S 4096 (31 waves) -2.3% (call 5, "stagger probe").
//
// The delay is free of idle time where it can be: with num_tasks = waves * grid
// + tail (0 < tail < grid), CTAs 0 .. tail-1 run one task more than the others,
// and the kernel ends with them. Only the other CTAs are delayed, each by
// ((37 b) mod 32) / 32 of max_ns (a scrambled spread over CTA ids), with max_ns
// about half of an estimated task time, so they still finish before the CTAs
// with the extra task. With tail 0 (every CTA the same number of tasks) or a
// single wave, nothing is delayed.
#pragma once

#include <algorithm>
#include <cstdint>

namespace dsaib::hopper {

struct StartStagger {
  uint32_t max_ns = 0;          // 0: no CTA is delayed
  int64_t first_delayed_cta = 0;  // CTAs b >= this one (the ones with a task fewer) are delayed
};

/// Estimated time of one task (one query row, up to 64 heads, `slots` valid
/// slots) on one CTA while the whole grid runs, in ns: the H200's measured
/// ~0.176 ns per slot and row at D 128 (~360 ns per row at topk 2048, random
/// ids) and ~0.113 at D 64 (~231), times the 132 CTAs that share that rate.
inline double estimated_task_ns(int64_t slots, int64_t head_dim) {
  const double per_slot_ns_per_cta = head_dim == 64 ? 0.113 * 132 : 0.176 * 132;
  return per_slot_ns_per_cta * static_cast<double>(std::max<int64_t>(slots, 0));
}

/// The delay plan of one launch of `grid` persistent CTAs over `num_tasks` tasks
/// (CTA b runs tasks b, b + grid, ...). `slots_per_row`: the most valid slots a
/// row can have, min(topk, the longest key sequence), so that short sequences
/// (few valid slots under a large topk) do not get a delay sized for topk.
inline StartStagger start_stagger_for_launch(int64_t num_tasks, int64_t grid, int64_t slots_per_row,
                                             int64_t head_dim) {
  StartStagger s;
  if (grid <= 0 || num_tasks <= grid) return s;  // one wave: no CTA has slack
  const int64_t tail = num_tasks % grid;
  if (tail == 0) return s;  // every CTA runs the same number of tasks
  const double half_task = 0.5 * estimated_task_ns(slots_per_row, head_dim);
  s.max_ns = static_cast<uint32_t>(std::min(half_task, 1.0e6));  // at most 1 ms
  s.first_delayed_cta = tail;
  return s;
}

/// CTA b's delay in ns under plan s (the device computes the same).
inline uint32_t start_delay_ns(const StartStagger& s, int64_t b) {
  if (s.max_ns == 0 || b < s.first_delayed_cta) return 0;
  return static_cast<uint32_t>((static_cast<uint64_t>(s.max_ns) * static_cast<uint64_t>((b * 37) % 32)) / 32);
}

}  // namespace dsaib::hopper
