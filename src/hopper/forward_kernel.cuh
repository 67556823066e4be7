// The sm_90a loss forward (docs/kl-forward.md): tile choices,
// shared memory, parameters and the kernel. Two roles, one warpgroup each:
//
//   warpgroup 0 : ProducerGather without stage 1 (producer_gather.cuh, shared
//                 with the backward): Q/w loads, compaction of the valid slots,
//                 K gather into kStagesK stages; each gathered key carries its
//                 slot and its T~ = max(T, eps).
//   warpgroup 1 : ForwardScore (forward_score.cuh): GEMM1 with wgmma, keys as M
//                 and heads as N (S^T = K Q^T, both operands in shared memory), so
//                 the weighted relu head sum z of a key stays within a thread and
//                 its quad; the row's running max / sum of exp and the sums of
//                 T~ z and T~ as the blocks arrive; per row LSE, the target mass
//                 and the loss term, and P or a clipped row by a pass over its slots.
//
// One task = one query row with ALL its heads (kHeadTile 64 for H <= 64, 128
// above), since z sums over every head. Persistent: CTA b takes rows b,
// b + gridDim.x, ... A row's logits also go to the CTA's z scratch row (global
// memory, indexed by slot) for that pass; per-row loss terms go to a
// workspace that a second kernel sums in a fixed order.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "hopper/kernel_params.hpp"
#include "hopper/named_barriers.cuh"
#include "hopper/pipeline.cuh"

namespace dsaib::hopper {

template <int kHeadDim_, int kHeadTile_>
struct ForwardTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "D must be 64 or 128");
  static constexpr int kHeadTile = kHeadTile_;  // heads per task: every head of the row, padded
  static_assert(kHeadTile == 64 || kHeadTile == 128, "one or two m64 wgmma tiles");
  static constexpr int kBlockKeys = 64;  // keys per gathered block (the backward's)
  // Without the backward's sA, dK staging and A operands, eight K stages fit
  // (D 128, 128 heads: 64 KiB of Q stages + 128 KiB of K stages).
  static constexpr int kStagesK = 8;
  static constexpr int kStagesQ = 2;
  static constexpr int kThreadsPerWarpgroup = 128;
  static constexpr int kProducerThreads = kThreadsPerWarpgroup;
  static constexpr int kScoreThreads = kThreadsPerWarpgroup;
  static constexpr int kProducerWarpgroup = 0;
  static constexpr int kScoreWarpgroup = 1;
  static constexpr int kThreads = kProducerThreads + kScoreThreads;
  static constexpr int kSlotsPerThread = 8;  // the producer's slot chunks, as the backward's
  static constexpr int kSlotChunk = kProducerThreads * kSlotsPerThread;

  using Element = cutlass::bfloat16_t;
  using SmemAtom = decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{});
  // sQ: (heads, D, stage); sK: (keys, D, stage) — the backward's layouts
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kHeadTile>, cute::Int<kHeadDim>, cute::Int<kStagesQ>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDim>, cute::Int<kStagesK>>{}));
  // GEMM1 transposed against the backward's: S^T (keys, heads) = K Q^T with the
  // same shared-memory operands (K-major, 128-byte swizzle), K as A and Q as B.
  // Keys as M put a key's heads in one thread and its quad, so the head sum
  // needs two shuffles and no exchange between warps.
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadTile>, cute::Int<kHeadDim>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));
};

/// One part of a row's statistics over its valid slots, in the order the
/// blocks arrive: the running max m of the logits z and sum s of exp(z - m)
/// (a -inf logit adds nothing), the smallest z, the fp64 sums of T~ z and of
/// T~, and the number of valid slots.
struct RowStatistics {
  float m, s, z_min;
  double target_logit, target;
  int32_t count;  // valid slots
};

