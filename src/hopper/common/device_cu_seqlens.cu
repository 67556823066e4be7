// THD cu_seqlens checked on the device (device_cu_seqlens.hpp).
#include "hopper/common/device_cu_seqlens.hpp"

#include "hopper/common/cuda_check.hpp"

namespace dsaib::hopper {
namespace {

/// The rules of validation (starting at 0, non-decreasing, ending at T_q / T_k)
/// over both arrays of n = B + 1 values. Writes copies that the kernels read
/// instead: the arrays themselves when they are valid; else [0, ..., 0, T]
/// (every row in the last sequence, every key row in range), so that no kernel
/// reads out of bounds, and *bad = 1.
__global__ void check_cu_seqlens_on_device(const int32_t* cu_q, const int32_t* cu_k, int64_t n, int64_t t_q,
                                           int64_t t_k, int32_t* copy_q, int32_t* copy_k, int32_t* bad) {
  __shared__ int any_bad;
  if (threadIdx.x == 0) any_bad = 0;
  __syncthreads();
  int mine = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t q = cu_q[i], k = cu_k[i];
    if (i == 0 && (q != 0 || k != 0)) mine = 1;
    if (i > 0 && (q < cu_q[i - 1] || k < cu_k[i - 1])) mine = 1;
    if (i == n - 1 && (q != t_q || k != t_k)) mine = 1;
  }
  if (mine) atomicOr(&any_bad, 1);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    copy_q[i] = any_bad ? (i == n - 1 ? static_cast<int32_t>(t_q) : 0) : cu_q[i];
    copy_k[i] = any_bad ? (i == n - 1 ? static_cast<int32_t>(t_k) : 0) : cu_k[i];
  }
  if (threadIdx.x == 0) *bad = any_bad;
}

/// NaN into every element of an output when *bad is set.
__global__ void poison_output_if_bad(const int32_t* bad, void* data, int64_t n, bool bf16) {
  if (*bad == 0) return;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (bf16) static_cast<uint16_t*>(data)[i] = 0x7fc0;
    else static_cast<float*>(data)[i] = __int_as_float(0x7fc00000);
  }
}

}  // namespace
}  // namespace dsaib::hopper

namespace dsaib::detail {

DeviceCuSeqlens check_device_cu_seqlens(const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                        const ProblemGeometry& g, cudaStream_t stream) {
  DeviceCuSeqlens c;
  c.n = cu_seqlens_q.shape[0];
  void* p = nullptr;
  hopper::cuda_check(cudaMallocAsync(&p, static_cast<std::size_t>(2 * c.n + 1) * sizeof(int32_t), stream),
                     "cudaMallocAsync (cu_seqlens check)");
  c.buffer = static_cast<int32_t*>(p);
  hopper::check_cu_seqlens_on_device<<<1, 256, 0, stream>>>(
      static_cast<const int32_t*>(cu_seqlens_q.data), static_cast<const int32_t*>(cu_seqlens_k.data), c.n,
      g.num_q_rows, g.num_k_rows, c.buffer, c.buffer + c.n, c.buffer + 2 * c.n);
  hopper::cuda_check_launch("check_cu_seqlens_on_device");
  c.cu_seqlens_q = c.buffer;
  c.cu_seqlens_k = c.buffer + c.n;
  return c;
}

IndexerInputs with_checked_cu_seqlens(IndexerInputs in, const DeviceCuSeqlens& c) {
  if (c.buffer == nullptr) return in;
  in.cu_seqlens_q.data = const_cast<int32_t*>(c.cu_seqlens_q);
  in.cu_seqlens_k.data = const_cast<int32_t*>(c.cu_seqlens_k);
  return in;
}

void finish_device_cu_seqlens(const DeviceCuSeqlens& c, std::initializer_list<const TensorView*> outputs,
                              cudaStream_t stream) {
  if (c.buffer == nullptr) return;
  for (const TensorView* v : outputs) {
    if (!v->present() || v->numel() == 0) continue;
    hopper::poison_output_if_bad<<<132, 256, 0, stream>>>(c.buffer + 2 * c.n, v->data, v->numel(),
                                                          v->dtype == DType::bf16);
    hopper::cuda_check_launch("poison_output_if_bad");
  }
  hopper::cuda_check(cudaFreeAsync(c.buffer, stream), "cudaFreeAsync (cu_seqlens check)");
}

}  // namespace dsaib::detail
