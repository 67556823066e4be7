// Small kernels that several families launch around their main kernel
// (support_kernels.hpp).
#include "hopper/common/support_kernels.hpp"

#include <cuda_bf16.h>

#include "hopper/common/cuda_check.hpp"

namespace dsaib::hopper {
namespace {

__global__ void cast_dk_to_bf16(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, int64_t n) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i + 3 < n) {
    const float4 v = *reinterpret_cast<const float4*>(src + i);
    *reinterpret_cast<__nv_bfloat162*>(dst + i) = __floats2bfloat162_rn(v.x, v.y);
    *reinterpret_cast<__nv_bfloat162*>(dst + i + 2) = __floats2bfloat162_rn(v.z, v.w);
  } else {
    for (int64_t j = i; j < n; ++j) dst[j] = __float2bfloat16_rn(src[j]);
  }
}

constexpr int kSumThreads = 1024;

/// loss = -(loss_coeff / N) * sum of the row terms: each thread sums rows
/// tid, tid + 1024, ... in order, then a fixed tree; fp64 throughout.
__global__ void __launch_bounds__(kSumThreads) sum_loss_terms(const double* __restrict__ terms, int64_t rows,
                                                               double coeff_over_n, float* __restrict__ loss) {
  __shared__ double part[kSumThreads];
  double s = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kSumThreads) s += terms[r];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int width = kSumThreads / 2; width > 0; width >>= 1) {
    if (static_cast<int>(threadIdx.x) < width) part[threadIdx.x] += part[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = static_cast<float>(0.0 - coeff_over_n * part[0]);  // +0 without terms
}

}  // namespace

void launch_cast_dk_to_bf16(const float* src, void* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t threads = 256, per_block = threads * 4;
  cast_dk_to_bf16<<<static_cast<unsigned>((n + per_block - 1) / per_block), threads, 0, stream>>>(
      src, static_cast<__nv_bfloat16*>(dst), n);
  cuda_check_launch("cast_dk_to_bf16");
}

void launch_sum_loss_terms(const double* terms, int64_t rows, double coeff_over_n, float* loss, cudaStream_t stream) {
  sum_loss_terms<<<1, kSumThreads, 0, stream>>>(terms, rows, coeff_over_n, loss);
  cuda_check_launch("sum_loss_terms");
}

}  // namespace dsaib::hopper
