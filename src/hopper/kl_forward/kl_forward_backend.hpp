// The loss forward's host side that the backward's prepass and the
// loss-and-gradient call reuse (kl_forward_backend.cu).
#pragma once

#include <cuda_runtime.h>

#include "core/problem.hpp"
#include "dsaib/indexer_kl_forward.hpp"
#include "hopper/launch/launch_plan.hpp"

namespace dsaib::hopper {

/// Resident CTAs per SM of the forward kernel of `g` (forward_kernel_for, the
/// from-logits kernel with `from_logits`); sets its dynamic shared-memory
/// attribute. Error(cuda_error) when none fits.
int kl_forward_ctas_per_sm(const detail::ProblemGeometry& g, bool from_logits = false);

/// The forward kernel and the fixed-order sum of the loss terms on `stream`;
/// `workspace` holds plan's layout. The from-logits kernel reads in.topk_logits.
void run_kl_forward_kernel(const ForwardPlan& plan, const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                           const IndexerOptions& opt, const detail::ProblemGeometry& g, char* workspace,
                           cudaStream_t stream);

}  // namespace dsaib::hopper
