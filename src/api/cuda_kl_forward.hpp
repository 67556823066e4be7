// The seam between indexer_kl_forward() and the Hopper forward kernel.
// Implemented in src/hopper/kl_forward/kl_forward_backend.cu when built with CUDA, else by
// src/api/cuda_kl_forward_stub.cpp.
#pragma once

#include <cstddef>

#include "core/problem.hpp"

namespace dsaib::detail {

/// Scratch bytes of a cuda forward (indexer_kl_forward_workspace_size) on the current device.
std::size_t cuda_kl_forward_workspace_size(const ProblemGeometry& g, int device_index);

/// Launches the forward on options.stream. `g` is validated; `workspace` null
/// means stream-ordered memory of its own.
void run_cuda_kl_forward(const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                         const IndexerOptions& opt, const ProblemGeometry& g, void* workspace,
                         std::size_t workspace_bytes);

}  // namespace dsaib::detail
