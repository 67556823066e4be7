// Host entry points of the sm_90a kernels, one instantiation per head dim.
#pragma once

#include <cuda_runtime.h>

#include "hopper/common/kernel_params.hpp"

namespace dsaib::hopper {

/// Resident CTAs per SM of the backward kernel for head dim kHeadDim and kSplitA on
/// the current device (cudaOccupancyMaxActiveBlocksPerMultiprocessor): the
/// launch plan's DeviceProperties::ctas_per_sm. The L2-hinted and fixed-point
/// variants of the kernel have its shared memory, threads and launch bounds, so
/// the same count. Sets the kernel's dynamic shared-memory attribute. Throws
/// Error(cuda_error) when a CUDA call fails or no CTA fits on an SM.
template <int kHeadDim, bool kSplitA>
int indexer_backward_ctas_per_sm();

/// Launches the backward kernel for head dim kHeadDim on `stream` over `grid`
/// persistent CTAs (BackwardPlan::grid, launch_plan.hpp); kSplitA: the a operand
/// as two bf16 terms (TileConfig::kSplitA); kL2KeepDk: the dK reds with an L2
/// evict_last policy (TileConfig::kL2KeepDk, l2_hints.hpp), instantiated for the
/// one-term kernels (kSplitA false) only; kFixedPointDk: the deterministic
/// d_index_k (TileConfig::kFixedPointDk, fixed_point_dk.cuh: params' dk_fixed
/// and dk_bound, the bound pass run before), without the L2 hint. The start
/// delays (start_stagger.hpp) come in `params`. Sets the kernel's dynamic
/// shared-memory attribute first. Nothing is launched for grid 0.
template <int kHeadDim, bool kSplitA, bool kL2KeepDk = false, bool kFixedPointDk = false>
void launch_indexer_backward(const IndexerParams& params, int64_t grid, cudaStream_t stream);

/// The P-free kernels (PFreeConfig over TileConfig<kHeadDim, kSplitA>:
/// params' row_lse and row_target_mass instead of index_score; H <= 64, no L2
/// hint, no fixed-point dK): launch and resident CTAs per SM, as above.
template <int kHeadDim, bool kSplitA>
void launch_indexer_backward_p_free(const IndexerParams& params, int64_t grid, cudaStream_t stream);
template <int kHeadDim, bool kSplitA>
int indexer_backward_p_free_ctas_per_sm();

/// Dynamic shared memory the backward kernel needs, in bytes.
template <int kHeadDim, bool kSplitA>
int indexer_backward_smem_bytes();

}  // namespace dsaib::hopper
