// Shared memory of the sm_90a indexer backward, with the contract of every
// mbarrier that guards it (docs/sync-contract.md).
#pragma once

#include <cute/tensor.hpp>

#include "hopper/common/named_barriers.cuh"
#include "hopper/common/pipeline.cuh"
#include "hopper/common/tile_config.cuh"

namespace dsaib::hopper {

/// The P-free kernels' part (PFreeConfig): the score role's per-warp partial
/// logits of a key block (kPFreeScoreSync), and per Q stage the row's LSE and
/// G = -c * row_target_mass (published with the stage by q_full, as w_scaled).
template <class Config>
struct PFreeStorage {
  float z_part[Config::kScoreThreads / 32][Config::kBlockKeys];
  float row_lse[Config::kStagesQ];
  float row_g[Config::kStagesQ];
};
/// The other kernels: one byte, inside SharedStorage's alignment padding.
struct NoPFreeStorage {};

/// The loss-and-gradient kernels' part, completed in
/// loss_and_grad/loss_and_grad_storage.cuh with its mbarrier contracts.
template <class Config>
struct LossAndGradStorage;
struct NoLossAndGradStorage {};

template <class Config>
struct SharedStorage {
  using Element = typename Config::Element;
  static constexpr int kStagesK = Config::kStagesK;
  static constexpr int kStagesQ = Config::kStagesQ;

  // ---- buffers read by wgmma (async proxy; q also by the score role's ldmatrix);
  //      1024-byte aligned for the 128B swizzle
  alignas(1024) Element q[cute::cosize_v<typename Config::SmemLayoutQ>];  // (64 heads, D) x kStagesQ
  alignas(1024) Element k[cute::cosize_v<typename Config::SmemLayoutK>];  // (64 keys, D) x kStagesK
  alignas(1024) Element a[cute::cosize_v<typename Config::SmemLayoutA>];  // (64 keys, 64 heads) x kATerms x kABuffers
  // ---- the dK block staged row-contiguous (rows padded: 2 wavefronts per float2
  //      store, the minimum), dK role -> scatter role through dk_full / dk_empty
  alignas(128) float dk_stage[Config::kDkBuffers][Config::kBlockKeys][Config::kHeadDim + Config::kDkStagePad];
  // With dk_stage[b]: each row's flat key row (-1 on tail rows) and the end marker.
  int32_t dk_key_row[Config::kDkBuffers][Config::kBlockKeys];
  int32_t dk_end[Config::kDkBuffers];
  // With sA[b]: each key's flat key row (-1 on tail keys), so the dK role needs no K stage.
  int32_t a_key_row[Config::kABuffers][Config::kBlockKeys];
  // ---- per K stage, read with ordinary loads
  float gs[kStagesK][Config::kBlockKeys];        // dLoss/dz of each gathered slot (0 on tail entries)
  int32_t key_row[kStagesK][Config::kBlockKeys]; // flat index_k row of each gathered slot, -1 on tail entries
  // ---- per Q stage, read with ordinary loads
  float w_scaled[kStagesQ][Config::kHeadTile];   // w_h * sm_scale, 0 for padded heads
  int32_t num_blocks[kStagesQ];                  // blocks of valid keys in this task
  // ---- producer-private (ordered by NamedBarrierId::kProducerSync)
  float slot_gs[Config::kSlotChunk];             // compacted valid slots of one chunk: gs
  alignas(16) int32_t slot_key_row[Config::kSlotChunk];  //   and flat key row, in slot order (int4 reads)
  float producer_partial[Config::kProducerThreads / 32][2];  // per-warp (G, count) partials
  int32_t producer_scan[Config::kProducerThreads / 32];      // pass 1: per-warp valid counts for the scan
  int32_t producer_scan_rows[Config::kSlotsPerThread][Config::kProducerThreads / 32];  // pass 2: valid slots per (slot row, warp)

