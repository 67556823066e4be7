// Shared memory of the sm_90a top-k forward, with the contract of every
// mbarrier that guards it (docs/sync-contract.md).
#pragma once

#include <cute/tensor.hpp>

#include "hopper/common/named_barriers.cuh"
#include "hopper/common/pipeline.cuh"
#include "hopper/indexer_topk/topk_tile_config.cuh"

namespace dsaib::hopper {

/// One score warpgroup's selection state for its rows of the task. Written and
/// read by that warpgroup alone, between its select barriers
/// (NamedBarrierId::kTopkSelectSync0 + warpgroup).
template <int kRows>
struct TopkSelection {
  uint32_t hist[256];              // a radix pass's digit counts
  int32_t count[kRows];            // entries in the row's current buffer half
  int32_t half[kRows];             // the row's current half (0 or 1)
  unsigned long long bound[kRows];  // admission bound: a rank key below it is not in the row's top-k
  int32_t found_bin, found_above, found_count;  // a radix pass's result (warp 0 writes it)
  int32_t out_count;               // entries written by a compaction or a merge
};

template <class Config>
struct TopkSharedStorage {
  using Element = typename Config::Element;
  static constexpr int kRows = Config::kRows;
  alignas(1024) Element q[cute::cosize_v<typename Config::SmemLayoutQ>];  // (rows x heads, D) x 2 halves x kStagesQ
  alignas(1024) Element k[cute::cosize_v<typename Config::SmemLayoutK>];  // (64 keys, D) x kStagesK
  // ---- per Q stage: the task
  float w[Config::kStagesQ][Config::kN];  // weights by task column (row = column / kHeadTile); 0 where padded
  int64_t key_begin[Config::kStagesQ][kRows];  // flat key rows each row sees: [key_begin, key_end)
  int64_t key_end[Config::kStagesQ][kRows];
  int64_t tile_base[Config::kStagesQ];  // flat key row of the first key of the task's first tile
  int32_t num_tiles[Config::kStagesQ];
  // ---- per score warpgroup
  TopkSelection<Config::kWgRows> sel[Config::kScoreWarpgroups];

  // q_full[s]: the producer's 128 threads arrive after their stores of w[s],
  // key_begin[s], key_end[s], tile_base[s], num_tiles[s] (thread 0 the task's
  // scalars), their Q cp.async wait and a proxy fence. q_empty[s]: both score
  // warpgroups' 256 threads arrive after the warpgroup_wait that retires their
  // last GEMM of the task (every GEMM reads q[s]) and their last reads of w[s]
  // and the ranges.
  uint64_t q_full[Config::kStagesQ];
  uint64_t q_empty[Config::kStagesQ];
  // k_full[s]: the producer's 128 threads arrive after their cp.async wait for
  // the tile's copies and a proxy fence. k_empty[s]: both score warpgroups'
  // 256 threads arrive, each after the warpgroup_wait that retires its GEMM of
  // the tile. Each consumer takes the stages' uses in order and no wait runs
  // more than one phase ahead of a stage's barrier (the producer refills a
  // stage only after both released it).
  uint64_t k_full[Config::kStagesK];
  uint64_t k_empty[Config::kStagesK];
};

template <class Config>
constexpr int topk_shared_storage_bytes() {
  constexpr int bytes = static_cast<int>(sizeof(TopkSharedStorage<Config>)) + 1024;  // + alignment slack
  static_assert(bytes <= 232448, "TopkSharedStorage exceeds the 227 KiB of shared memory a CTA can opt in to on sm_90");
  return bytes;
}

}  // namespace dsaib::hopper