template <class Config>
struct ForwardSharedStorage {
  using Element = typename Config::Element;
  static constexpr int kWarps = Config::kScoreThreads / 32;
  alignas(1024) Element q[cute::cosize_v<typename Config::SmemLayoutQ>];  // (heads, D) x kStagesQ
  alignas(1024) Element k[cute::cosize_v<typename Config::SmemLayoutK>];  // (64 keys, D) x kStagesK
  // ---- per K stage: each gathered key's slot in its row (-1 on tail entries),
  //      its T~ = max(T, eps) (0 on tail entries) and its key row
  int32_t key_slot[Config::kStagesK][Config::kBlockKeys];
  float key_target[Config::kStagesK][Config::kBlockKeys];
  int32_t key_row[Config::kStagesK][Config::kBlockKeys];
  // ---- per Q stage
  float w_scaled[Config::kStagesQ][Config::kHeadTile];  // w_h * sm_scale, 0 for padded heads
  int32_t num_blocks[Config::kStagesQ];
  // ---- producer-private (NamedBarrierId::kProducerSync): the compacted slot list of one chunk
  alignas(16) int32_t slot_index[Config::kSlotChunk];
  alignas(16) float slot_target[Config::kSlotChunk];
  alignas(16) int32_t slot_key_row[Config::kSlotChunk];
  float producer_partial[Config::kProducerThreads / 32][2];
  int32_t producer_scan[Config::kProducerThreads / 32];
  int32_t producer_scan_rows[Config::kSlotsPerThread][Config::kProducerThreads / 32];
  // ---- score-role-private (NamedBarrierId::kForwardScoreSync)
  RowStatistics row_stats[2][kWarps];  // per-warp statistics of a row, by row parity
  double row_part[kWarps][3];          // per-warp (loss term, target mass, sum of the rebuilt P) of a slot pass

  // k_full[s] / k_empty[s]: as the backward's (shared_storage.cuh), with
  // key_slot[s] in place of gs[s]: the producer's 128 threads arrive on full
  // after their key_slot/key_target/key_row stores, cp.async wait and proxy
  // fence; the score role's 128 threads arrive on empty after the warpgroup_wait
  // that retires the block's GEMM1 and their reads of key_slot[s] / key_target[s].
  uint64_t k_full[Config::kStagesK];
  uint64_t k_empty[Config::kStagesK];
  // q_full[s]: the producer's 128 threads, after w_scaled/num_blocks stores,
  // Q cp.async wait and proxy fence. q_empty[s]: the score role's 128 threads,
  // after the warpgroup_wait<0> that retires the row's last GEMM1 (every wgmma
  // of the row reads q[s]) and their reads of w_scaled[s] / num_blocks[s].
  uint64_t q_full[Config::kStagesQ];
  uint64_t q_empty[Config::kStagesQ];
};

template <class Config>
constexpr int forward_shared_storage_bytes() {
  constexpr int bytes = static_cast<int>(sizeof(ForwardSharedStorage<Config>)) + 1024;  // + alignment slack
  static_assert(bytes <= 232448, "ForwardSharedStorage exceeds the 227 KiB of shared memory a CTA can opt in to on sm_90");
  return bytes;
}

/// The loss forward's parameters: the inputs as the backward's producer reads
/// them (head_groups 1, num_tasks = query rows, no index_score), the outputs and
/// the workspace.
struct IndexerKLForwardParams {
  IndexerBackwardParams in;
  float* row_lse;          // (num_q_rows)
  float* row_target_mass;  // (num_q_rows): sum T~ [Pb >= eps] / sum Pb, Pb = exp(z - row_lse) (forward_score.cuh)
  float* index_score;      // (num_q_rows, topk) contiguous, or null
  double* loss_terms;      // (num_q_rows) workspace: sum_i T~_i log(max(P_i, eps)) per row
  float* z_scratch;        // (gridDim.x, z_stride) workspace: a row's logits by slot
  int64_t z_stride;
};

}  // namespace dsaib::hopper
