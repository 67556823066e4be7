// The backward of a loss whose forward formed its gradients at grad_loss 1
// (dsaib.torch.indexer_kl_loss's default form, the Megatron-Core hook): the
// held gradient times the upstream gradient, on the GPU (scale_gradient.cu).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace dsaib_py {

/// The element types scale_gradient reads and writes.
enum class ScaleType { bf16, f32 };

/// out[i] = in[i] * *grad_loss for i < n: the product in f32, rounded once to
/// out's type; *grad_loss (one f32 in device memory) is read when the kernel
/// runs, so the call neither waits for the host nor is waited for. in and out
/// are device pointers, 16-byte aligned, to n contiguous elements each, and
/// do not overlap. On `stream`; returns the
/// launch's status (cudaSuccess for n == 0, which launches nothing).
cudaError_t scale_gradient(const void* in, ScaleType in_type, void* out, ScaleType out_type, int64_t n,
                           const float* grad_loss, cudaStream_t stream);

}  // namespace dsaib_py
