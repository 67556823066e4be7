// Tile choices of the sm_90a top-k forward (indexer_topk_kernel.cuh).
//
// One task is kRows consecutive query rows with all their heads, padded to
// kHeadTile, so that rows x heads fill 256 columns: each K tile that the
// producer loads serves kRows rows (at H 64, four), which keeps the tile loads
// far below the L2's bandwidth. Each score warpgroup owns half of the task's
// rows (one wgmma N of 128) and runs every K tile against them, so that a row's
// whole selection lives in one warpgroup. Keys are wgmma's M (64 per tile), as
// in the loss forward, so a key's heads lie in one thread and its quad and the
// weighted head sum needs two shuffles.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace dsaib::hopper {

/// Element: cutlass::bfloat16_t, or cutlass::float_e4m3_t (index_q and index_k
/// in float8; wgmma k32, half the shared memory per tile).
template <int kHeadDim_, int kHeadTile_, class Element_ = cutlass::bfloat16_t>
struct TopkTileConfig {
  using Element = Element_;
  static constexpr int kElementBytes = static_cast<int>(sizeof(Element));
  static constexpr int kRowBytes = kHeadDim_ * kElementBytes;  // one key or query row in shared memory
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "D must be 64 or 128");
  static constexpr int kHeadTile = kHeadTile_;
  static_assert(kHeadTile == 32 || kHeadTile == 64 || kHeadTile == 128, "heads padded to 32, 64 or 128");
  static constexpr int kN = 256;                  // rows x heads of a task
  static constexpr int kRows = kN / kHeadTile;    // query rows per task: 8, 4 or 2
  static constexpr int kScoreWarpgroups = 2;
  static constexpr int kWgN = kN / kScoreWarpgroups;          // one score warpgroup's wgmma N: its rows x heads
  static constexpr int kWgRows = kRows / kScoreWarpgroups;    // query rows per score warpgroup: 4, 2 or 1
  static constexpr int kBlockKeys = 64;           // keys per K tile: one wgmma M
  // Two Q stages (the next task's rows load under this one's tiles) and as many
  // K stages as the rest of the 227 KiB holds.
  static constexpr int kStagesQ = 2;
  // Tile g (counted over all of a CTA's tasks) goes to K stage g % kStagesK;
  // both score warpgroups take every tile, in order.
  static constexpr int kStagesK = kRowBytes >= 256 ? 4 : 8;

  static constexpr int kThreadsPerWarpgroup = 128;
  static constexpr int kProducerThreads = kThreadsPerWarpgroup;
  // Each score warpgroup keeps two accumulators: the GEMM of its next tile runs
  // under the head sum and selection of this one (and under the other
  // warpgroup's).
  static constexpr int kScoreThreads = kScoreWarpgroups * kThreadsPerWarpgroup;
  static constexpr int kProducerWarpgroup = 0;
  static constexpr int kThreads = kProducerThreads + kScoreThreads;
  // setmaxnreg: every warpgroup starts at ptxas's limit for 384 threads; the
  // producer (64-bit row offsets of strided views) keeps 88 without a spill,
  // and the score warpgroups take the rest (two 64 x 128 fp32 accumulators are
  // 128 registers a thread).
  static constexpr int kEntryRegisters = 65536 / kThreads / 8 * 8;  // 168
  static constexpr int kProducerRegisters = 88;
  static constexpr int kScoreRegisters = 208;
  static_assert(kProducerRegisters + kScoreWarpgroups * kScoreRegisters <= 3 * kEntryRegisters,
                "setmaxnreg.inc can only take the registers the producer released");
  // The producer keeps this many K tiles' copies in flight before it waits.
  static constexpr int kCopiesInFlight = kStagesK - 1;
  // A selection pass over a row's candidates (global memory) loads this many
  // entries per thread before it uses the first.
  static constexpr int kSelectBatch = 8;
  // A row's last cut holds its buffer in registers (the accumulators are dead
  // then) when it fits: 33 entries a thread cover topk 2048's buffer of 4160.
  static constexpr int kFinishRegisterEntries = 33;

  static_assert(kRowBytes % 64 == 0, "rows of whole 64-byte swizzle atoms");
  // 128-byte swizzle where a row holds one (bf16 D 64 or 128, e4m3 D 128), else 64-byte
  using SmemAtom = std::conditional_t<kRowBytes >= 128, decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{}),
                                      decltype(cute::GMMA::Layout_K_SW64_Atom<Element>{})>;
  // sQ: (a warpgroup's rows x heads, D, warpgroup, stage); sK: (keys, D, stage)
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kWgN>, cute::Int<kHeadDim>, cute::Int<kScoreWarpgroups>, cute::Int<kStagesQ>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDim>, cute::Int<kStagesK>>{}));
  // I^T (keys, a warpgroup's rows x heads) = K Q^T
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockKeys>, cute::Int<kWgN>, cute::Int<kHeadDim>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));
};

}  // namespace dsaib::hopper
