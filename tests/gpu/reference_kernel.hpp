// A deliberately simple fp64 GPU reference of the indexer backward (no tensor
// cores, no pipelines): the oracle for shapes too large for the CPU reference.
// It is itself checked against the CPU reference at small sizes (tests/gpu).
#pragma once

#include <cuda_runtime.h>

#include "dsaib/indexer_backward.hpp"

namespace dsaib::hopper {

/// fp64 gradients into caller-provided device buffers (overwritten):
///   dq (num_q_rows * H * D), dw (num_q_rows * H), dk (num_k_rows * D).
/// Inputs are cuda tensors validated like indexer_backward(). One CTA per query
/// row; dK accumulates with fp64 atomics. Synchronous (waits for the stream).
void reference_backward_device(const IndexerInputs& inputs, const IndexerOptions& options,
                               double* dq, double* dw, double* dk, cudaStream_t stream);

}  // namespace dsaib::hopper
