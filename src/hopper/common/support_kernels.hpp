// Small kernels that several families launch around their main kernel. Each
// launch is checked (Error(cuda_error) on failure).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsaib::hopper {

/// dst[i] = bf16(src[i]) (round to nearest even), i < n: the bf16 d_index_k from
/// the fp32 dK accumulator. Nothing for n = 0.
void launch_cast_dk_to_bf16(const float* src, void* dst, int64_t n, cudaStream_t stream);

/// *loss = -(coeff_over_n) * sum of the `rows` fp64 row terms, summed in a fixed
/// order (bitwise reproducible) by one CTA; +0 without rows.
void launch_sum_loss_terms(const double* terms, int64_t rows, double coeff_over_n, float* loss, cudaStream_t stream);

}  // namespace dsaib::hopper
