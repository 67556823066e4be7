// The attention target kernel's tiles, parameters and shared memory with its
// mbarrier contracts (docs/hopper-kernel.md §14). Keys are the wgmma M and heads
// its N, so U's sum over heads stays in a thread's quad. kSelectedLse (no lse
// given): each row's keys are swept twice, first for each head's lse over them.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <cuda/ptx>

#include "hopper/common/kernel_params.hpp"
#include "hopper/common/pipeline.cuh"

namespace dsaib::hopper {

template <int kHeadsPadded_, int kMaxSlices_, bool kSelectedLse_ = false>
struct AttentionTargetConfig {
  // wgmma N: Hq rounded up; padded heads have lse2 = +inf and add exp2(-inf) = 0.
  static constexpr int kHeadsPadded = kHeadsPadded_;
  static_assert(kHeadsPadded == 64 || kHeadsPadded == 128, "one n64 or n128 wgmma tile of heads");
  static constexpr int kBlockKeys = 64;  // wgmma M: keys per gathered block
  static constexpr int kSliceDims = 64;  // dims per stage: one 128-byte swizzle row per key
  // Dqk up to kMaxSlices * 64: 192 or 576 (DeepSeek-V3.2's).
  static constexpr int kMaxSlices = kMaxSlices_;
  static_assert(kMaxSlices == 3 || kMaxSlices == 9, "Dqk up to 192 or 576");
  // Q stays in shared memory for the whole row: two stages where one is at most
  // 96 KiB (the next row's lands during this row), else one (128 x 576: 144 KiB).
  static constexpr int kQStageBytes = kHeadsPadded * kSliceDims * kMaxSlices * 2;
  static constexpr int kStagesQ = kQStageBytes <= 96 * 1024 ? 2 : 1;
  // With normalize, a row's U waits for its sum: in shared memory (two rows of up
  // to kSmemTopk slots) where the Q stages leave room, else in attn_score.
  static constexpr int kSmemTopk = kStagesQ * kQStageBytes <= 64 * 1024 ? 2048 : 0;
  // No lse given: the producer sends each row's blocks twice (sweep 0: each
  // head's max and sum of exp2 over the row's keys, with heads as the wgmma M
  // (TiledMmaHeads) so that a thread holds 2 heads per 64, merged across the two
  // consumers through lse_part; sweep 1: U with that lse), the second gather
  // likely from the L2.
  static constexpr bool kSelectedLse = kSelectedLse_;
  static constexpr int kLsePartBytes = kSelectedLse ? kHeadsPadded * 8 : 0;
  // (block, slice) stages of 8 KiB in the rest of the 227 KiB, at most 16; every
  // free stage can have its copies in flight (they complete on its mbarrier).
  static constexpr int kStageBytes = kBlockKeys * kSliceDims * 2;
  static constexpr int kStageBudget = 216 * 1024 - kStagesQ * kQStageBytes - 2 * kSmemTopk * 4 - kLsePartBytes;
  static constexpr int kStagesFit = kStageBudget / (kStageBytes + 256) < 16 ? kStageBudget / (kStageBytes + 256) : 16;
  // One ring per consumer (blocks c, c + 2, ... of a row): in a shared ring a
  // consumer would skip the other's stages and wait more than one phase ahead of a
  // barrier, which a parity wait cannot tell from the phase two before.
  static constexpr int kStagesPerConsumer = kStagesFit / 2;
  static constexpr int kStagesK = 2 * kStagesPerConsumer;
  static_assert(kStagesPerConsumer >= 3, "a pipeline of K stages per consumer");
  // L2 prefetch of the kv rows this many blocks ahead of the copies (0: none).
  static constexpr int kPrefetchBlocksAhead = 0;

  // A producer and two consumers on alternate blocks, so that one consumer's exp2
  // epilogue runs beside the other's wgmma.
  static constexpr int kThreadsPerWarpgroup = 128;
  static constexpr int kProducerThreads = kThreadsPerWarpgroup;
  static constexpr int kConsumers = 2;
  static constexpr int kConsumerThreads = kConsumers * kThreadsPerWarpgroup;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kProducerWarpgroup = 0;  // consumers: warpgroups 1 and 2
  // The producer's slot chunks, as the indexer kernels'.
  static constexpr int kSlotsPerThread = 8;
  static constexpr int kSlotChunk = kProducerThreads * kSlotsPerThread;
  static constexpr int kGatherKeysPerThread = kBlockKeys * (kSliceDims / 8) / kProducerThreads;  // 16-byte copies: 4
  static_assert(kGatherKeysPerThread * kProducerThreads == kBlockKeys * kSliceDims / 8, "whole slices");

