// Calibration kernels for the sanitizer harness: one mbarrier handoff per
// mode, under the kernel's synchronisation rule (docs/sync-contract.md): every
// thread that wrote (or read) the handed-off shared memory arrives on the
// mbarrier itself. The "lane0" modes break the rule (lane 0 arrives for the
// whole warp, a race racecheck can see) and MUST be flagged, so a clean report
// of the kernel means something; the "all" modes follow it and must be clean.
//   usage: sync_calibration raw_lane0 | raw_all | war_lane0 | war_all
// Exit codes: 0 ran, 2 usage, 77 no GPU (skip).
#include <cuda/ptx>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

namespace {

enum Mode { kRawLane0, kRawAll, kWarLane0, kWarAll };

// Warp 0 writes (RAW) or reads (WAR); warp 1 is the other side.
__global__ void handoff(int mode, float* out) {
  __shared__ float buf[32];
  __shared__ uint64_t bar;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool all = mode == kRawAll || mode == kWarAll;
  if (threadIdx.x == 0) {
    // Contract: arrive count = 32 thread arrivals (every lane of warp 0) in the
    // "all" modes; 1 (lane 0 alone, the race) in the "lane0" modes.
    cuda::ptx::mbarrier_init(&bar, all ? 32u : 1u);
    buf[0] = 0.0f;
  }
  if (threadIdx.x < 32) buf[threadIdx.x] = 0.0f;
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  __syncthreads();
  if (mode == kRawLane0 || mode == kRawAll) {
    if (warp == 0) {
      buf[lane] = static_cast<float>(lane + 1);  // every lane writes
      if (all || lane == 0) (void)cuda::ptx::mbarrier_arrive(&bar);
    } else {
      while (!cuda::ptx::mbarrier_try_wait_parity(&bar, 0u)) {
      }
      out[lane] = buf[(lane + 1) % 32];  // reads other lanes' writes
    }
  } else {
    if (warp == 0) {
      out[lane] = buf[(lane + 1) % 32];  // every lane reads, then releases
      if (all || lane == 0) (void)cuda::ptx::mbarrier_arrive(&bar);
    } else {
      while (!cuda::ptx::mbarrier_try_wait_parity(&bar, 0u)) {
      }
      buf[lane] = static_cast<float>(lane);  // overwrites
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* names[] = {"raw_lane0", "raw_all", "war_lane0", "war_all"};
  int mode = -1;
  for (int m = 0; m < 4 && argc == 2; ++m) {
    if (std::strcmp(argv[1], names[m]) == 0) mode = m;
  }
  if (mode < 0) {
    std::fprintf(stderr, "usage: %s raw_lane0|raw_all|war_lane0|war_all\n", argv[0]);
    return 2;
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "no GPU: skipped\n");
    return 77;
  }
  float* out = nullptr;
  if (cudaMalloc(&out, 64 * sizeof(float)) != cudaSuccess) return 1;
  handoff<<<1, 64>>>(mode, out);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
  cudaFree(out);
  std::printf("%s ran\n", names[mode]);
  return 0;
}
