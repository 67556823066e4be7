// Validation of attention_target()'s arguments (src/api/attention_target.cpp),
// shared by the entry point, its workspace query and the fp64 reference.
#pragma once

#include "core/problem.hpp"
#include "dsaib/attention_target.hpp"

namespace dsaib::detail {

/// The options attention_target() shares with the indexer (layout, id_mode,
/// backend, sm_scale, strict_indices, stream, num_threads), as the indexer's
/// options, for the rules and helpers written for those.
IndexerOptions as_indexer_options(const AttentionTargetOptions& opt);

/// The option rules checked first (errors.md "Options"): layout, id_mode,
/// backend and lse_base are values of their enums, then, for backend cuda, its
/// availability (backend_unavailable). Touches no tensor.
void check_attention_target_options_and_backend(const AttentionTargetOptions& opt);

/// Validates every argument of attention_target() in docs/errors.md's order
/// (options, backend availability, each tensor, sizes and shapes, output,
/// cuda-only rules, scalars, sequences, strict ids) and returns the geometry:
/// heads = Hq, head_dim = Dqk. `out` null: the inputs and options only (the
/// reference). `copy_to_host` and `stream_capturing` as for validate_problem().
/// Never writes anything.
ProblemGeometry validate_attention_target_problem(const AttentionTargetInputs& in, const AttentionTargetOutputs* out,
                                                  const AttentionTargetOptions& opt, CopyToHost copy_to_host,
                                                  bool stream_capturing);

}  // namespace dsaib::detail
