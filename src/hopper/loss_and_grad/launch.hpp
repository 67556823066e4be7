// Host entry points of the loss-and-gradient kernel, one instantiation per head
// dim (instantiate_loss_and_grad.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "hopper/common/kernel_params.hpp"

namespace dsaib::hopper {

/// The kernel for head dim kHeadDim over `grid` persistent CTAs (the P-free
/// backward's plan; none for grid 0).
template <int kHeadDim>
void launch_indexer_kl_loss_and_grad(const IndexerKLForwardParams& params, int64_t grid, cudaStream_t stream);
/// Sets the kernel's dynamic shared-memory attribute and checks that a CTA fits
/// on an SM (Error(cuda_error) otherwise): called before anything is written.
template <int kHeadDim>
void prepare_indexer_kl_loss_and_grad();

}  // namespace dsaib::hopper
