// The deterministic d_index_k's bound pass and finish kernel (docs/hopper-kernel.md §10).
#include "hopper/indexer_backward/fixed_point_dk.hpp"

#include <cuda_bf16.h>

#include <algorithm>

#include "hopper/common/cuda_check.hpp"
#include "hopper/indexer_backward/fixed_point_dk.cuh"
#include "hopper/common/problem_device.cuh"

namespace dsaib::hopper {
namespace {

constexpr int kBoundWarps = 8;  // rows per block of the bound pass (one warp each)

__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

/// One warp per query row: R = 2 |c| |sm_scale| W S_T (1 + S_P) into
/// bound->max_row_bound_bits (atomicMax), or bound->non_finite. NaN and Inf
/// propagate (no fmax / fmin), so a non-finite input gives a non-finite R.
__global__ void dk_fixed_bound_kernel(IndexerParams p, DkFixedBound* bound) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kBoundWarps;
  const double c = static_cast<double>(loss_scale(p));  // as the producer forms it
  const float eps = eps_exp_minus_100();
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kBoundWarps + threadIdx.x / 32; row < p.num_q_rows;
       row += warps) {
    const RowSequence seq = row_sequence(p, row);
    const int32_t* ids = p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride);
    const float* attn_score = p.attn_score + batched_offset(row, p.q_rows_per_batch, p.attn_score_batch_stride, p.attn_score_row_stride);
    const float* index_score = p.index_score + batched_offset(row, p.q_rows_per_batch, p.index_score_batch_stride, p.index_score_row_stride);
    double s_t = 0.0, s_p = 0.0;
    bool any_valid = false;
    for (int j = lane; j < p.topk; j += 32) {
      if (key_row_of(p, seq, ids[j]) < 0) continue;  // invalid slots: T and P ignored
      any_valid = true;
      const float t = attn_score[j], pr = index_score[j];
      // g_i = -c max(T, eps) [P >= eps] (producer_gather.cuh); |P| with NaN kept.
      if (!(pr < eps)) s_t += static_cast<double>(max_keeping_nan(t, eps));  // NaN P: counted
      s_p += fabs(static_cast<double>(pr));
    }
    s_t = warp_sum(s_t);
    s_p = warp_sum(s_p);
    any_valid = __any_sync(0xffffffffu, any_valid);
    if (!any_valid) continue;  // a row without valid slots adds nothing
    // W = sum_h |w_h| max_d |q_hd|: lane l takes heads l, l + 32, ...
    const uint16_t* q_row = p.index_q + batched_offset(row, p.q_rows_per_batch, p.q_batch_stride, p.q_row_stride);
    const int64_t w_off = batched_offset(row, p.q_rows_per_batch, p.w_batch_stride, p.w_row_stride);
    double w_sum = 0.0;
    for (int h = lane; h < p.heads; h += 32) {
      const uint16_t* q = q_row + h * p.q_head_stride;
      float q_max = 0.0f;
      bool q_nan = false;
      for (int d = 0; d < p.head_dim; d += 8) {  // 16-byte loads (the backward kernel's Q alignment)
        const uint4 v = *reinterpret_cast<const uint4*>(q + d);
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
        for (const uint32_t word : words) {
          for (const float a : {fabsf(__uint_as_float(word << 16)), fabsf(__uint_as_float(word & 0xffff0000u))}) {
            q_nan |= isnan(a);
            q_max = a > q_max ? a : q_max;
          }
        }
      }
      w_sum += fabs(static_cast<double>(weight_at(p, w_off + h))) * (q_nan ? static_cast<double>(NAN) : static_cast<double>(q_max));
    }
    w_sum = warp_sum(w_sum);
    const double r = 2.0 * fabs(c) * fabs(static_cast<double>(p.sm_scale)) * w_sum * s_t * (1.0 + s_p);
    if (lane == 0) {
      if (isfinite(r)) atomicMax(&bound->max_row_bound_bits, static_cast<unsigned long long>(__double_as_longlong(r)));
      else atomicOr(&bound->non_finite, 1u);
    }
  }
}

__global__ void dk_fixed_finish_kernel(const unsigned long long* __restrict__ acc, const DkFixedBound* bound,
                                       int64_t num_q_rows, void* __restrict__ dst, bool bf16, int64_t n) {
  const DkFixedBound b = *bound;
  const bool nan_out = b.non_finite != 0;
  const double inv_scale = ldexp(1.0, -dk_fixed_exponent(b, num_q_rows));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = nan_out ? static_cast<double>(NAN) : static_cast<double>(static_cast<long long>(acc[i])) * inv_scale;
    if (bf16) static_cast<__nv_bfloat16*>(dst)[i] = __double2bfloat16(v);
    else static_cast<float*>(dst)[i] = static_cast<float>(v);  // round to nearest
  }
}

}  // namespace

void launch_dk_fixed_bound(const IndexerParams& p, unsigned long long* dk_fixed, int64_t elements,
                           DkFixedBound* bound, cudaStream_t stream) {
  if (elements > 0) {
    cuda_check(cudaMemsetAsync(dk_fixed, 0, static_cast<std::size_t>(elements) * sizeof(unsigned long long), stream),
               "cudaMemsetAsync (deterministic dK accumulator)");
  }
  cuda_check(cudaMemsetAsync(bound, 0, sizeof(DkFixedBound), stream), "cudaMemsetAsync (deterministic dK bound)");
  if (p.num_q_rows <= 0) return;
  const int64_t blocks = std::min<int64_t>((p.num_q_rows + kBoundWarps - 1) / kBoundWarps, 16384);
  dk_fixed_bound_kernel<<<static_cast<unsigned>(blocks), kBoundWarps * 32, 0, stream>>>(p, bound);
  cuda_check_launch("dk_fixed_bound_kernel");
}

void launch_dk_fixed_finish(const unsigned long long* dk_fixed, const DkFixedBound* bound, int64_t num_q_rows,
                            void* d_index_k, bool bf16, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t threads = 256, blocks = std::min<int64_t>((n + threads - 1) / threads, 65536);
  dk_fixed_finish_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(dk_fixed, bound, num_q_rows,
                                                                                 d_index_k, bf16, n);
  cuda_check_launch("dk_fixed_finish_kernel");
}

}  // namespace dsaib::hopper
