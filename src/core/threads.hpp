// Host thread fan-out for the CPU backend and the generator: n work items on up
// to n threads, robust to a thread that cannot be started.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

#include "core/float_mode.hpp"

namespace dsaib::detail {

/// Tests only: at most this many extra threads are started by
/// run_items_on_threads (-1, the default: no limit). Lets a test take the path
/// where the system refuses a thread, which it cannot provoke portably.
inline std::atomic<int>& thread_start_limit_for_testing() {
  static std::atomic<int> limit{-1};
  return limit;
}

/// Worker threads for `work_items` items: `requested` (0 or less: all hardware
/// threads), at least 1, at most one per item (and 1 when there are none).
inline int thread_count(int32_t requested, int64_t work_items) {
  int n = requested > 0 ? requested : static_cast<int>(std::thread::hardware_concurrency());
  n = std::max(1, n);
  return static_cast<int>(std::min<int64_t>(n, std::max<int64_t>(work_items, 1)));
}

/// Runs worker(k) exactly once for every k in [0, n), on the calling thread and
/// up to n - 1 started threads, which take items from a shared counter. A
/// thread the system refuses (std::thread throws std::system_error, e.g. past
/// the process's thread limit) is not an error: the threads already running,
/// at least the caller, take its items. The results therefore must not depend
/// on which thread runs an item. worker must not throw.
template <class Worker>
void run_items_on_threads(int n, Worker worker) {
  std::atomic<int> next{0};
  auto loop = [&] {
    const IeeeSubnormalsScope ieee;  // every thread, the caller included (float_mode.hpp)
    for (int k = next.fetch_add(1); k < n; k = next.fetch_add(1)) worker(k);
  };
  std::vector<std::thread> pool;
  pool.reserve(n > 1 ? static_cast<size_t>(n - 1) : 0);  // a bad_alloc here leaves no thread running
  const int limit = thread_start_limit_for_testing().load();
  for (int t = 1; t < n; ++t) {
    if (limit >= 0 && t > limit) break;
    try {
      pool.emplace_back(loop);
    } catch (const std::system_error&) {
      break;  // fewer threads; the ones running take the remaining items
    }
  }
  loop();
  for (auto& th : pool) th.join();
}

/// Calls fn(item, thread_index) for every item in [0, n) on `threads` threads
/// (run_items_on_threads), handing out `chunk` items at a time from a shared
/// counter (items may differ in cost). thread_index < threads picks the caller's
/// per-thread scratch. Results must not depend on the thread an item runs on.
template <class Fn>
void parallel_for(int threads, int64_t n, int64_t chunk, Fn fn) {
  std::atomic<int64_t> next{0};
  auto work = [&](int tid) {
    for (;;) {
      const int64_t lo = next.fetch_add(chunk);
      if (lo >= n) return;
      const int64_t hi = std::min(n, lo + chunk);
      for (int64_t i = lo; i < hi; ++i) fn(i, tid);
    }
  };
  run_items_on_threads(threads, work);
}

}  // namespace dsaib::detail
