// The input generator (include/dsaib/generate.hpp, src/generate/generate.cpp).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>

#include "core/bf16.hpp"
#include "support/test_support.hpp"

namespace dsaib::test {
namespace {

bool same_problem(const GeneratedProblem& a, const GeneratedProblem& b) {
  return bitwise_equal(a.index_q, b.index_q) && bitwise_equal(a.weights, b.weights) &&
         bitwise_equal(a.index_k, b.index_k) && bitwise_equal(a.topk_indices, b.topk_indices) &&
         bitwise_equal(a.attn_score, b.attn_score) && bitwise_equal(a.index_score, b.index_score) &&
         bitwise_equal(a.cu_seqlens_q, b.cu_seqlens_q) && bitwise_equal(a.cu_seqlens_k, b.cu_seqlens_k);
}

/// True logits of every key of the row's sequence (fp64, through the public
/// reference): a copy of the problem whose ids list all keys.
std::vector<std::vector<double>> all_logits(const GeneratedProblem& p) {
  int64_t max_k = 0;
  for (int64_t r = 0; r < num_q_rows(p); ++r) {
    int64_t lo, hi;
    key_range(p, r, &lo, &hi);
    max_k = std::max(max_k, hi - lo);
  }
  GeneratedProblem full = p;
  std::vector<int64_t> shape = p.topk_indices.shape;
  shape.back() = max_k;
  full.topk_indices = HostTensor(DType::i32, shape);
  full.attn_score = HostTensor(DType::f32, shape);
  full.index_score = HostTensor(DType::f32, shape);
  full.spec.id_mode = IdMode::local;
  for (int64_t r = 0; r < num_q_rows(p); ++r) {
    for (int64_t i = 0; i < max_k; ++i) full.topk_indices.data<int32_t>()[r * max_k + i] = static_cast<int32_t>(i);
  }
  const std::vector<double> z = reference_index_logits(full.inputs(), full.options());
  std::vector<std::vector<double>> out(static_cast<size_t>(num_q_rows(p)));
  for (int64_t r = 0; r < num_q_rows(p); ++r) {
    int64_t lo, hi;
    key_range(p, r, &lo, &hi);
    out[r].assign(z.begin() + r * max_k, z.begin() + r * max_k + (hi - lo));
  }
  return out;
}

/// Local id of a slot (or -1).
int64_t local_id(const GeneratedProblem& p, int64_t r, int64_t i) {
  if (!slot_valid(p, r, i)) return -1;
  int64_t lo, hi;
  key_range(p, r, &lo, &hi);
  return get_id(p, r, i) - (p.spec.id_mode == IdMode::global ? lo : 0);
}

/// Causal selection: the topk largest logits among visible keys, in decreasing order, then -1.
void check_causal(const GeneratedProblem& p) {
  const auto z = all_logits(p);
  const int64_t K = topk(p);
  for (int64_t r = 0; r < num_q_rows(p); ++r) {
    int64_t lo, hi, qlo = 0, qlen = 0;
    key_range(p, r, &lo, &hi);
    if (p.spec.layout == Layout::thd) {
      const int32_t* cq = p.cu_seqlens_q.data<int32_t>();
      for (int64_t b = 0; b + 1 < p.cu_seqlens_q.numel(); ++b) {
        if (r >= cq[b] && r < cq[b + 1]) qlo = cq[b], qlen = cq[b + 1] - cq[b];
      }
    } else {
      qlo = r / p.spec.s_q * p.spec.s_q;
      qlen = p.spec.s_q;
    }
    const int64_t t = r - qlo, nk = hi - lo;
    const int64_t visible = std::clamp<int64_t>(t + nk - qlen + 1, 0, nk);
    const int64_t want = std::min(K, visible);
    std::set<int64_t> chosen;
    double scale = 1e-30, last = std::numeric_limits<double>::infinity();
    for (double v : z[r]) scale = std::max(scale, std::abs(v));
    for (int64_t i = 0; i < K; ++i) {
      const int64_t id = local_id(p, r, i);
      if (i >= want) {
        ASSERT_EQ(get_id(p, r, i), -1) << "row " << r << " slot " << i;
        continue;
      }
      ASSERT_GE(id, 0) << "row " << r << " slot " << i;
      ASSERT_LT(id, visible) << "row " << r << ": not causal";
      ASSERT_TRUE(chosen.insert(id).second) << "duplicate id";
      ASSERT_LE(z[r][id], last + 1e-5 * scale) << "row " << r << ": not in decreasing order";
      last = z[r][id];
    }
    double min_chosen = std::numeric_limits<double>::infinity(), max_other = -min_chosen;
    for (int64_t s = 0; s < visible; ++s) {
      if (chosen.count(s)) min_chosen = std::min(min_chosen, z[r][s]);
      else max_other = std::max(max_other, z[r][s]);
    }
    // fp32 selection vs fp64 truth: near-ties may swap.
    ASSERT_GE(min_chosen, max_other - 1e-5 * scale) << "row " << r << ": a better key was left out";
  }
}

TEST(Generate, CausalTopkBshd) {
  GenerateSpec s = small_spec(81);
  s.s_q = 40;
  s.s_kv = 40;
  s.topk = 10;
  check_causal(make_problem(s));
  s.s_q = 12;  // S_q != S_kv: query t sees keys s <= t + 28
  s.id_mode = IdMode::global;
  s.sm_scale = -0.5f;  // the largest z still wins
  check_causal(make_problem(s));
  s.s_q = 40;
  s.s_kv = 12;  // S_q > S_kv: the first rows see nothing
  check_causal(make_problem(s));
}

TEST(Generate, CausalTopkThd) {
  GenerateSpec s = small_spec(82);
  s.layout = Layout::thd;
  s.seqlens_q = {1, 0, 30, 17};
  s.seqlens_k = {1, 4, 30, 25};
  s.topk = 12;
  s.heads = 16;
  s.head_dim = 128;
  check_causal(make_problem(s));
  s.id_mode = IdMode::global;
  check_causal(make_problem(s));
}

TEST(Generate, RandomPermutation) {
  GenerateSpec s = small_spec(83);
  s.ids = IdPattern::random_permutation;
  s.batch = 3;
  s.s_q = 30;
  s.s_kv = 40;
  s.topk = 10;
  const GeneratedProblem p = make_problem(s);
  std::set<int64_t> seen;
  for (int64_t r = 0; r < num_q_rows(p); ++r) {
    std::set<int64_t> row;
    for (int64_t i = 0; i < 10; ++i) {
      const int64_t id = local_id(p, r, i);
      ASSERT_GE(id, 0);
      ASSERT_TRUE(row.insert(id).second) << "duplicate";
      seen.insert(id);
    }
  }
  EXPECT_EQ(seen.size(), 40u) << "every key should be drawn somewhere";
  s.s_kv = 7;  // fewer keys than topk: all of them, then -1
  const GeneratedProblem q = make_problem(s);
  for (int64_t r = 0; r < num_q_rows(q); ++r) {
    std::set<int64_t> row;
    for (int64_t i = 0; i < 7; ++i) row.insert(local_id(q, r, i));
    EXPECT_EQ(row, (std::set<int64_t>{0, 1, 2, 3, 4, 5, 6}));
    for (int64_t i = 7; i < 10; ++i) EXPECT_EQ(get_id(q, r, i), -1);
  }
}

TEST(Generate, IndexScoreIsTheReferenceSoftmax) {
  for (IdPattern ids : {IdPattern::causal_topk, IdPattern::random_permutation}) {
    GenerateSpec s = small_spec(84);
    s.ids = ids;
    s.topk = 30;
    s.s_kv = 50;
    s.weights_f32 = ids == IdPattern::random_permutation;
    const GeneratedProblem p = make_problem(s);
    GeneratedProblem q = p;
    refresh_index_score(q);  // fp64 softmax of reference_index_logits
    EXPECT_TRUE(bitwise_equal(p.index_score, q.index_score));
  }
}

TEST(Generate, AttnScoreIsADistributionOverValidSlots) {
  GenerateSpec s = small_spec(85);
  s.topk = 20;
  const GeneratedProblem p = make_problem(s);
  double spread = 0;
  for (int64_t r = 0; r < num_q_rows(p); ++r) {
    double sum = 0, psum = 0, mx = 0, mn = 1;
    int64_t valid = 0;
    for (int64_t i = 0; i < 20; ++i) {
      const float t = p.attn_score.data<float>()[r * 20 + i], pr = p.index_score.data<float>()[r * 20 + i];
      if (!slot_valid(p, r, i)) {
        ASSERT_EQ(t, 0.0f);
        ASSERT_EQ(pr, 0.0f);
        continue;
      }
      ASSERT_GT(t, 0.0f);
      ++valid;
      sum += t;
      psum += pr;
      mx = std::max<double>(mx, t);
      mn = std::min<double>(mn, t);
    }
    ASSERT_NEAR(sum, 1.0, 1e-6);
    ASSERT_NEAR(psum, 1.0, 1e-6);
    if (valid > 1) spread = std::max(spread, mx / mn);
  }
  EXPECT_GT(spread, 2.0) << "attn_score should not be uniform";
}

TEST(Generate, Distributions) {
  GenerateSpec s = small_spec(86);
  s.heads = 64;
  s.head_dim = 128;
  s.s_kv = 64;
  s.topk = 4;
  const GeneratedProblem p = make_problem(s);
  auto moments = [](const std::vector<double>& v) {
    double m = 0, m2 = 0;
    for (double x : v) m += x;
    m /= v.size();
    for (double x : v) m2 += (x - m) * (x - m);
    return std::pair{m, m2 / v.size()};
  };
  const auto [qm, qv] = moments(to_doubles(p.index_q));
  const auto [km, kv] = moments(to_doubles(p.index_k));
  const auto [wm, wv] = moments(to_doubles(p.weights));
  EXPECT_NEAR(qm, 0.0, 0.02);
  EXPECT_NEAR(qv, 1.0, 0.03);
  EXPECT_NEAR(km, 0.0, 0.03);
  EXPECT_NEAR(kv, 1.0, 0.05);
  EXPECT_NEAR(wm, 0.0, 0.02);
  EXPECT_NEAR(wv * 64, 1.0, 0.1);
  // f32 weights are not bf16-rounded.
  s.weights_f32 = true;
  const GeneratedProblem f = make_problem(s);
  ASSERT_EQ(f.weights.dtype, DType::f32);
  int rounded = 0;
  for (int64_t e = 0; e < f.weights.numel(); ++e) {
    const float v = f.weights.data<float>()[e];
    rounded += detail::bf16_to_float(detail::float_to_bf16(v)) == v;
  }
  EXPECT_LT(rounded, f.weights.numel() / 10);
}

TEST(Generate, DeterministicAndThreadIndependent) {
  GenerateSpec s = small_spec(87);
  s.layout = Layout::thd;
  s.seqlens_q = {5, 40, 19};
  s.seqlens_k = {};
  s.topk = 16;
  s.num_threads = 1;
  const GeneratedProblem a = make_problem(s);
  s.num_threads = 2;
  EXPECT_TRUE(same_problem(a, make_problem(s)));
  s.num_threads = 5;
  EXPECT_TRUE(same_problem(a, make_problem(s)));
  s.num_threads = 0;
  EXPECT_TRUE(same_problem(a, make_problem(s)));
  s.seed = 88;
  const GeneratedProblem b = make_problem(s);
  EXPECT_FALSE(bitwise_equal(a.index_q, b.index_q));
  EXPECT_FALSE(bitwise_equal(a.topk_indices, b.topk_indices));
}

TEST(Generate, ViewsAndOptions) {
  GenerateSpec s = small_spec(89);
  s.layout = Layout::thd;
  s.seqlens_q = {3, 4};
  s.seqlens_k = {};  // same as seqlens_q
  s.id_mode = IdMode::global;
  const GeneratedProblem p = make_problem(s);
  const IndexerInputs in = p.inputs();
  ASSERT_TRUE(in.cu_seqlens_q.present());
  EXPECT_EQ(to_doubles(in.cu_seqlens_q), (std::vector<double>{0, 3, 7}));
  EXPECT_EQ(to_doubles(in.cu_seqlens_k), (std::vector<double>{0, 3, 7}));
  EXPECT_EQ(in.index_q.rank, 3);
  const IndexerOptions o = p.options();
  EXPECT_EQ(o.layout, Layout::thd);
  EXPECT_EQ(o.id_mode, IdMode::global);
  EXPECT_FLOAT_EQ(o.sm_scale, 0.125f);  // 1/sqrt(64)
  s = small_spec(89);
  s.sm_scale = 0.3f;
  const GeneratedProblem b = make_problem(s);
  EXPECT_FALSE(b.inputs().cu_seqlens_q.present());
  EXPECT_FALSE(b.inputs().cu_seqlens_k.present());
  EXPECT_EQ(b.options().sm_scale, 0.3f);
  EXPECT_EQ(b.index_q.shape, (std::vector<int64_t>{2, 24, 8, 64}));
  EXPECT_EQ(b.index_k.shape, (std::vector<int64_t>{2, 24, 64}));
}

/// A spec change that make_problem must reject as invalid_argument naming arg.
struct BadSpec {
  const char* arg;
  void (*mutate)(GenerateSpec&);
};

/// Runs every case on small_spec(seed) and checks the error; `also` adds the
/// assertions of the caller on its message.
template <size_t N, class Also>
void expect_rejected(const BadSpec (&bad)[N], uint64_t seed, Also also) {
  for (const BadSpec& b : bad) {
    GenerateSpec s = small_spec(seed);
    b.mutate(s);
    try {
      (void)make_problem(s);
      ADD_FAILURE() << "no error for " << b.arg;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << msg;
      EXPECT_EQ(e.argument(), b.arg) << msg;
      also(b, msg);
    }
  }
}

TEST(Generate, RejectsBadSpecs) {
  const BadSpec bad[] = {
      {"heads", [](GenerateSpec& s) { s.heads = 12; }},
      {"heads", [](GenerateSpec& s) { s.heads = 0; }},
      {"heads", [](GenerateSpec& s) { s.heads = 136; }},
      {"head_dim", [](GenerateSpec& s) { s.head_dim = 96; }},
      {"topk", [](GenerateSpec& s) { s.topk = 0; }},
      {"batch", [](GenerateSpec& s) { s.batch = -1; }},
      {"s_q", [](GenerateSpec& s) { s.s_q = -2; }},
      {"s_kv", [](GenerateSpec& s) { s.s_kv = -3; }},
      {"sm_scale", [](GenerateSpec& s) { s.sm_scale = std::nanf(""); }},
      {"num_threads", [](GenerateSpec& s) { s.num_threads = -1; }},
      {"layout", [](GenerateSpec& s) { s.layout = static_cast<Layout>(3); }},
      {"ids", [](GenerateSpec& s) { s.ids = static_cast<IdPattern>(9); }},
      {"seqlens_q", [](GenerateSpec& s) { s.layout = Layout::thd; }},
      {"seqlens_q", [](GenerateSpec& s) {
         s.layout = Layout::thd;
         s.seqlens_q = {3, -1};
       }},
      {"seqlens_k", [](GenerateSpec& s) {
         s.layout = Layout::thd;
         s.seqlens_q = {3, 4};
         s.seqlens_k = {3};
       }},
  };
  expect_rejected(bad, 90, [](const BadSpec& b, const std::string& msg) {
    EXPECT_EQ(msg.rfind(std::string(b.arg) + ": expected ", 0), 0u) << msg;
    EXPECT_NE(msg.find(", got "), std::string::npos) << msg;
  });
}

/// Sizes whose row counts overflow int64 or exceed the 2^31 - 1 row limit are
/// errors raised before anything is allocated (no crash, no bad_alloc).
TEST(Generate, RejectsSizesBeyondTheRowLimitWithoutOverflow) {
  constexpr int64_t kHuge = int64_t{1} << 62;
  const BadSpec bad[] = {
      {"s_q", [](GenerateSpec& s) { s.batch = 4, s.s_q = kHuge, s.s_kv = 0; }},          // B*S_q wraps to 0
      {"s_q", [](GenerateSpec& s) { s.batch = 2, s.s_q = kHuge, s.s_kv = 1; }},          // B*S_q = -2^63
      {"s_q", [](GenerateSpec& s) { s.batch = 2, s.s_q = int64_t{1} << 30, s.s_kv = 1; }},  // 2^31 rows
      {"s_kv", [](GenerateSpec& s) { s.batch = 4, s.s_q = 1, s.s_kv = kHuge; }},
      {"batch", [](GenerateSpec& s) { s.batch = 4000000000, s.s_q = 0, s.s_kv = 0; }},
      {"topk", [](GenerateSpec& s) { s.topk = int64_t{1} << 40; }},
      {"seqlens_q", [](GenerateSpec& s) {
         s.layout = Layout::thd;
         s.seqlens_q = {kHuge, kHuge, kHuge, kHuge};  // sums to 2^64 = 0 (mod 2^64)
       }},
      {"seqlens_k", [](GenerateSpec& s) {
         s.layout = Layout::thd;
         s.seqlens_q = {1, 1};
         s.seqlens_k = {std::numeric_limits<int64_t>::max(), 2};
       }},
  };
  expect_rejected(bad, 91, [](const BadSpec&, const std::string& msg) {
    EXPECT_NE(msg.find("2147483647"), std::string::npos) << msg;
  });
}

/// A problem within the row limits but larger than the machine's memory and swap
/// is an out_of_memory error raised before anything is allocated (the per-sequence
/// tables of 2^31 - 1 sequences grew until the kernel killed the process).
TEST(Generate, ProblemBeyondHostMemoryIsOutOfMemory) {
#if !defined(__linux__)
  GTEST_SKIP() << "the estimate compares with sysinfo's memory and swap (Linux)";
#endif
  for (const bool thd : {false, true}) {
    GenerateSpec s = small_spec(95);
    s.heads = 128, s.head_dim = 128;  // ~64 TiB at 2^31 - 1 rows: beyond any host's memory
    if (thd) {
      s.layout = Layout::thd;
      s.seqlens_q = {int64_t{1} << 30, (int64_t{1} << 30) - 1};  // 2^31 - 1 rows of H x D bf16: ~TiB
    } else {
      s.batch = 2147483647;
      s.s_q = 1;
      s.s_kv = 1;
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      (void)make_problem(s);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << e.what();
      EXPECT_NE(std::string(e.what()).find("GiB of host memory"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0) << "thd " << thd;
  }
}

/// BSHD without query rows: no per-sequence table, so a problem of no bytes
/// needs no memory that grows with B; the keys of S_q 0, S_kv > 0 are still drawn.
TEST(Generate, EmptyProblemOfHugeBatchNeedsNoMemoryPerBatch) {
  if (kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  GenerateSpec s = small_spec(97);
  s.batch = 2147483647, s.s_q = 0, s.s_kv = 0;
  EXPECT_EXIT(exit_with_call_status_under_address_limit(size_t{64} << 20,
                                                        [&] {
                                                          const GeneratedProblem p = generate_problem(s);
                                                          if (p.index_q.shape[0] != s.batch) std::_Exit(13);
                                                        }),
              ::testing::ExitedWithCode(0), "");
  s.batch = 5, s.s_q = 0, s.s_kv = 3;
  const GeneratedProblem p = make_problem(s);
  ASSERT_EQ(p.index_k.numel(), 5 * 3 * s.head_dim);
  EXPECT_EQ(p.topk_indices.numel(), 0);
  bool any_nonzero = false;
  for (int64_t e = 0; e < p.index_k.numel(); ++e) any_nonzero = any_nonzero || p.index_k.data<uint16_t>()[e] != 0;
  EXPECT_TRUE(any_nonzero) << "the keys are drawn";
}

/// In a child process under an address-space limit 64 MiB above what is mapped:
/// a spec within this machine's memory (so the estimate lets it through) whose
/// tensors (~0.2 GB of ids and scores) cannot be allocated, on two threads.
/// Exits 0 when generate_problem raised out_of_memory (a std::bad_alloc escaped
/// before), else a code that says which check failed.
[[noreturn]] void generate_beyond_address_space_child() {
  GenerateSpec s = small_spec(96);
  s.batch = 1, s.s_q = 4096, s.s_kv = 4096, s.topk = 4096, s.heads = 8, s.head_dim = 64, s.num_threads = 2;
  if (!limit_address_space(size_t{64} << 20)) std::_Exit(11);
  try {
    (void)generate_problem(s);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::out_of_memory) std::_Exit(12);
    if (std::string(e.what()).find("out of memory: expected room in host memory") != 0) std::_Exit(13);
    std::_Exit(0);
  } catch (...) {
    std::_Exit(14);  // e.g. std::bad_alloc
  }
  std::_Exit(15);  // it ran: the limit did not bite
}

// A huge topk over short sequences: the per-thread scratch is sized by the
// selectable slots (min(topk, longest key sequence)), not by topk.
TEST(Generate, ScratchIsSizedBySelectableSlots) {
  GenerateSpec s = small_spec(97);
  s.batch = 2, s.s_q = 3, s.s_kv = 5, s.topk = 20000, s.heads = 8, s.head_dim = 64;  // scratch: 5 slots per thread
  const GeneratedProblem p = make_problem(s);
  EXPECT_EQ(topk(p), 20000);
  const int32_t* ids = p.topk_indices.data<int32_t>();
  for (int64_t r = 0; r < 6; ++r) {
    int valid = 0;
    for (int64_t i = 0; i < 20000; ++i) valid += ids[r * 20000 + i] >= 0;
    EXPECT_EQ(valid, r % 3 + 3) << "row " << r;  // causal, queries at the end of the keys: t + 1 + (S_kv - S_q)
  }
}

TEST(Generate, AllocationFailureIsOutOfMemory) {
  if (kSanitizedBuild) GTEST_SKIP() << "address-space limits and sanitizer shadow memory do not mix";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(generate_beyond_address_space_child(), ::testing::ExitedWithCode(0), "");
}

/// The documented speed: B1 S1024 H64 D128 topk 256 causal in a few seconds on 2 cores.
TEST(Generate, RealisticSizeIsFast) {
  GenerateSpec s;
  s.batch = 1;
  s.s_q = s.s_kv = 1024;
  s.heads = 64;
  s.head_dim = 128;
  s.topk = 256;
  s.seed = 91;
  const auto t0 = std::chrono::steady_clock::now();
  const GeneratedProblem p = make_problem(s);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("B1 S1024 H64 D128 topk256 causal: %.2f s\n", sec);
  EXPECT_LT(sec, 30.0);
  // The last row has 256 valid ids; row 99 has 100.
  int valid = 0;
  for (int64_t i = 0; i < 256; ++i) valid += get_id(p, 99, i) >= 0;
  EXPECT_EQ(valid, 100);
  EXPECT_GE(get_id(p, 1023, 255), 0);
}

}  // namespace
}  // namespace dsaib::test
