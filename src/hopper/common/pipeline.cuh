// mbarrier pipelines: the only way roles of the sm_90a kernel hand buffers to
// each other. Four verbs: producer_acquire / producer_commit and
// consumer_wait / consumer_release, over one PipelineState (stage + phase).
//
// Memory-model rules this file encodes (docs/sync-contract.md):
// - mbarrier.arrive has .release.cta semantics for the ARRIVING thread's own
//   earlier accesses only. So every thread that wrote (or read, for "empty")
//   the stage arrives itself; arrive counts equal the number of such threads.
// - A waiter's successful try_wait has .acquire.cta semantics.
// - Writes that the async proxy (wgmma, bulk copies) reads next are followed by
//   fence.proxy.async.shared::cta in the writing thread before its arrive; that
//   is the caller's duty, stated at each call site.
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

/// The producer waits on "empty", which no consumer has completed yet. A fresh
/// mbarrier is in phase 0, and try_wait.parity(1) asks about the phase BEFORE
/// it, which counts as complete: so the producer starts on phase 1 and its
/// first kStages acquires pass at once (all buffers start free).
template <int kStages>
__device__ PipelineState<kStages> make_producer_start_state() {
  return {0u, 1u};
}

/// Why a kernel trapped: written before __trap() by a timed-out wait
/// (the MbarrierPipeline id: 1 = k pipeline, 2 = q pipeline, 3 = dK ring of the
/// scatter role, 4 = sA hand-off from the score role to the dK role, 5 = the
/// loss-and-gradient kernels' row statistics, stats_full, 6 = their forward
/// blocks' K stages), readable
/// by a debugger or a later launch.
static __device__ uint32_t g_dsaib_wait_timeout_code = 0;

/// The cold path of a timed-out wait: records why, then traps. Out of line on
/// purpose: with a `trap` inlined into the roles, ptxas (nvcc 13.0) ignores a
/// `setmaxnreg.inc` (a region then gets the lower of the entry limit and its own;
/// a `.dec` still applies) and prints no diagnostic (seen in a build with the
/// trap inlined); as a call on the cold path it does not.
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

  /// One thread initialises; the caller then runs fence_mbarrier_init and a
  /// CTA-wide barrier before any other use (init_barriers_fence_and_sync()).
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

/// The kernel's shared-memory storage at the first 1024-byte boundary of the
/// dynamic shared memory (128-byte swizzle atoms), reached by an offset from
/// smem_raw so that the compiler still knows the pointer is shared memory
/// (STS/LDS, not generic ST/LD). The storage sizes add 1024 bytes of slack.
template <class Storage>
__device__ __forceinline__ Storage& shared_storage_at_1024(uint8_t* smem_raw) {
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  return *reinterpret_cast<Storage*>(smem_raw + ((1024u - (smem_addr & 1023u)) & 1023u));
}

/// After one thread initialised all mbarriers: make the inits visible to the
/// async proxy and to every thread of the CTA.
__device__ inline void init_barriers_fence_and_sync() {
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  __syncthreads();
}

}  // namespace dsaib::hopper
