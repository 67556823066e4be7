// Shared memory of the loss-and-gradient kernel beyond the P-free backward's
// (SharedStorage::fused), with the contract of every mbarrier that guards it.
#pragma once

#include <cstdint>

#include "hopper/common/row_running_stats.cuh"
#include "hopper/common/shared_storage.cuh"

namespace dsaib::hopper {

/// Producer-private (kProducerSync): the forward row's compacted slot list (slot,
/// T~, key row), beside the backward row's. dK-role-private (kForwardScoreSync):
/// the forward's per-warp statistics and slot-pass sums. Per forward K stage
/// (k stage kStagesK + f): each key's T~ (0 on tail entries) and slot (-1 on tail entries).
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
  //   who arrives  : dK-role thread 0, after the row's forward (ForwardScore::finish_row, in which this thread
  //                  wrote the row's LSE and target mass to global memory) and its stores of row_lse[s] /
  //                  row_g[s]
  //   tx bytes     : none
  //   waiters      : all score-role threads, before the row's backward, on the phase of the q_full wait that
  //                  gave them the row (one completion per row in stage s, as q_full)
  //   publishes    : p_free.row_lse[s], p_free.row_g[s]
  //   reuse        : stage s's next row is loaded only after q_empty[s], which the score role arrives on after
  //                  the backward that read them
  uint64_t stats_full[Config::kStagesQ];
};

}  // namespace dsaib::hopper
