// The generator's sizes and sequences (generate.cpp): the spec's checks and
// the per-sequence row ranges it resolves. Internal to src/generate.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "dsaib/generate.hpp"

namespace dsaib::generate {

inline constexpr int kAttnHeads = 4;  // main-attention heads drawn for attn_score
inline constexpr int kAttnDim = 32;   // their head dim

/// Rows (query rows, key rows, sequences) and topk: at most 2^31 - 1, since ids
/// and cu_seqlens are int32. Every size product of the generator then fits int64.
inline constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();

struct Sequences {
  std::vector<int64_t> q_start, q_len, k_start, k_len;
  std::vector<int32_t> seq_of_q_row;
  int64_t num_q_rows = 0, num_k_rows = 0, max_k_len = 0;
};

/// Validates the spec (invalid_argument naming the field; out_of_memory when
/// the problem cannot fit this machine's memory) and resolves the
/// per-sequence row ranges.
Sequences resolve(const GenerateSpec& spec);

}  // namespace dsaib::generate
