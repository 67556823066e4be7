// Which keys a query row sees, on the device (the host's rules:
// src/api/indexer_topk.cpp): the row's sequence, then [starts, ends) clipped
// to the sequence's keys, or the causal prefix.
#pragma once

#include <cstdint>

#include "hopper/common/kernel_params.hpp"
#include "hopper/common/problem_device.cuh"

namespace dsaib::hopper {

/// A query row's sequence: its first query row and count, its first key row and count.
struct TopkRowSequence {
  int64_t q_start, q_len;
  int64_t k_start, k_len;
};

__device__ inline TopkRowSequence topk_row_sequence(const IndexerTopkParams& p, int64_t row) {
  if (!p.thd) {
    const int64_t b = row / p.q_rows_per_batch;
    return {b * p.q_rows_per_batch, p.q_rows_per_batch, b * p.k_rows_per_batch, p.k_rows_per_batch};
  }
  const int b = sequence_of_q_row(p.cu_seqlens_q, p.batch, row);
  const int64_t qs = p.cu_seqlens_q[b], ks = p.cu_seqlens_k[b];
  return {qs, static_cast<int64_t>(p.cu_seqlens_q[b + 1]) - qs, ks, static_cast<int64_t>(p.cu_seqlens_k[b + 1]) - ks};
}

/// The flat key rows [*begin, *end) that query row `row` sees; *begin == *end when none.
__device__ inline void topk_row_keys(const IndexerTopkParams& p, int64_t row, int64_t* begin, int64_t* end) {
  const TopkRowSequence seq = topk_row_sequence(p, row);
  int64_t lo, hi;  // in the sequence's key positions
  if (p.starts != nullptr) {
    const int64_t s = p.starts[batched_offset(row, p.q_rows_per_batch, p.starts_batch_stride, p.starts_row_stride)];
    const int64_t e = p.ends[batched_offset(row, p.q_rows_per_batch, p.ends_batch_stride, p.ends_row_stride)];
    // THD ranges are flat key rows
    lo = p.thd ? s - seq.k_start : s;
    hi = p.thd ? e - seq.k_start : e;
  } else {
    const int64_t offset = p.causal_offset_auto ? seq.k_len - seq.q_len : p.causal_offset;
    lo = 0;
    // offset is any int64: past the keys, every key (no overflow in t + offset + 1)
    hi = offset >= seq.k_len ? seq.k_len : (row - seq.q_start) + offset + 1;
  }
  lo = max(lo, int64_t{0});
  hi = min(hi, seq.k_len);
  if (hi < lo) hi = lo;
  *begin = seq.k_start + lo;
  *end = seq.k_start + hi;
}

}  // namespace dsaib::hopper
