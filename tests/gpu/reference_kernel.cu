// fp64 GPU reference (see reference_kernel.hpp). Straight from docs/math.md:
// one CTA per query row, thread h owns head h for the logits, thread d owns
// column d for dQ and the dK scatter.
#include "gpu/reference_kernel.hpp"

#include <cuda_runtime.h>

#include <cmath>

#include "api/cuda_backend.hpp"
#include "hopper/common/cuda_check.hpp"
#include "hopper/common/kernel_params.hpp"
#include "hopper/common/problem_device.cuh"
#include "hopper/launch/problem_params.hpp"

namespace dsaib::hopper {

namespace {

constexpr int kThreads = 128;

__device__ double bf16_at(const uint16_t* p, int64_t i) { return __uint_as_float(static_cast<uint32_t>(p[i]) << 16); }

__global__ void __launch_bounds__(kThreads) reference_backward_kernel(const IndexerParams p, double c, double* dq_out,
                                                                      double* dw_out, double* dk_out) {
  extern __shared__ double smem[];
  const int H = p.heads, D = p.head_dim;
  double* q = smem;              // [H * D]
  double* dq = q + H * D;        // [H * D]
  double* k = dq + H * D;        // [D]
  double* a = k + D;             // [H]
  double* red = a + H;           // [kThreads]
  __shared__ double s_gs;
  __shared__ int64_t s_kr;

  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const RowSequence seq = row_sequence(p, row);
  const int32_t* ids = p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride);
  const float* attn_score = p.attn_score + batched_offset(row, p.q_rows_per_batch, p.attn_score_batch_stride, p.attn_score_row_stride);
  const float* index_score = p.index_score + batched_offset(row, p.q_rows_per_batch, p.index_score_batch_stride, p.index_score_row_stride);
  const uint16_t* q_row = p.index_q + batched_offset(row, p.q_rows_per_batch, p.q_batch_stride, p.q_row_stride);
  const int64_t w_off = batched_offset(row, p.q_rows_per_batch, p.w_batch_stride, p.w_row_stride);
  const double eps = exp(-100.0);

  for (int e = tid; e < H * D; e += kThreads) {
    q[e] = bf16_at(q_row, (e / D) * p.q_head_stride + e % D);
    dq[e] = 0.0;
  }
  // G = sum over valid slots of g_i
  double part = 0.0;
  for (int i = tid; i < p.topk; i += kThreads) {
    if (key_row_of(p, seq, ids[i]) >= 0 && static_cast<double>(index_score[i]) >= eps) part += -c * max_keeping_nan(static_cast<double>(attn_score[i]), eps);
  }
  red[tid] = part;
  __syncthreads();
  double G = 0.0;
  for (int t = 0; t < kThreads; ++t) G += red[t];  // fixed order

  double w = 0.0, dw = 0.0;
  if (tid < H) {
    w = p.weights_f32 ? static_cast<const float*>(p.weights)[w_off + tid] : bf16_at(static_cast<const uint16_t*>(p.weights), w_off + tid);
  }
  for (int i = 0; i < p.topk; ++i) {
    __syncthreads();
    if (tid == 0) {
      const int64_t kr = key_row_of(p, seq, ids[i]);
      s_kr = kr;
      if (kr >= 0) {
        const double P = index_score[i];
        const double g = P >= eps ? -c * max_keeping_nan(static_cast<double>(attn_score[i]), eps) : 0.0;
        s_gs = g - P * G;
      }
    }
    __syncthreads();
    const int64_t kr = s_kr;
    if (kr < 0) continue;
    const double gs = s_gs;
    const uint16_t* k_row = key_row_ptr(p, kr);
    for (int d = tid; d < D; d += kThreads) k[d] = bf16_at(k_row, d);
    __syncthreads();
    if (tid < H) {
      double x = 0.0;
      for (int d = 0; d < D; ++d) x += q[tid * D + d] * k[d];
      // relu as torch computes it: NaN kept, and its derivative passes a NaN x
      dw += gs * (x < 0.0 ? 0.0 : x);
      a[tid] = !(x <= 0.0) ? gs * w * static_cast<double>(p.sm_scale) : 0.0;
    }
    __syncthreads();
    for (int d = tid; d < D; d += kThreads) {
      double dk = 0.0;
      for (int h = 0; h < H; ++h) {
        dq[h * D + d] += a[h] * k[d];
        dk += a[h] * q[h * D + d];
      }
      atomicAdd(&dk_out[kr * D + d], dk);
    }
  }
  __syncthreads();
  if (tid < H) dw_out[row * H + tid] = dw * static_cast<double>(p.sm_scale);
  for (int e = tid; e < H * D; e += kThreads) dq_out[row * H * D + e] = dq[e];
}

}  // namespace

void reference_backward_device(const IndexerInputs& inputs, const IndexerOptions& options, double* dq,
                               double* dw, double* dk, cudaStream_t stream) {
  IndexerOptions opt = options;
  opt.backend = Backend::cuda;
  opt.deterministic = false;
  const detail::ProblemGeometry g = detail::validate_problem(inputs, {}, opt, &detail::cuda_copy_to_host, false);
  const IndexerParams p = indexer_params(inputs, {}, opt, g, 1, nullptr);
  double grad_loss = opt.grad_loss;
  if (opt.grad_loss_device) {
    float v = 0.0f;
    cuda_check(cudaMemcpy(&v, opt.grad_loss_device, sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy (grad_loss)");
    grad_loss = v;
  }
  const double c = grad_loss * static_cast<double>(opt.loss_coeff) / static_cast<double>(g.normalization_count);
  cuda_check(cudaMemsetAsync(dk, 0, static_cast<size_t>(g.num_k_rows * g.head_dim) * sizeof(double), stream), "cudaMemsetAsync");
  if (g.num_q_rows > 0) {
    const size_t smem = (2 * g.heads * g.head_dim + g.head_dim + g.heads + kThreads) * sizeof(double);
    cuda_check(cudaFuncSetAttribute(reference_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
               "cudaFuncSetAttribute(reference_backward_kernel)");
    reference_backward_kernel<<<static_cast<unsigned>(g.num_q_rows), kThreads, smem, stream>>>(p, c, dq, dw, dk);
    cuda_check_launch("reference_backward_kernel");
  }
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (reference_backward_kernel)");
}

}  // namespace dsaib::hopper
