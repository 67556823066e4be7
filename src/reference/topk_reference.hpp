// The cpu backend of indexer_topk() (src/reference/topk_reference.cpp).
#pragma once

#include "core/problem.hpp"
#include "dsaib/indexer_topk.hpp"

namespace dsaib::detail {

/// Each row's exact selection from fp64 logits, written to the outputs (ids in
/// options.order, logits rounded once to f32 or stored unrounded in f64,
/// counts). `g` comes from validate_topk_problem(); nothing is validated here.
void run_cpu_indexer_topk(const IndexerTopkInputs& in, const IndexerTopkOutputs& out, const IndexerTopkOptions& opt,
                          const ProblemGeometry& g);

}  // namespace dsaib::detail
