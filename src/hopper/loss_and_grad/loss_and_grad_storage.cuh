// Shared memory of the loss-and-gradient kernel beyond the P-free backward's
// (SharedStorage::fused, common/shared_storage.cuh), with the contract of
// every mbarrier that guards it.
#pragma once

#include <cstdint>

#include "hopper/common/row_running_stats.cuh"
#include "hopper/common/shared_storage.cuh"

namespace dsaib::hopper {

/// Shared memory of the loss-and-gradient kernels only (LossAndGradConfig).
/// Producer-private (NamedBarrierId::kProducerSync): the compacted slot list of
/// one chunk of the forward row, beside the backward row's (slot_gs /
/// slot_key_row): each valid slot's index in its row, T~ = max(T, eps) and key
/// row, in slot order. Private to the dK role, which runs the forward
/// (NamedBarrierId::kForwardScoreSync): the forward row's per-warp statistics
/// (by row parity) and slot-pass sums, as the loss forward's (forward_score.cuh).
/// The forward blocks' ring of K stages (k stages kStagesK + f): per stage
/// each key's T~ (0 on tail entries) and its slot (-1 on tail entries), and
/// forward_full / forward_empty (contract blocks below).
template <class Config>
struct LossAndGradStorage {
  static constexpr int kWarps = Config::kDkThreads / 32;
  alignas(16) int32_t slot_index[Config::kSlotChunk];
  alignas(16) float slot_target[Config::kSlotChunk];
  alignas(16) int32_t slot_key_row[Config::kSlotChunk];
  RowRunningStats row_stats[2][kWarps];
  double row_part[kWarps][3];
  float key_target[Config::kForwardStages][Config::kBlockKeys];
  int32_t key_slot[Config::kForwardStages][Config::kBlockKeys];
  // forward_full[f]  "forward block f is ready": as k_full, for k stage
  //   kStagesK + f, key_target[f] and key_slot[f]; waiters: all dK-role threads
  // forward_empty[f] "forward stage f may be overwritten": as k_empty, with
  //   the dK role's 128 threads arriving after the warpgroup_wait that retires
  //   the block's GEMM1 and their reads of key_target[f] / key_slot[f]
  uint64_t forward_full[Config::kForwardStages];
  uint64_t forward_empty[Config::kForwardStages];
  // stats_full[s]  "the LSE and G of the row in Q stage s are in p_free.row_lse[s] / row_g[s]"
  //   arrive count : 1
  //   who arrives  : dK-role thread 0, after the row's forward (ForwardScore::finish_row,
  //                  in which this thread wrote the row's LSE and target mass to global
  //                  memory) and its stores of row_lse[s] / row_g[s]
  //   tx bytes     : none
  //   waiters      : all score-role threads, before the row's backward, on the
  //                  phase of the q_full wait that gave them the row (one
  //                  completion per row in stage s, as q_full)
  //   publishes    : p_free.row_lse[s], p_free.row_g[s]
  //   reuse        : stage s's next row is loaded only after q_empty[s], which
  //                  the score role arrives on after the backward that read them
  uint64_t stats_full[Config::kStagesQ];
};

}  // namespace dsaib::hopper
