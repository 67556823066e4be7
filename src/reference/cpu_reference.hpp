// Internal entry of the cpu backend (the fp64 reference writing into outputs).
#pragma once

#include "core/problem.hpp"

namespace dsaib::detail {

/// Runs the fp64 reference and writes the outputs (cast to their dtypes).
/// `g` comes from validate_problem(); nothing is validated here.
void run_cpu_backend(const IndexerBackwardInputs& in, const IndexerBackwardOutputs& out,
                     const IndexerBackwardOptions& opt, const ProblemGeometry& g);

}  // namespace dsaib::detail

#include "dsaib/indexer_kl_forward.hpp"

namespace dsaib::detail {

/// The cpu backend of indexer_kl_forward(): the fp64 forward, cast to f32 outputs.
/// `g` comes from validate_kl_forward_problem(); nothing is validated here.
void run_cpu_kl_forward(const IndexerBackwardInputs& in, const IndexerKLForwardOutputs& out,
                        const IndexerBackwardOptions& opt, const ProblemGeometry& g);

}  // namespace dsaib::detail
