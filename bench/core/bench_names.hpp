// The bench's vocabulary that needs no CUDA: the ops, the id patterns of a case
// and the decimal-flag rule. Header-only, so that the bench's flags (cli/bench_command.cpp)
// are checked the same way in builds without the cuda backend (where dsaib_bench,
// bench_core.hpp, is not built) as in the bench core.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace dsaib::bench {

/// The op a case times: the backward (indexer_backward given P: dK zeroing, fused
/// kernel, bf16 cast), the loss forward (indexer_kl_forward: the fused forward kernel
/// and the fixed-order sum of the loss terms), the training step of an autograd loss
/// (the forward, then the P-free indexer_backward from its row statistics: two library
/// calls), the loss and gradients in one call (indexer_kl_loss_and_grad), the
/// attention target (attention_target: heads = Hq, dim = Dqk), or the indexer's
/// top-k (indexer_topk: the logits of every visible key and their topk best).
enum class BenchOp { backward, kl_forward, step, one_call, target, topk };
inline constexpr BenchOp kBenchOps[] = {BenchOp::backward, BenchOp::kl_forward, BenchOp::step, BenchOp::one_call,
                                        BenchOp::target,   BenchOp::topk};

/// "backward", "forward", "step", "one-call", "target", "topk" (the --op words).
inline const char* bench_op_name(BenchOp op) {
  switch (op) {
    case BenchOp::kl_forward: return "forward";
    case BenchOp::step: return "step";
    case BenchOp::one_call: return "one-call";
    case BenchOp::target: return "target";
    case BenchOp::topk: return "topk";
    case BenchOp::backward: break;
  }
  return "backward";
}

/// The names of kBenchOps, comma-separated, for messages.
inline std::string bench_op_list() {
  std::string s;
  for (BenchOp op : kBenchOps) s += (s.empty() ? "" : ", ") + std::string(bench_op_name(op));
  return s;
}

/// One of bench_op_name's words; false for anything else.
inline bool parse_bench_op(const std::string& word, BenchOp* out) {
  for (BenchOp op : kBenchOps) {
    if (word == bench_op_name(op)) {
      *out = op;
      return true;
    }
  }
  return false;
}

/// causal: row t selects min(t+1, topk) keys of 0..t (the rest -1, empty); random: topk
/// (at most S_kv) distinct keys of the whole sequence. Ids ascending within a row, or, in
/// the -shuffled patterns, the same draw in a random order within the row (the order a
/// top-k by score returns them in, which is unrelated to the id). attn_score and
/// index_score random, normalised over the valid slots.
enum class IdPattern { causal, random, causal_shuffled, random_shuffled };
inline constexpr IdPattern kIdPatterns[] = {IdPattern::causal, IdPattern::random, IdPattern::causal_shuffled,
                                            IdPattern::random_shuffled};

/// "causal" / "random" / "causal-shuffled" / "random-shuffled".
inline const char* id_pattern_name(IdPattern p) {
  switch (p) {
    case IdPattern::causal: return "causal";
    case IdPattern::random: return "random";
    case IdPattern::causal_shuffled: return "causal-shuffled";
    case IdPattern::random_shuffled: return "random-shuffled";
  }
  return "unknown";
}

/// The names of kIdPatterns, comma-separated ("causal, random, ..."), for messages.
inline std::string id_pattern_list() {
  std::string s;
  for (IdPattern p : kIdPatterns) s += (s.empty() ? "" : ", ") + std::string(id_pattern_name(p));
  return s;
}

/// Keys 0..t only (causal, causal-shuffled).
inline bool is_causal(IdPattern p) { return p == IdPattern::causal || p == IdPattern::causal_shuffled; }
/// Ids in a random order within the row (causal-shuffled, random-shuffled).
inline bool is_shuffled(IdPattern p) { return p == IdPattern::causal_shuffled || p == IdPattern::random_shuffled; }

/// One of the names of id_pattern_name; false for anything else.
inline bool parse_id_pattern(const std::string& s, IdPattern* out) {
  for (IdPattern p : kIdPatterns) {
    if (s == id_pattern_name(p)) {
      *out = p;
      return true;
    }
  }
  return false;
}

/// The keys each query row of a topk case sees (S = --seq keys, B 1):
///   causal    S_q = S query rows, row t sees keys [0, t + 1) (no starts/ends);
///   cp-shard  a context-parallel shard: the S/2 query rows of the sequence's second
///             half against all S (all-gathered) keys, row t seeing [0, S/2 + t + 1),
///             given as starts/ends.
enum class TopkRanges { causal, cp_shard };
inline constexpr TopkRanges kTopkRanges[] = {TopkRanges::causal, TopkRanges::cp_shard};

/// "causal" / "cp-shard" (the --ranges words).
inline const char* topk_ranges_name(TopkRanges r) { return r == TopkRanges::cp_shard ? "cp-shard" : "causal"; }

/// The names of kTopkRanges, comma-separated, for messages.
inline std::string topk_ranges_list() {
  std::string s;
  for (TopkRanges r : kTopkRanges) s += (s.empty() ? "" : ", ") + std::string(topk_ranges_name(r));
  return s;
}

/// One of topk_ranges_name's words; false (and *out unchanged) for anything else.
inline bool parse_topk_ranges(const std::string& word, TopkRanges* out) {
  for (TopkRanges r : kTopkRanges) {
    if (word == topk_ranges_name(r)) {
      *out = r;
      return true;
    }
  }
  return false;
}

/// The dtype of a topk case's index_q and index_k (--topk-dtype): "bf16" or "e4m3";
/// false (and *e4m3 unchanged) for anything else.
inline bool parse_topk_dtype(const std::string& word, bool* e4m3) {
  if (word != "bf16" && word != "e4m3") return false;
  *e4m3 = word == "e4m3";
  return true;
}

/// The lse of a target case (--target-lse): "given" (an lse input) or "absent" (each
/// head's softmax over the selected keys, the kernel's two sweeps); false (and *given
/// unchanged) for anything else.
inline bool parse_target_lse(const std::string& word, bool* given) {
  if (word != "given" && word != "absent") return false;
  *given = word == "given";
  return true;
}

/// Query rows of a topk case of S keys: S (causal), S / 2 (cp-shard).
inline int64_t topk_query_rows(TopkRanges r, int64_t seq) { return r == TopkRanges::cp_shard ? seq / 2 : seq; }

/// The keys the case's query rows see, summed over its rows: S (S + 1) / 2 (causal);
/// Q (S - Q) + Q (Q + 1) / 2 with Q = S / 2 (cp-shard). In double: exact below 2^53.
inline double topk_visible_keys(TopkRanges r, int64_t seq) {
  const double s = static_cast<double>(seq), q = static_cast<double>(topk_query_rows(r, seq));
  return r == TopkRanges::cp_shard ? q * (s - q) + q * (q + 1) / 2 : s * (s + 1) / 2;
}

/// A decimal number in [lo, hi] (the tools' millisecond and MiB flags): blanks,
/// trailing characters, hex, inf and nan are rejected; -0 reads as 0.
inline bool parse_bounded_decimal(const std::string& v, double lo, double hi, double* out) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || v.find_first_of("xXpP \t\n\v\f\r") != std::string::npos || end != v.c_str() + v.size() ||
      !std::isfinite(x) || x < lo || x > hi) {
    return false;
  }
  *out = x + 0.0;
  return true;
}

}  // namespace dsaib::bench
