// Device-side geometry: flat rows to offsets, sequences, id validity (the host's
// is src/core/problem.hpp).
#pragma once

#include <cstdint>

#include "hopper/common/kernel_params.hpp"

namespace dsaib::hopper {

__device__ __forceinline__ int64_t batched_offset(int64_t row, int64_t rows_per_batch, int64_t batch_stride,
                                                  int64_t row_stride) {
  return (row / rows_per_batch) * batch_stride + (row % rows_per_batch) * row_stride;
}

/// The key rows that a query row may select: [k_start, k_start + k_len).
struct RowSequence {
  int64_t k_start;
  int64_t k_len;
};

/// THD: the sequence of flat query row `row`, the last b with
/// cu_seqlens_q[b] <= row (so empty sequences are skipped), by binary search.
__device__ inline int sequence_of_q_row(const int32_t* cu_seqlens_q, int batch, int64_t row) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_seqlens_q[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__device__ inline RowSequence row_sequence(const IndexerParams& p, int64_t row) {
  if (!p.thd) {
    const int64_t b = row / p.q_rows_per_batch;
    return {b * p.k_rows_per_batch, p.k_rows_per_batch};
  }
  const int b = sequence_of_q_row(p.cu_seqlens_q, p.batch, row);
  const int64_t ks = p.cu_seqlens_k[b];
  return {ks, static_cast<int64_t>(p.cu_seqlens_k[b + 1]) - ks};
}

/// Flat key row of a selected id, or -1 for an invalid slot (never dereferenced).
__device__ __forceinline__ int64_t key_row_of(const IndexerParams& p, const RowSequence& seq, int32_t id) {
  const int64_t v = id;
  if (!p.global_ids) return (v >= 0 && v < seq.k_len) ? seq.k_start + v : -1;
  return (v >= seq.k_start && v < seq.k_start + seq.k_len) ? v : -1;
}

/// A bf16's bits as the fp32 of the same value (exact).
__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }

/// Element i of a weights tensor as fp32, from bf16 or fp32 storage.
__device__ __forceinline__ float weight_value(const void* weights, bool weights_f32, int64_t i) {
  return weights_f32 ? static_cast<const float*>(weights)[i]
                     : bf16_bits_to_float(static_cast<const uint16_t*>(weights)[i]);
}

/// Element i of the weights tensor as fp32 (p.weights_f32: fp32 storage, else bf16).
__device__ __forceinline__ float weight_at(const IndexerParams& p, int64_t i) {
  return weight_value(p.weights, p.weights_f32, i);
}

/// c = grad_loss * loss_coeff / N in fp32, as stage 1 forms it: grad_loss read from
/// the device scalar when there is one (CUDA-graph replays), else the value.
__device__ __forceinline__ float loss_scale(const IndexerParams& p) {
  const float grad_loss = p.grad_loss_ptr ? *p.grad_loss_ptr : p.grad_loss_value;
  return grad_loss * p.loss_coeff_over_n;
}

__device__ __forceinline__ const uint16_t* key_row_ptr(const IndexerParams& p, int64_t key_row) {
  return p.index_k + batched_offset(key_row, p.k_rows_per_batch, p.k_batch_stride, p.k_row_stride);
}

/// exp(-100) rounded to the nearest fp32 subnormal (27 * 2^-149): for every
/// fp32 P, (P >= kEps) equals (double(P) >= exp(-100)). Needs denormals kept
/// (no -ftz / --use_fast_math).
__device__ __forceinline__ float eps_exp_minus_100() { return __int_as_float(27); }

/// relu as torch computes it, NaN kept (fmaxf(x, 0) would turn NaN into 0 and
/// hide a NaN input from the logits and the loss while dK still multiplies it;
/// docs/math.md, "NaN and infinities"). PTX's max.NaN (sm_80 and later) is one
/// FMNMX like fmaxf's; the select `x < 0 ? 0 : x` compiles to a compare and a
/// select, two instructions on every logit of the GEMM epilogues.
__device__ __forceinline__ float relu_keeping_nan(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(y) : "f"(x));
  return y;
}

/// Whether relu's derivative passes the gradient at x: torch's relu backward
/// zeroes it where x <= 0, and passes it for a NaN x.
__device__ __forceinline__ bool relu_passes(float x) { return !(x <= 0.0f); }

/// max(T, eps) as the cpu reference computes it (std::max): a NaN target T
/// propagates (fmax would replace it by eps and hide it). fp32 kernel and fp64 reference.
template <class T>
__device__ __forceinline__ T max_keeping_nan(T t, T eps) {
  return t < eps ? eps : t;
}

}  // namespace dsaib::hopper
