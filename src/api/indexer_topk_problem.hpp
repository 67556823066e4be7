// Validation of indexer_topk()'s arguments (src/api/indexer_topk.cpp), shared
// by the entry point, its workspace query, the fp64 reference and the checker.
#pragma once

#include <cstdint>

#include "core/problem.hpp"
#include "dsaib/indexer_topk.hpp"

namespace dsaib::detail {

/// The options indexer_topk() shares with the indexer (layout, id_mode,
/// backend, stream, num_threads), as the indexer's options, for the rules
/// written for those (check_options, check_options_and_backend).
IndexerOptions as_indexer_options(const IndexerTopkOptions& opt);

/// The option rules checked first (errors.md "Options"): layout, id_mode,
/// backend and order are values of their enums, then, for backend cuda, its
/// availability (backend_unavailable). Touches no tensor.
void check_topk_options_and_backend(const IndexerTopkOptions& opt);

/// Validates every argument of indexer_topk() in docs/errors.md's order
/// (options, backend availability, each tensor, sizes and shapes, outputs,
/// cuda-only rules, scalars, sequences, strict ranges) and returns the
/// geometry: heads = H, head_dim = D, topk = topk_indices' last dimension, the
/// row counts and per-sequence tables. `out` null: the inputs and options only
/// (the reference), with `topk` giving the selection's size. `copy_to_host`
/// and `stream_capturing` as for validate_problem(). Never writes anything.
ProblemGeometry validate_topk_problem(const IndexerTopkInputs& in, const IndexerTopkOutputs* out,
                                      const IndexerTopkOptions& opt, CopyToHost copy_to_host, bool stream_capturing,
                                      int64_t topk = 0);

/// Row r's visible keys [*lo, *hi) as positions in its sequence's keys
/// (0 <= lo <= hi <= its key count; lo == hi: none): starts/ends clipped to the
/// sequence, or the causal rule with options.causal_offset. Host tensors only.
void topk_visible_range(const IndexerTopkInputs& in, const IndexerTopkOptions& opt, const ProblemGeometry& g,
                        int64_t r, int64_t* lo, int64_t* hi);

}  // namespace dsaib::detail
