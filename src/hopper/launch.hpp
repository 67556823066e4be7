// Host entry points of the sm_90a kernels, one instantiation per head dim.
#pragma once

#include <cuda_runtime.h>

#include "hopper/kernel_params.hpp"

namespace dsaib::hopper {

/// Launches the fused kernel for head dim kHeadDim on `stream` (persistent grid);
/// kSplitA: the a operand as two bf16 terms (TileConfig::kSplitA); kL2KeepDk:
/// the dK reds with an L2 evict_last policy (TileConfig::kL2KeepDk, l2_hints.hpp),
/// instantiated for the one-term kernels (kSplitA false) only.
template <int kHeadDim, bool kSplitA, bool kL2KeepDk = false>
void launch_indexer_backward(const IndexerBackwardParams& params, cudaStream_t stream);

/// Dynamic shared memory the fused kernel needs, in bytes.
template <int kHeadDim, bool kSplitA>
int indexer_backward_smem_bytes();

}  // namespace dsaib::hopper
