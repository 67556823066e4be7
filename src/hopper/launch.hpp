// Host entry points of the sm_90a kernels, one instantiation per head dim.
#pragma once

#include <cuda_runtime.h>

#include "hopper/kernel_params.hpp"

namespace dsaib::hopper {

/// The persistent grid of the fused kernel for head dim kHeadDim (kSplitA,
/// kL2KeepDk, kFixedPointDk as for launch_indexer_backward) over `num_tasks` tasks on the current
/// device: min(num_tasks, SMs x resident CTAs per SM). Sets the kernel's dynamic
/// shared-memory attribute. Throws Error(cuda_error) when a CUDA call fails or no
/// CTA fits on an SM.
template <int kHeadDim, bool kSplitA, bool kL2KeepDk = false, bool kFixedPointDk = false>
int64_t indexer_backward_grid(int64_t num_tasks);

/// Launches the fused kernel for head dim kHeadDim on `stream` over `grid`
/// persistent CTAs (from indexer_backward_grid, which must run first); kSplitA:
/// the a operand as two bf16 terms (TileConfig::kSplitA); kL2KeepDk: the dK reds
/// with an L2 evict_last policy (TileConfig::kL2KeepDk, l2_hints.hpp),
/// instantiated for the one-term kernels (kSplitA false) only; kFixedPointDk: the
/// deterministic d_index_k (TileConfig::kFixedPointDk, fixed_point_dk.cuh: params'
/// dk_fixed and dk_bound, the bound pass run before), without the L2 hint. The start delays
/// (start_stagger.hpp) come in `params`. Nothing is launched for 0 tasks.
template <int kHeadDim, bool kSplitA, bool kL2KeepDk = false, bool kFixedPointDk = false>
void launch_indexer_backward(const IndexerBackwardParams& params, int64_t grid, cudaStream_t stream);

/// Dynamic shared memory the fused kernel needs, in bytes.
template <int kHeadDim, bool kSplitA>
int indexer_backward_smem_bytes();

}  // namespace dsaib::hopper
