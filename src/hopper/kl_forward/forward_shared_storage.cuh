// Shared memory of the sm_90a loss forward, with the contract of every mbarrier
// that guards it (docs/sync-contract.md).
#pragma once

#include <cute/tensor.hpp>

#include "hopper/common/named_barriers.cuh"
#include "hopper/common/pipeline.cuh"
#include "hopper/common/row_running_stats.cuh"
#include "hopper/kl_forward/forward_tile_config.cuh"

namespace dsaib::hopper {

template <class Config>
struct ForwardSharedStorage {
  using Element = typename Config::Element;
  static constexpr int kWarps = Config::kScoreThreads / 32;
  alignas(1024) Element q[cute::cosize_v<typename Config::SmemLayoutQ>];  // (heads, D) x kStagesQ
  alignas(1024) Element k[cute::cosize_v<typename Config::SmemLayoutK>];  // (64 keys, D) x kStagesK
  // ---- per K stage: each gathered key's slot in its row (-1 on tail entries),
  //      its T~ = max(T, eps) (0 on tail entries) and its key row; whether the
  //      block is its row's last (every row sends at least one block)
  int32_t key_slot[Config::kStagesK][Config::kBlockKeys];
  float key_target[Config::kStagesK][Config::kBlockKeys];
  int32_t key_row[Config::kStagesK][Config::kBlockKeys];
  int32_t block_last[Config::kStagesK];
  // ---- per Q stage
  float w_scaled[Config::kStagesQ][Config::kHeadTile];  // w_h * sm_scale, 0 for padded heads
  // ---- producer-private (NamedBarrierId::kProducerSync): the compacted slot list of one chunk
  // (the chunk's entries after up to kBlockKeys - 1 carried from the chunk before)
  alignas(16) int32_t slot_index[Config::kSlotChunk + Config::kBlockKeys];
  alignas(16) float slot_target[Config::kSlotChunk + Config::kBlockKeys];
  alignas(16) int32_t slot_key_row[Config::kSlotChunk + Config::kBlockKeys];
  float producer_partial[Config::kProducerThreads / 32][2];
  int32_t producer_scan[Config::kProducerThreads / 32];
  int32_t producer_scan_rows[Config::kSlotsPerThread][Config::kProducerThreads / 32];
  // ---- score-role-private (NamedBarrierId::kForwardScoreSync)
  RowRunningStats row_stats[2][kWarps];  // per-warp statistics of a row, by row parity
  double row_part[kWarps][3];          // per-warp (loss term, target mass, sum of the rebuilt P) of a slot pass

  // k_full[s] / k_empty[s]: as the backward's (shared_storage.cuh), with
  // key_slot[s] in place of gs[s]: the producer's 128 threads arrive on full
  // after their key_slot/key_target/key_row stores, cp.async wait and proxy
  // fence, thread 0 also after its block_last[s] store; the score role's 128
  // threads arrive on empty after the warpgroup_wait that retires the block's
  // GEMM1 and their reads of key_slot[s] / key_target[s] / block_last[s].
  uint64_t k_full[Config::kStagesK];
  uint64_t k_empty[Config::kStagesK];
  // q_full[s]: the producer's 128 threads, after w_scaled stores, Q cp.async
  // wait and proxy fence. q_empty[s]: the score role's 128 threads, after the
  // warpgroup_wait<0> that retires the row's last GEMM1 (every wgmma of the
  // row reads q[s]) and their reads of w_scaled[s].
  uint64_t q_full[Config::kStagesQ];
  uint64_t q_empty[Config::kStagesQ];
};

template <class Config>
constexpr int forward_shared_storage_bytes() {
  constexpr int bytes = static_cast<int>(sizeof(ForwardSharedStorage<Config>)) + 1024;  // + alignment slack
  static_assert(bytes <= 232448, "ForwardSharedStorage exceeds the 227 KiB of shared memory a CTA can opt in to on sm_90");
  return bytes;
}

}  // namespace dsaib::hopper
