// Host threads (src/core/threads.hpp): every work item runs exactly once even
// when the system refuses threads, and the cpu backend and the generator give
// bitwise-identical results whatever number of threads actually ran. The
// refusal is simulated with detail::thread_start_limit_for_testing (a system
// refusal cannot be provoked portably; root ignores RLIMIT_NPROC).
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "core/threads.hpp"
#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

/// Sets the start limit for one scope.
struct StartLimit {
  explicit StartLimit(int n) { detail::thread_start_limit_for_testing() = n; }
  ~StartLimit() { detail::thread_start_limit_for_testing() = -1; }
};

TEST(Threads, EveryItemRunsOnceWhateverThreadsStart) {
  for (int limit : {-1, 0, 1, 5}) {
    SCOPED_TRACE("limit " + std::to_string(limit));
    StartLimit guard(limit);
    constexpr int kItems = 100;
    std::vector<std::atomic<int>> runs(kItems);
    for (auto& r : runs) r = 0;
    detail::run_items_on_threads(kItems, [&](int k) { runs[k].fetch_add(1); });
    for (int k = 0; k < kItems; ++k) EXPECT_EQ(runs[k].load(), 1) << "item " << k;
  }
}

TEST(Threads, CpuBackendSameResultWhenThreadsAreRefused) {
  GenerateSpec s = small_spec(71);
  s.s_q = 96;
  s.s_kv = 80;
  s.topk = 33;
  const GeneratedProblem p = make_problem(s);
  IndexerOptions opt = p.options();
  opt.num_threads = 8;
  const OutputBuffers all = run_cpu(p, opt);
  for (int limit : {0, 3}) {
    SCOPED_TRACE("limit " + std::to_string(limit));
    StartLimit guard(limit);
    const OutputBuffers fewer = run_cpu(p, opt);
    EXPECT_TRUE(bitwise_equal(all.d_index_q, fewer.d_index_q)) << "d_index_q";
    EXPECT_TRUE(bitwise_equal(all.d_weights, fewer.d_weights)) << "d_weights";
    EXPECT_TRUE(bitwise_equal(all.d_index_k, fewer.d_index_k)) << "d_index_k";
  }
}

TEST(Threads, GeneratorSameProblemWhenThreadsAreRefused) {
  GenerateSpec s = small_spec(72);
  s.num_threads = 8;
  const GeneratedProblem all = make_problem(s);
  StartLimit guard(0);
  const GeneratedProblem fewer = make_problem(s);
  EXPECT_TRUE(bitwise_equal(all.index_q, fewer.index_q));
  EXPECT_TRUE(bitwise_equal(all.index_k, fewer.index_k));
  EXPECT_TRUE(bitwise_equal(all.topk_indices, fewer.topk_indices));
  EXPECT_TRUE(bitwise_equal(all.attn_score, fewer.attn_score));
  EXPECT_TRUE(bitwise_equal(all.index_score, fewer.index_score));
}

}  // namespace
}  // namespace dsaib::test
