// The backward's host side that the loss-and-gradient call reuses
// (indexer_backward_backend.cu).
#pragma once

#include <cuda_runtime.h>

#include "core/problem.hpp"
#include "hopper/launch/launch_plan.hpp"

namespace dsaib::hopper {

/// Resident CTAs per SM of the backward kernel (the L2-hinted, fixed-point and
/// P-free variants have its shared memory, threads and launch bounds); sets
/// its dynamic shared-memory attribute. Error(cuda_error) when none fits.
int backward_ctas_per_sm(int64_t head_dim, bool split_a);

/// The backward kernel of `call` on `stream`: `workspace` holds call's layout
/// (packed row statistics for the P-free kernels, the kernel's own part). The
/// P-free kernels read in.row_lse / row_target_mass; the P form in.index_score.
void run_backward_kernel(const BackwardCallPlan& call, const IndexerInputs& in, const IndexerBackwardOutputs& out,
                         const IndexerOptions& opt, const detail::ProblemGeometry& g, char* workspace,
                         cudaStream_t stream);

}  // namespace dsaib::hopper