  // ---------------------------------------------------------------------------
  // k_full[s]   "gathered block s is ready"
  //   arrive count : Config::kProducerThreads (128) thread arrivals, one per producer thread
  //   who arrives  : every producer thread, after (1) its gs/key_row stores for stage s, (2)
  //                  cp.async.wait_group proving its own cp.async copies into k[s] (zero-fill included)
  //                  completed, and (3) fence.proxy.async.shared::cta
  //   tx bytes     : none (cp.async completion is waited for, not tracked)
  //   waiters      : all score-role threads, on the consumer PipelineState's phase
  //   publishes    : k[s], gs[s][*], key_row[s][*]
  //   reuse        : the producer overwrites stage s only after k_empty[s]
  // k_empty[s]  "stage s may be overwritten"
  //   arrive count : Config::kScoreThreads (128) thread arrivals
  //   who arrives  : every score-role thread, after the warpgroup_wait<0> that completes GEMM1 and GEMM3 of the
  //                  block (the wgmma reads of k[s]; GEMM3's wait is the next block's, or the task's last) and
  //                  its own reads of gs[s] / key_row[s]
  //   tx bytes     : none
  //   waiters      : producer threads, starting on phase 1 (make_producer_start_state)
  //   publishes    : the end of all reads of stage s (write-after-read order)
  //   reuse        : immediately after the wait
  uint64_t k_full[kStagesK];
  uint64_t k_empty[kStagesK];
  // q_full[s]   "task s's Q tile, w_scaled and num_blocks are ready"
  //   arrive count : Config::kProducerThreads (128) thread arrivals
  //   who arrives  : every producer thread, after its w_scaled/num_blocks stores, cp.async.wait_group 0 for its
  //                  Q copies, and fence.proxy.async (GEMM2 reads q[s] through the async proxy; the score
  //                  role's ldmatrix loads of q[s] are generic-proxy reads)
  //   tx bytes     : none
  //   waiters      : all score-role and dK-role threads, consumer phase
  //   publishes    : q[s], w_scaled[s][*], num_blocks[s]
  //   reuse        : after q_empty[s]
  // q_empty[s]  "Q stage s may be overwritten"
  //   arrive count : Config::kScoreThreads + Config::kDkThreads (256) thread arrivals
  //   who arrives  : every score-role thread after the task's last warpgroup_wait<0> (its reads of q[s] are the
  //                  ldmatrix loads of the task's Q into registers, before its first GEMM1), every dK-role
  //                  thread after its last GEMM2 (the score role after reading w_scaled / num_blocks, the dK
  //                  role after reading num_blocks)
  //   tx bytes     : none
  //   waiters      : producer threads, starting on phase 1
  //   publishes    : the end of all reads of q[s]
  //   reuse        : immediately after the wait
  uint64_t q_full[kStagesQ];
  uint64_t q_empty[kStagesQ];
  // a_full[b]   "A of a block (every term) and its key rows are in sA[b] / a_key_row[b]"
  //   arrive count : Config::kScoreThreads (128) thread arrivals
  //   who arrives  : every score-role thread, after its stmatrix stores of sA[b] (lanes 0-15 of each warp:
  //                  a_key_row[b]) and fence.proxy.async.shared::cta (GEMM2 reads sA[b] through the async
  //                  proxy)
  //   tx bytes     : none
  //   waiters      : all dK-role threads, consumer-side PipelineState
  //   publishes    : sA[b] (all terms), a_key_row[b][*]
  //   reuse        : the score role rewrites buffer b only after a_empty[b]
  // a_empty[b]  "sA[b] / a_key_row[b] may be overwritten"
  //   arrive count : Config::kDkThreads (128) thread arrivals
  //   who arrives  : every dK-role thread, after warpgroup_wait<0> of GEMM2 (the wgmma reads of sA[b]) and its
  //                  read of a_key_row[b]
  //   tx bytes     : none
  //   waiters      : score-role threads, starting on phase 1
  //   publishes    : the end of all reads of buffer b (write-after-read): the dK role is its only reader (the
  //                  score role's GEMM3 takes A from registers, see below)
  //   reuse        : immediately after the wait
  uint64_t a_full[Config::kABuffers];
  uint64_t a_empty[Config::kABuffers];
  // dk_full[b]  "dK block (or the end marker) staged in buffer b"
  //   arrive count : Config::kDkThreads (128) thread arrivals
  //   who arrives  : every dK-role thread, after its stores of dk_stage[b] (lanes 0-15 of each warp:
  //                  dk_key_row[b]; thread 0: dk_end[b])
  //   tx bytes     : none
  //   waiters      : all scatter threads, consumer-side PipelineState
  //   publishes    : dk_stage[b][*], dk_key_row[b][*], dk_end[b]
  //   reuse        : the dK role restages buffer b only after dk_empty[b]
  // dk_empty[b] "buffer b may be overwritten"
  //   arrive count : Config::kScatterThreads (128) thread arrivals
  //   who arrives  : every scatter thread, after its loads of dk_stage[b] / dk_key_row[b]
  //   tx bytes     : none
  //   waiters      : dK-role threads, starting on phase 1
  //   publishes    : the end of the scatter role's reads of buffer b (write-after-read)
  //   reuse        : immediately after the wait
  uint64_t dk_full[Config::kDkBuffers];
  uint64_t dk_empty[Config::kDkBuffers];
  // The score role's register operands, which no mbarrier guards. It reads no
  // sA: GEMM3 takes A from registers, which its stmatrix into sA[b] reads before
  // GEMM3 is issued (PTX leaves them undefined until wgmma.wait_group); the next
  // block's warpgroup_wait<0> (or the one after the loop) completes GEMM3 before
  // A is rewritten or dQ read. GEMM1 takes Q from registers loaded once per task
  // after q_full; every GEMM1 of the previous task was waited for first.

