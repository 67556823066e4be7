// dsaib_bench: device fills of the benches' inputs (reproducible bf16, e4m3 and fp32 values,
// the key-gather floor's ids) and a spin kernel that holds a stream for a given time.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cuda/ptx>

#include "bench_core.hpp"
#include "bench_hash.cuh"
#include "cuda_check.hpp"

namespace dsaib::bench {
namespace {

// The key-gather floor's ids (gather_floor.cu times the gather).
// ids of row t: its first n = min(t + 1, topk) (causal) or topk (random) slots hold
// hashed keys of [0, t] or [0, S); the rest -1. Distinctness does not matter to the rate.
__global__ void key_gather_ids_kernel(int32_t* ids, uint32_t seq, uint32_t topk, bool causal, uint32_t seed) {
  const uint64_t n = static_cast<uint64_t>(seq) * topk;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t t = static_cast<uint32_t>(i / topk), slot = static_cast<uint32_t>(i % topk);
    const uint32_t avail = causal ? t + 1 : seq;
    ids[i] = slot < avail ? static_cast<int32_t>(row_of(static_cast<uint32_t>(i), seed, avail)) : -1;
  }
}

__global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, uint32_t salt) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn(gemm_value(i, salt));
}

__global__ void fill_e4m3_kernel(__nv_fp8_e4m3* p, size_t n, uint32_t salt) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = __nv_fp8_e4m3(gemm_value(i, salt));
}

__global__ void fill_f32_kernel(float* p, size_t n, float value) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

__global__ void spin_kernel(uint64_t ns) {
  const uint64_t t0 = cuda::ptx::get_sreg_globaltimer();
  while (cuda::ptx::get_sreg_globaltimer() - t0 < ns) __nanosleep(1000);
}

}  // namespace

void gpu_spin(cudaStream_t s, double us) {
  if (!(us > 0)) return;
  spin_kernel<<<1, 1, 0, s>>>(static_cast<uint64_t>(us * 1e3));
  check_cuda(cudaGetLastError(), "spin kernel launch");
}

void fill_device_bf16(void* p, uint64_t n, uint32_t salt, void* stream) {
  fill_bf16_kernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<__nv_bfloat16*>(p), n, salt);
  check_cuda(cudaGetLastError(), "fill kernel launch");
}

void fill_device_e4m3(void* p, uint64_t n, uint32_t salt, void* stream) {
  fill_e4m3_kernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<__nv_fp8_e4m3*>(p), n, salt);
  check_cuda(cudaGetLastError(), "fill kernel launch");
}

void fill_device_f32(float* p, uint64_t n, float value, void* stream) {
  fill_f32_kernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(p, n, value);
  check_cuda(cudaGetLastError(), "fill kernel launch");
}

void fill_device_gather_ids(int32_t* ids, int64_t seq, int64_t topk, bool causal, uint32_t seed, void* stream) {
  key_gather_ids_kernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      ids, static_cast<uint32_t>(seq), static_cast<uint32_t>(topk), causal, seed);
  check_cuda(cudaGetLastError(), "ids kernel launch");
}


}  // namespace dsaib::bench
