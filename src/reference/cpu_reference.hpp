// Internal entry of the cpu backend (the fp64 reference writing into outputs).
#pragma once

#include <vector>

#include "core/problem.hpp"

namespace dsaib::detail {

/// Per query row (flat, num_q_rows each): the P-free form's LSE and target mass in fp64.
struct RowStatistics {
  std::vector<double> lse, target_mass;
};

/// Runs the fp64 reference and writes the outputs (cast to their dtypes).
/// `g` comes from validate_problem(); nothing is validated here. `stats`, when
/// given, are the P-free form's row statistics (instead of the inputs' row_lse
/// and row_target_mass tensors).
void run_cpu_backend(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                     const IndexerOptions& opt, const ProblemGeometry& g,
                     const RowStatistics* stats = nullptr);

}  // namespace dsaib::detail

#include "dsaib/indexer_kl_forward.hpp"

namespace dsaib::detail {

/// The cpu backend of indexer_kl_forward(): the fp64 forward, cast to f32 outputs.
/// `g` comes from validate_kl_forward_problem(); nothing is validated here.
void run_cpu_kl_forward(const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                        const IndexerOptions& opt, const ProblemGeometry& g);

}  // namespace dsaib::detail
