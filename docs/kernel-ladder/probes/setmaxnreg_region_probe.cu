// Build probe (eighth session; perf-log "Build probe: setmaxnreg in a minimal kernel and in the
// fused kernel"): does ptxas compile the code after setmaxnreg.inc with the raised register
// limit? 512 threads (__launch_bounds__(512, 1): 128 registers at entry), warpgroup 1 raises
// to 240 and keeps KREGS floats live across a loop.
//   nvcc -gencode arch=compute_90a,code=sm_90a -DKREGS=200 -c setmaxnreg_region_probe.cu -Xptxas -v
// Measured with nvcc 13.0: "Used 128 registers", 0 bytes spill; the same kernel without the
// setmaxnreg.inc spills (360 B at KREGS=220 with 384 threads).
#include <cstdint>
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N)); }

constexpr int K = KREGS;
__global__ void __launch_bounds__(512, 1) probe(const float* __restrict__ in, float* __restrict__ out, int n) {
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 3) {
    setmaxnreg_dec<24>();
    return;
  }
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) out[0] = in[0];
  } else if (wg == 1) {
    setmaxnreg_inc<240>();
    float acc[K];
#pragma unroll
    for (int i = 0; i < K; ++i) acc[i] = in[threadIdx.x + i * 384];
    const float s = in[7];
    for (int it = 0; it < n; ++it) {
#pragma unroll
      for (int i = 0; i < K; ++i) acc[i] = acc[i] * s + in[it * K + i];
    }
#pragma unroll
    for (int i = 0; i < K; ++i) out[threadIdx.x + i * 384] = acc[i];
  } else {
    setmaxnreg_dec<40>();
  }
}