  std::conditional_t<kIsPFree<Config>, PFreeStorage<Config>, NoPFreeStorage> p_free;
  std::conditional_t<kFusesForward<Config>, LossAndGradStorage<Config>, NoLossAndGradStorage> fused;
};

template <class Config>
struct KernelBarrierCounts {
  // K stages: every producer thread fills, every score-role thread releases.
  static constexpr uint32_t kKFullArrivals = Config::kProducerThreads;
  static constexpr uint32_t kKEmptyArrivals = Config::kScoreThreads;
  // Q stages: every producer thread fills, both MMA roles release.
  static constexpr uint32_t kQFullArrivals = Config::kProducerThreads;
  static constexpr uint32_t kQEmptyArrivals = Config::kScoreThreads + Config::kDkThreads;
  // sA buffers: every score-role thread fills, every dK-role thread releases.
  static constexpr uint32_t kAFullArrivals = Config::kScoreThreads;
  static constexpr uint32_t kAEmptyArrivals = Config::kDkThreads;
  // dK ring: every dK-role thread stages, every scatter thread reads.
  static constexpr uint32_t kDkFullArrivals = Config::kDkThreads;
  static constexpr uint32_t kDkEmptyArrivals = Config::kScatterThreads;
  // Each role is one whole warpgroup, and every thread of it arrives.
  static_assert(Config::kProducerThreads == Config::kThreadsPerWarpgroup &&
                    Config::kScoreThreads == Config::kThreadsPerWarpgroup &&
                    Config::kDkThreads == Config::kThreadsPerWarpgroup &&
                    Config::kScatterThreads == Config::kThreadsPerWarpgroup &&
                    Config::kThreads == 4 * Config::kThreadsPerWarpgroup,
                "one warpgroup per role, every thread of a role arrives");
};

/// The backward's four pipelines over the barriers above (timeout codes: pipeline.cuh).
template <class Config>
struct BackwardPipelines {
  MbarrierPipeline<Config::kStagesK> k;     // the producer fills K stages, the score role empties them
  MbarrierPipeline<Config::kStagesQ> q;     // the producer fills Q stages, both MMA roles empty them
  MbarrierPipeline<Config::kDkBuffers> dk;  // the dK role fills dk_stage, the scatter role empties it
  MbarrierPipeline<Config::kABuffers> a;    // the score role fills sA, the dK role empties it

  __device__ explicit BackwardPipelines(SharedStorage<Config>& ss)
      : k{ss.k_full, ss.k_empty, 1u}, q{ss.q_full, ss.q_empty, 2u}, dk{ss.dk_full, ss.dk_empty, 3u}, a{ss.a_full, ss.a_empty, 4u} {}

  /// By one thread, before init_barriers_fence_and_sync().
  __device__ void init() const {
    using Counts = KernelBarrierCounts<Config>;
    k.init({Counts::kKFullArrivals, Counts::kKEmptyArrivals});
    q.init({Counts::kQFullArrivals, Counts::kQEmptyArrivals});
    dk.init({Counts::kDkFullArrivals, Counts::kDkEmptyArrivals});
    a.init({Counts::kAFullArrivals, Counts::kAEmptyArrivals});
  }
};

template <class Config>
constexpr int shared_storage_bytes() {
  constexpr int bytes = static_cast<int>(sizeof(SharedStorage<Config>)) + 1024;  // + alignment slack
  // sm_90's opt-in maximum of dynamic shared memory per block (227 KiB).
  static_assert(bytes <= 232448, "SharedStorage exceeds the 227 KiB of shared memory a CTA can opt in to on sm_90");
  return bytes;
}

}  // namespace dsaib::hopper
