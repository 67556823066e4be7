// The generator's sizes and sequences (sequences.hpp).
#include "generate/sequences.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/sysinfo.h>
#endif

#include "core/threads.hpp"
#include "dsaib/error.hpp"

namespace dsaib::generate {
namespace {

const std::string kMaxRowsText = "2147483647 (2^31 - 1)";

[[noreturn]] void fail(const std::string& arg, const std::string& expected, const std::string& got) {
  throw Error(ErrorCode::invalid_argument, arg, arg + ": expected " + expected + ", got " + got);
}


std::string sizes_string(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

/// Host bytes the problem will hold at once (its tensors, the key-side
/// temporaries, the per-sequence tables and each thread's row scratch: per
/// selectable slot (min(topk, longest key sequence)) its id, logit, attention
/// sums and a swap, and per key of the longest sequence a score, a candidate
/// and a permutation entry), from the spec's sizes and the row and sequence
/// counts resolve() has checked.
double estimated_host_bytes(const GenerateSpec& spec, int64_t q_rows, int64_t k_rows, int64_t sequences,
                            int64_t max_k_len) {
  const double tq = static_cast<double>(q_rows), tk = static_cast<double>(k_rows),
               nseq = static_cast<double>(sequences);
  const double H = static_cast<double>(spec.heads), D = static_cast<double>(spec.head_dim),
               K = static_cast<double>(spec.topk);
  const double threads = detail::thread_count(spec.num_threads, std::max(q_rows, k_rows));
  const double selectable = std::min(K, static_cast<double>(max_k_len));
  return tq * H * D * 2 + tq * H * 4 + tk * D * (2 + 4) + tk * kAttnHeads * kAttnDim * 4 + tq * K * 4 * 3 +
         tq * 4 + nseq * 4 * 8 + nseq * 2 * 4 +
         threads * (selectable * (8 + 8 + 8 + 8 + 16) + static_cast<double>(max_k_len) * (4 + 4 + 4));
}

/// Host memory and swap of this machine in bytes (0: unknown).
double host_memory_and_swap_bytes() {
#if defined(__linux__)
  struct sysinfo info{};
  if (sysinfo(&info) == 0) {
    return (static_cast<double>(info.totalram) + static_cast<double>(info.totalswap)) * info.mem_unit;
  }
#endif
  return 0;
}

}  // namespace

Sequences resolve(const GenerateSpec& spec) {
  if (spec.layout != Layout::bshd && spec.layout != Layout::thd) {
    fail("layout", "bshd or thd", std::to_string(static_cast<int>(spec.layout)));
  }
  if (spec.id_mode != IdMode::local && spec.id_mode != IdMode::global) {
    fail("id_mode", "local or global", std::to_string(static_cast<int>(spec.id_mode)));
  }
  if (spec.ids != IdPattern::causal_topk && spec.ids != IdPattern::random_permutation) {
    fail("ids", "causal_topk or random_permutation", std::to_string(static_cast<int>(spec.ids)));
  }
  if (spec.heads < 8 || spec.heads > 128 || spec.heads % 8 != 0) {
    fail("heads", "a multiple of 8 in [8, 128]", std::to_string(spec.heads));
  }
  if (spec.head_dim != 64 && spec.head_dim != 128) fail("head_dim", "64 or 128", std::to_string(spec.head_dim));
  if (spec.topk < 1) fail("topk", ">= 1", std::to_string(spec.topk));
  if (!std::isfinite(spec.sm_scale)) fail("sm_scale", "a finite value (0 = 1/sqrt(head_dim))", std::to_string(spec.sm_scale));
  if (spec.num_threads < 0) fail("num_threads", ">= 0 (0 = all hardware threads)", std::to_string(spec.num_threads));

  if (spec.topk > kMaxRows) fail("topk", "at most " + kMaxRowsText, std::to_string(spec.topk));

  Sequences s;
  // Before any table or tensor is allocated: a problem larger than this
  // machine's memory and swap is an out_of_memory error, not a process the
  // kernel kills while its per-sequence tables grow. It runs after the shape
  // rules, before the tables. (sysinfo gives the host's memory: a container's
  // cgroup limit is not seen, and a problem above it fails when allocating.)
  const auto check_memory = [&spec](int64_t q_rows, int64_t k_rows, int64_t sequences, int64_t max_k_len) {
    const double need = estimated_host_bytes(spec, q_rows, k_rows, sequences, max_k_len),
                 have = host_memory_and_swap_bytes();
    if (have > 0 && need > have) {
      char text[256];
      std::snprintf(text, sizeof text,
                    "out of memory: expected a problem that fits this machine's %.1f GiB of memory and swap, got one "
                    "that needs about %.1f GiB of host memory",
                    have / 1073741824.0, need / 1073741824.0);
      throw Error(ErrorCode::out_of_memory, "", text);
    }
  };
  if (spec.layout == Layout::bshd) {
    if (spec.batch < 0) fail("batch", ">= 0", std::to_string(spec.batch));
    if (spec.s_q < 0) fail("s_q", ">= 0", std::to_string(spec.s_q));
    if (spec.s_kv < 0) fail("s_kv", ">= 0", std::to_string(spec.s_kv));
    // Checked before anything is allocated: B, B*S_q and B*S_kv all at most kMaxRows.
    if (spec.batch > kMaxRows) fail("batch", "at most " + kMaxRowsText + " sequences", std::to_string(spec.batch));
    int64_t tq = 0, tk = 0;
    if (__builtin_mul_overflow(spec.batch, spec.s_q, &tq) || tq > kMaxRows) {
      fail("s_q", "batch * s_q <= " + kMaxRowsText + " query rows in all",
           "batch " + std::to_string(spec.batch) + " * s_q " + std::to_string(spec.s_q) +
               (tq > kMaxRows ? " = " + std::to_string(tq) : std::string(" (overflows int64)")));
    }
    if (__builtin_mul_overflow(spec.batch, spec.s_kv, &tk) || tk > kMaxRows) {
      fail("s_kv", "batch * s_kv <= " + kMaxRowsText + " key rows in all",
           "batch " + std::to_string(spec.batch) + " * s_kv " + std::to_string(spec.s_kv) +
               (tk > kMaxRows ? " = " + std::to_string(tk) : std::string(" (overflows int64)")));
    }
    // No query rows: no sequence has work and no table is built, so that a
    // problem of no bytes does not need memory that grows with B (as the
    // library's validation).
    const int64_t sequences = tq > 0 ? spec.batch : 0;
    check_memory(tq, tk, sequences, tq > 0 ? spec.s_kv : 0);
    for (int64_t b = 0; b < sequences; ++b) {
      s.q_start.push_back(b * spec.s_q);
      s.q_len.push_back(spec.s_q);
      s.k_start.push_back(b * spec.s_kv);
      s.k_len.push_back(spec.s_kv);
    }
    s.num_q_rows = tq;
    s.num_k_rows = tk;  // without query rows too: the keys are generated, though no row reads them
  } else {
    if (spec.seqlens_q.empty()) fail("seqlens_q", "at least one sequence length for layout thd", "none");
    const std::vector<int64_t>& lk = spec.seqlens_k.empty() ? spec.seqlens_q : spec.seqlens_k;
    if (lk.size() != spec.seqlens_q.size()) {
      fail("seqlens_k", std::to_string(spec.seqlens_q.size()) + " lengths (one per sequence of seqlens_q) or none",
           std::to_string(lk.size()) + " lengths");
    }
    // Checked (no int64 overflow) before anything is allocated: the totals fit
    // cu_seqlens (int32), at most kMaxRows rows each.
    int64_t tq = 0, tk = 0;
    for (size_t b = 0; b < lk.size(); ++b) {
      if (spec.seqlens_q[b] < 0) fail("seqlens_q", "lengths >= 0", sizes_string(spec.seqlens_q));
      if (lk[b] < 0) fail("seqlens_k", "lengths >= 0", sizes_string(lk));
      if (__builtin_add_overflow(tq, spec.seqlens_q[b], &tq) || tq > kMaxRows) {
        fail("seqlens_q", "lengths summing to at most " + kMaxRowsText + " query rows (cu_seqlens are int32)",
             sizes_string(spec.seqlens_q));
      }
      if (__builtin_add_overflow(tk, lk[b], &tk) || tk > kMaxRows) {
        fail(spec.seqlens_k.empty() ? "seqlens_q" : "seqlens_k",
             "lengths summing to at most " + kMaxRowsText + " key rows (cu_seqlens are int32)", sizes_string(lk));
      }
    }
    check_memory(tq, tk, static_cast<int64_t>(lk.size()), lk.empty() ? 0 : *std::max_element(lk.begin(), lk.end()));
    tq = 0, tk = 0;  // the sums are in range: no overflow below
    for (size_t b = 0; b < lk.size(); ++b) {
      s.q_start.push_back(tq);
      s.q_len.push_back(spec.seqlens_q[b]);
      s.k_start.push_back(tk);
      s.k_len.push_back(lk[b]);
      tq += spec.seqlens_q[b];
      tk += lk[b];
    }
    s.num_q_rows = tq;
    s.num_k_rows = tk;
  }
  for (const int64_t n : s.k_len) s.max_k_len = std::max(s.max_k_len, n);
  s.seq_of_q_row.resize(static_cast<size_t>(s.num_q_rows));
  for (size_t b = 0; b < s.q_len.size(); ++b) {
    for (int64_t t = 0; t < s.q_len[b]; ++t) s.seq_of_q_row[s.q_start[b] + t] = static_cast<int32_t>(b);
  }
  return s;
}

}  // namespace dsaib::generate
