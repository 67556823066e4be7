// scale_gradient (scale_gradient.hpp). torch's own multiply of a bf16 tensor by
// an f32 device scalar (the one-rounding form) takes its dynamic-casting path
// and runs at about a third of the copy rate; this kernel moves 16 bytes per
// load and store, at the copy rate (docs/design-decisions.md, "The autograd
// loss's backward").
#include "scale_gradient.hpp"

#include <cuda_bf16.h>

namespace dsaib_py {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;         // elements per vector step: 16 bytes of bf16, 32 of f32
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond this: 1M threads cover any GPU

template <ScaleType T>
struct Elem;
template <>
struct Elem<ScaleType::bf16> {
  using type = __nv_bfloat16;
  static __device__ float load(type v) { return __bfloat162float(v); }
  static __device__ type store(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Elem<ScaleType::f32> {
  using type = float;
  static __device__ float load(type v) { return v; }
  static __device__ type store(float v) { return v; }
};

/// kPerThread elements as 16-byte words: one for bf16, two for f32.
template <ScaleType T>
struct alignas(16) Pack {
  typename Elem<T>::type e[kPerThread];
};

template <ScaleType In, ScaleType Out>
__global__ void __launch_bounds__(kThreads) scale_kernel(const typename Elem<In>::type* __restrict__ in,
                                                         typename Elem<Out>::type* __restrict__ out, int64_t n,
                                                         const float* __restrict__ grad_loss) {
  const float g = *grad_loss;
  const int64_t packs = n / kPerThread;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const auto* in_packs = reinterpret_cast<const Pack<In>*>(in);
  auto* out_packs = reinterpret_cast<Pack<Out>*>(out);
  for (int64_t p = first; p < packs; p += stride) {
    const Pack<In> a = in_packs[p];
    Pack<Out> b;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) b.e[j] = Elem<Out>::store(Elem<In>::load(a.e[j]) * g);
    out_packs[p] = b;
  }
  for (int64_t i = packs * kPerThread + first; i < n; i += stride) {
    out[i] = Elem<Out>::store(Elem<In>::load(in[i]) * g);
  }
}

template <ScaleType In, ScaleType Out>
cudaError_t launch(const void* in, void* out, int64_t n, const float* grad_loss, cudaStream_t stream) {
  const int64_t packs = (n + kPerThread - 1) / kPerThread;
  const int64_t blocks = (packs + kThreads - 1) / kThreads;
  scale_kernel<In, Out><<<static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreads, 0, stream>>>(
      static_cast<const typename Elem<In>::type*>(in), static_cast<typename Elem<Out>::type*>(out), n, grad_loss);
  return cudaGetLastError();
}

}  // namespace

cudaError_t scale_gradient(const void* in, ScaleType in_type, void* out, ScaleType out_type, int64_t n,
                           const float* grad_loss, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (in_type == ScaleType::bf16) {
    return out_type == ScaleType::bf16 ? launch<ScaleType::bf16, ScaleType::bf16>(in, out, n, grad_loss, stream)
                                       : launch<ScaleType::bf16, ScaleType::f32>(in, out, n, grad_loss, stream);
  }
  return out_type == ScaleType::bf16 ? launch<ScaleType::f32, ScaleType::bf16>(in, out, n, grad_loss, stream)
                                     : launch<ScaleType::f32, ScaleType::f32>(in, out, n, grad_loss, stream);
}

}  // namespace dsaib_py
