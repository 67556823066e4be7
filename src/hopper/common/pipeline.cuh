// mbarrier pipelines between the kernels' roles (docs/sync-contract.md). An arrive
// releases only the arriving thread's own accesses, so every thread that wrote
// (or, for "empty", read) a stage arrives itself; proxy fences are the caller's.
#pragma once

#include <cuda/ptx>
#include <cstdint>

namespace dsaib::hopper {

/// Stage index and phase bit of one side of a pipeline, advanced together.
template <int kStages>
struct PipelineState {
  uint32_t index = 0;
  uint32_t phase = 0;

  __device__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1u;
    }
  }
};

/// Consumers start waiting for phase 0 of "full".
template <int kStages>
__device__ PipelineState<kStages> make_consumer_start_state() {
  return {0u, 0u};
}

/// Producers start on phase 1: try_wait.parity(1) on a fresh mbarrier asks about
/// the phase before phase 0, which counts as complete, so the first kStages
/// acquires pass at once.
template <int kStages>
__device__ PipelineState<kStages> make_producer_start_state() {
  return {0u, 1u};
}

/// Why a kernel trapped, written by a timed-out wait: 1 = K ring, 2 = Q ring,
/// 3 = dK ring, 4 = A ring, 5 = stats_full, 6 = forward K ring (the
/// loss-and-gradient kernel), 17-20 = the attention target's waits.
static __device__ uint32_t g_dsaib_wait_timeout_code = 0;

/// The cold path of a timed-out wait. Out of line on purpose: with the trap
/// inlined into the roles, ptxas (nvcc 13.0) silently ignores setmaxnreg.inc.
static __device__ __noinline__ void mbarrier_wait_timed_out(uint32_t timeout_code) {
  g_dsaib_wait_timeout_code = timeout_code;
  __trap();
}

/// Waits for the phase with parity `phase` of the mbarrier to complete.
/// Traps instead of hanging after about 2^31 polls, far beyond any legal wait.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t phase, uint32_t timeout_code) {
  uint32_t polls = 0;
  while (!cuda::ptx::mbarrier_try_wait_parity(bar, phase)) {
    if (++polls == (1u << 31)) mbarrier_wait_timed_out(timeout_code);
  }
}

/// A ring of kStages buffers guarded by full[] and empty[] mbarriers.
template <int kStages>
struct MbarrierPipeline {
  struct Params {
    uint32_t producer_arrivals;  // arrivals that complete a phase of full[s]
    uint32_t consumer_arrivals;  // arrivals that complete a phase of empty[s]
  };

  uint64_t* full;   // [kStages] in shared memory
  uint64_t* empty;  // [kStages] in shared memory
  uint32_t timeout_code;  // written to g_dsaib_wait_timeout_code on a timed-out wait

  /// By one thread, then init_barriers_fence_and_sync() before any other use.
  __device__ void init(Params p) const {
    for (int s = 0; s < kStages; ++s) {
      cuda::ptx::mbarrier_init(&full[s], p.producer_arrivals);
      cuda::ptx::mbarrier_init(&empty[s], p.consumer_arrivals);
    }
  }

  __device__ void producer_acquire(const PipelineState<kStages>& st) const { mbarrier_wait(&empty[st.index], st.phase, timeout_code); }
  /// Called by EVERY producer thread after its own writes (and proxy fence).
  __device__ void producer_commit(const PipelineState<kStages>& st) const { (void)cuda::ptx::mbarrier_arrive(&full[st.index]); }
  __device__ void consumer_wait(const PipelineState<kStages>& st) const { mbarrier_wait(&full[st.index], st.phase, timeout_code); }
  /// Called by EVERY consumer thread after its last read of the stage
  /// (for wgmma operands: after warpgroup_wait).
  __device__ void consumer_release(const PipelineState<kStages>& st) const { (void)cuda::ptx::mbarrier_arrive(&empty[st.index]); }
};

/// The storage at the first 1024-byte boundary of the dynamic shared memory
/// (swizzle atoms), as an offset from smem_raw so that the compiler still
/// emits STS/LDS, not generic ST/LD. The storage sizes add 1024 bytes of slack.
template <class Storage>
__device__ __forceinline__ Storage& shared_storage_at_1024(uint8_t* smem_raw) {
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  return *reinterpret_cast<Storage*>(smem_raw + ((1024u - (smem_addr & 1023u)) & 1023u));
}

/// Makes one thread's mbarrier inits visible to the async proxy and the whole CTA.
__device__ inline void init_barriers_fence_and_sync() {
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  __syncthreads();
}

}  // namespace dsaib::hopper