  using Element = cutlass::bfloat16_t;
  using SmemAtom = decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{});  // 8 rows x 64 bf16, 128B swizzle
  // sQ: (heads, 64 dims, slice + kMaxSlices * Q stage)
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kHeadsPadded>, cute::Int<kSliceDims>, cute::Int<kMaxSlices * kStagesQ>>{}));
  // sK: (64 keys, 64 dims, stage)
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockKeys>, cute::Int<kSliceDims>, cute::Int<kStagesK>>{}));
  // S^T = K . Q^T, both operands from shared memory, K-major: m64 n{64,128} k16, 4 per slice.
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadsPadded>, cute::Int<kSliceDims>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));
  // kSelectedLse's sweep 0: S = Q . K^T, the same operands swapped: m64 n64 k16,
  // kHeadsPadded / 64 tiles along M, 4 per slice.
  using TiledMmaHeads = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kHeadsPadded>, cute::Int<kBlockKeys>, cute::Int<kSliceDims>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));
};

/// The kernel's parameters: the indexer's input addressing (query as index_q,
/// kv as index_k; rows, sequences, ids: problem_device.cuh) and the target's own.
struct AttentionTargetParams {
  IndexerParams in;  // num_tasks = query rows, head_groups = 1
  const float* lse;          // any strides, in elements
  int64_t lse_batch_stride, lse_row_stride, lse_head_stride;
  float scale2;              // sm_scale * log2(e)
  float lse_to_log2;         // log2(e) for a natural lse, 1 for base 2
  bool normalize;
  bool u_in_smem;            // normalize and topk <= Config::kSmemTopk
  int32_t num_slices;        // Dqk / 64
  float* attn_score;         // (num_q_rows, topk) contiguous
};

template <class Config>
struct AttentionTargetStorage {
  using Element = typename Config::Element;
  static constexpr int kStagesK = Config::kStagesK;
  static constexpr int kStagesQ = Config::kStagesQ;

  // ---- wgmma operands (async proxy), 1024-byte aligned for the 128B swizzle
  alignas(1024) Element q[cute::cosize_v<typename Config::SmemLayoutQ>];
  alignas(1024) Element k[cute::cosize_v<typename Config::SmemLayoutK>];
  // ---- per K stage: the slot (position in the row) of each key of the block,
  //      -1 on tail entries; written on the block's first slice only
  int32_t key_slot[kStagesK][Config::kBlockKeys];
  // ---- per Q stage
  // lse in base 2; +inf for padded heads. Given lse: the producer's (q_full);
  // kSelectedLse: the consumers' after sweep 0 (kTargetConsumerSync)
  float lse2[kStagesQ][Config::kHeadsPadded];
  int32_t num_blocks[kStagesQ];                // blocks of valid keys in the row
  // ---- producer-private (NamedBarrierId::kProducerSync): one chunk's compacted slot list
  alignas(16) int32_t slot_index[Config::kSlotChunk];
  alignas(16) int32_t slot_key_row[Config::kSlotChunk];
  int32_t producer_scan_rows[Config::kSlotsPerThread][Config::kProducerThreads / 32];
  // ---- consumer-private (kTargetConsumerSync): per-warp partial row sums of U,
  //      by row parity (the next row's are written before this row's are all read)
  float row_part[2][Config::kConsumers][Config::kThreadsPerWarpgroup / 32];
  // ---- U of two rows by parity (u_in_smem): the producer's -0 at invalid slots
  //      (q_full), the consumers' U (kTargetConsumerSync); rewritten for row n + 2
  //      after q_empty of row n, which follows row n's final pass
  float u_row[2][Config::kSmemTopk > 0 ? Config::kSmemTopk : 1];
  // ---- consumer-private (kTargetConsumerSync), kSelectedLse: consumer 1's (m, l)
  //      of each head after sweep 0 (base 2), read by consumer 0 after a barrier;
  //      the next barrier publishes lse2 and ends the reads before the next row's writes
  float2 lse_part[Config::kSelectedLse ? Config::kHeadsPadded : 1];

