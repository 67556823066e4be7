// The fp64 CPU reference: the oracle every backend is tested against.
// Implements docs/math.md exactly, accumulating in double, deterministically.
#pragma once

#include <cstdint>
#include <vector>

#include "dsaib/indexer_backward.hpp"

namespace dsaib {

/// Gradients in fp64, row-major and contiguous:
///   d_index_q (num_q_rows, H, D), d_weights (num_q_rows, H), d_index_k (num_k_rows, D)
/// with flat rows as in the layout (BSHD: b*S_q + t and b*S_kv + s).
struct ReferenceGradients {
  int64_t num_q_rows = 0, num_k_rows = 0, heads = 0, head_dim = 0;
  std::vector<double> d_index_q, d_weights, d_index_k;
};

/// Full fp64 backward of the inputs (host tensors; outputs not needed).
/// Raises the same errors as indexer_backward() for the inputs and options.
/// options.backend is ignored (always cpu); options.num_threads is honoured,
/// and the result is bitwise identical for a given num_threads.
ReferenceGradients reference_backward(const IndexerInputs& inputs, const IndexerOptions& options);

/// fp64 gradients of selected rows only, for verifying large problems:
/// d_index_q/d_weights for the flat query rows `q_rows` (shape (q_rows.size(), H, D)
/// and (q_rows.size(), H)), and d_index_k for the flat key rows `k_rows`
/// (shape (k_rows.size(), D)), in the order given; a row may be requested more than
/// once (each position gets its gradient). Cost: O(|q_rows| * topk * H * D) plus, for dK,
/// a scan of all ids and O(H * D) per selection of a requested key row. Raises the
/// errors of reference_backward(), and invalid_argument naming q_rows / k_rows for a
/// row outside [0, number of rows).
struct SampledReferenceGradients {
  std::vector<int64_t> q_rows, k_rows;
  int64_t heads = 0, head_dim = 0;
  std::vector<double> d_index_q, d_weights, d_index_k;
};
SampledReferenceGradients reference_backward_sampled(const IndexerInputs& inputs,
                                                     const IndexerOptions& options,
                                                     const std::vector<int64_t>& q_rows,
                                                     const std::vector<int64_t>& k_rows);

/// Index logits z (num_q_rows, topk) in fp64: z_i = sm_scale * sum_h w_h relu(q_h . k_{id_i})
/// for valid slots; -infinity for invalid ones.
std::vector<double> reference_index_logits(const IndexerInputs& inputs, const IndexerOptions& options);

}  // namespace dsaib
