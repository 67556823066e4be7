// Tile choices of the sm_90a top-k forward (indexer_topk_kernel.cuh).
//
// One task is kRows consecutive query rows with all their heads, padded to
// kHeadTile, so that rows x heads fill one wgmma N of 256: each K tile that the
// producer loads serves kRows rows (at H 64, four), which keeps the tile loads
// far below the L2's bandwidth. Keys are wgmma's M (64 per tile), as in the loss
// forward, so a key's heads lie in one thread and its quad and the weighted
// head sum needs two shuffles.
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
  static constexpr int kN = 256;                  // rows x heads: one wgmma N
  static constexpr int kRows = kN / kHeadTile;    // query rows per task: 8, 4 or 2
  static constexpr int kBlockKeys = 64;           // keys per K tile: one wgmma M
  // Two Q stages (the next task's rows load under this one's tiles) and as many
  // K stages as the rest of the 227 KiB holds.
  static constexpr int kStagesQ = 2;
  static constexpr int kStagesK = kRowBytes >= 256 ? 4 : 8;
  // Tile g goes to score warpgroup g % 2 and to K stage g % kStagesK, g counted
  // over all of a CTA's tasks: with an even kStagesK every stage has one
  // consumer, which takes its uses in order, so no wait is ever more than one
  // phase ahead of the stage's barrier (a parity wait cannot tell phase k from k + 2).
  static_assert(kStagesK % 2 == 0, "each K stage belongs to one score warpgroup");

  static constexpr int kThreadsPerWarpgroup = 128;
  static constexpr int kProducerThreads = kThreadsPerWarpgroup;
  // Two score warpgroups take a task's K tiles alternately: one's head sum and
  // selection run under the other's GEMM.
  static constexpr int kScoreWarpgroups = 2;
  static constexpr int kScoreThreads = kScoreWarpgroups * kThreadsPerWarpgroup;
  static constexpr int kProducerWarpgroup = 0;
  static constexpr int kThreads = kProducerThreads + kScoreThreads;
  // setmaxnreg: every warpgroup starts at ptxas's limit for 384 threads; the
  // producer (64-bit row offsets of strided views) keeps 104 without a spill,
  // and the score warpgroups take the rest (a 64 x 256 fp32 accumulator is 128
  // registers a thread).
  static constexpr int kEntryRegisters = 65536 / kThreads / 8 * 8;  // 168
  static constexpr int kProducerRegisters = 104;
  static constexpr int kScoreRegisters = 200;
  static_assert(kProducerRegisters + kScoreWarpgroups * kScoreRegisters <= 3 * kEntryRegisters,
                "setmaxnreg.inc can only take the registers the producer released");
  // The producer keeps this many K tiles' copies in flight before it waits.
  static constexpr int kCopiesInFlight = kStagesK - 1;
  // A selection pass over a row's candidates (global memory) loads this many
  // entries per thread before it uses the first.
  static constexpr int kSelectBatch = 8;

  static_assert(kRowBytes % 64 == 0, "rows of whole 64-byte swizzle atoms");
  // 128-byte swizzle where a row holds one (bf16 D 64 or 128, e4m3 D 128), else 64-byte
  using SmemAtom = std::conditional_t<kRowBytes >= 128, decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{}),
                                      decltype(cute::GMMA::Layout_K_SW64_Atom<Element>{})>;
  // sQ: (rows x heads, D, stage); sK: (keys, D, stage)
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kN>, cute::Int<kHeadDim>, cute::Int<kStagesQ>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDim>, cute::Int<kStagesK>>{}));
  // I^T (keys, rows x heads) = K Q^T
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockKeys>, cute::Int<kN>, cute::Int<kHeadDim>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));
};

}  // namespace dsaib::hopper
