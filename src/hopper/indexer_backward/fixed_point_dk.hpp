// Host side of the deterministic d_index_k (fixed_point_dk.cuh): the bound pass
// before the backward kernel and the finish kernel after it (its workspace:
// dk_fixed_workspace_bytes, src/hopper/launch/launch_plan.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "hopper/common/kernel_params.hpp"

namespace dsaib::hopper {

/// On `stream`: zeroes the accumulator `dk_fixed` (`elements` int64) and `*bound`,
/// then runs the bound pass over the query rows of `p` (one warp per row).
/// Throws Error(cuda_error) when a CUDA call fails.
void launch_dk_fixed_bound(const IndexerParams& p, unsigned long long* dk_fixed, int64_t elements,
                           DkFixedBound* bound, cudaStream_t stream);

/// On `stream`: d_index_k[i] = dk_fixed[i] * 2^-E (fixed_point_dk.cuh), `n`
/// elements, written as bf16 (round to nearest even) or f32; NaN everywhere when
/// a row's bound was not finite. Throws Error(cuda_error) when the launch fails.
void launch_dk_fixed_finish(const unsigned long long* dk_fixed, const DkFixedBound* bound, int64_t num_q_rows,
                            void* d_index_k, bool bf16, int64_t n, cudaStream_t stream);

}  // namespace dsaib::hopper