  // ---------------------------------------------------------------------------
  // k_full[s]   "stage s holds slice s' of a gathered block"
  //   arrive count : 2 * kProducerThreads (256): per producer thread one cp.async.mbarrier.arrive.noinc, which
  //                  arrives when all of the thread's earlier cp.async copies (zero-fill included) have landed,
  //                  and one mbarrier.arrive (release) after its key_slot[s] stores (slice 0 of a block; none
  //                  otherwise)
  //   tx bytes     : none
  //   waiters      : the consumer whose ring holds stage s (128 threads), then fence.proxy.async.shared::cta
  //                  before its wgmma reads k[s]
  //   publishes    : k[s], key_slot[s][*]
  //   reuse        : the producer rewrites stage s only after k_empty[s]
  //   order        : a ring takes its consumer's blocks of a row in block order; with kSelectedLse the same
  //                  blocks twice (sweep 0, then sweep 1), each slice of each sweep its own phase
  // k_empty[s]  "stage s may be overwritten"
  //   arrive count : kThreadsPerWarpgroup (128): the threads of the consumer whose ring holds s
  //   who arrives  : each of them after the warpgroup_wait that completes the wgmma reading k[s], and (slice 0)
  //                  after its key_slot[s] reads
  //   waiters      : the 128 producer threads (producer phase, starts at 1)
  uint64_t k_full[kStagesK];
  uint64_t k_empty[kStagesK];
  // q_full[s]   "Q stage s holds the row's query, lse2 and num_blocks"
  //   arrive count : 2 * kProducerThreads (256): per producer thread one cp.async.mbarrier.arrive.noinc (its Q
  //                  copies landed) and one mbarrier.arrive after its lse2 / num_blocks stores and its stores
  //                  of the row's zeros at invalid slots (attn_score, or u_row when U stays in shared memory)
  //   waiters      : all 256 consumer threads, then fence.proxy.async.shared::cta
  //   publishes    : q[s] (every slice), lse2[s][*] (not with kSelectedLse: the consumers write it after
  //                  sweep 0, before their q_empty arrival), num_blocks[s], and the row's zeros (the consumers'
  //                  final pass reads them)
  // q_empty[s]  "Q stage s (and, U in shared memory, u_row of the row's parity) may be overwritten"
  //   arrive count : kConsumerThreads (256)
  //   who arrives  : every consumer thread after the warpgroup_wait<0> of its last block of the row (or at once
  //                  without a block) and its reads of lse2[s] / num_blocks[s] (at the row's start); with U in
  //                  shared memory, after its reads of u_row in the row's final pass
  //   waiters      : the 128 producer threads (producer phase, starts at 1)
  uint64_t q_full[kStagesQ];
  uint64_t q_empty[kStagesQ];
};

/// The kernel's waits trap after this much wall time (%globaltimer, read every
/// 1024 polls): a wait lasts about a row's work at most, so this is a lost
/// arrival, with a margin of thousands for compute-sanitizer's slowdown.
inline constexpr uint64_t kTargetWaitTimeoutNs = 30000000000ull;

/// The cold path of a timed-out wait (out of line, as mbarrier_wait_timed_out):
/// g_dsaib_wait_timeout_code 17 = K full, 18 = Q full, 19 = K empty, 20 = Q empty.
static __device__ __noinline__ void target_wait_timed_out(uint32_t code) {
  g_dsaib_wait_timeout_code = 16u + code;
  __trap();
}

/// Waits for the phase with parity `phase` of the mbarrier to complete, at most
/// kTargetWaitTimeoutNs.
__device__ __forceinline__ void target_wait(uint64_t* bar, uint32_t phase, uint32_t code) {
  uint32_t polls = 0;
  uint64_t start = 0;
  while (!cuda::ptx::mbarrier_try_wait_parity(bar, phase)) {
    if ((++polls & 1023u) == 0) {
      const uint64_t now = cuda::ptx::get_sreg_globaltimer();
      if (start == 0) start = now;
      else if (now - start > kTargetWaitTimeoutNs) target_wait_timed_out(code);
    }
  }
}

template <class Config>
constexpr int attention_target_smem_bytes() {
  constexpr int bytes = static_cast<int>(sizeof(AttentionTargetStorage<Config>)) + 1024;  // + alignment slack
  static_assert(bytes <= 232448, "AttentionTargetStorage exceeds the 227 KiB a CTA can opt in to on sm_90");
  return bytes;
}

}  // namespace dsaib::hopper
