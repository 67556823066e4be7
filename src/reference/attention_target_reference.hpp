// The cpu backend of attention_target() (src/reference/attention_target_reference.cpp).
#pragma once

#include "core/problem.hpp"
#include "dsaib/attention_target.hpp"

namespace dsaib::detail {

/// The fp64 target of every row, rounded once to the f32 attn_score. `g` comes
/// from validate_attention_target_problem(); nothing is validated here.
void run_cpu_attention_target(const AttentionTargetInputs& in, const AttentionTargetOutputs& out,
                              const AttentionTargetOptions& opt, const ProblemGeometry& g);

}  // namespace dsaib::detail
