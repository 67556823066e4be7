// Tile choices of the sm_90a loss forward (kl_forward_kernel.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>


namespace dsaib::hopper {

template <int kHeadDim_, int kHeadTile_>
struct ForwardTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "D must be 64 or 128");
  static constexpr int kHeadTile = kHeadTile_;  // heads per task: every head of the row, padded
  static_assert(kHeadTile == 32 || kHeadTile == 64 || kHeadTile == 128, "GEMM1's wgmma N: 32, 64 or 128 heads");
  static constexpr int kBlockKeys = 64;  // keys per gathered block (the backward's)
  // Several CTAs per SM where they fit, so that one CTA's gathers and head sums
  // run under another's GEMMs: three at 32 and 64 heads (three K stages each;
  // at 64 heads one Q stage, so that three CTAs' shared memory fits an SM: the
  // next row's Q then loads once this row's last block is done); one at 128
  // heads, with eight K stages.
  static constexpr int kCtasPerSm = kHeadTile <= 64 ? 3 : 1;
  static constexpr int kStagesK = kCtasPerSm == 3 ? 3 : 8;
  static constexpr int kStagesQ = kHeadTile == 64 && kCtasPerSm == 3 ? 1 : 2;
  // Blocks of key copies in flight: a block is published once kGatherBlocksInFlight - 1
  // later ones are issued (the backward's producer: two in flight). Three where the
  // stages leave room: the consumer holds one stage while it waits for the next.
  static constexpr int kGatherBlocksInFlight = kStagesK >= 4 ? 3 : 2;
  static constexpr int kThreadsPerWarpgroup = 128;
  static constexpr int kProducerThreads = kThreadsPerWarpgroup;
  static constexpr int kScoreThreads = kThreadsPerWarpgroup;
  static constexpr int kProducerWarpgroup = 0;
  static constexpr int kScoreWarpgroup = 1;
  static constexpr int kThreads = kProducerThreads + kScoreThreads;
  // setmaxnreg where three CTAs share an SM: every warpgroup enters at ptxas's 80
  // registers a thread; the producer gives some to the score role (two fp32
  // accumulators and the row statistics). 0: no setmaxnreg.
  static constexpr int kEntryRegisters = 65536 / (kThreads * kCtasPerSm) / 8 * 8;
  static constexpr int kProducerRegisters = kCtasPerSm == 3 ? 64 : 0;
  static constexpr int kScoreRegisters = kCtasPerSm == 3 ? 96 : 0;
  static_assert(kProducerRegisters + kScoreRegisters <= 2 * kEntryRegisters,
                "setmaxnreg.inc can only take the registers the producer released");
  // the producer's slot chunks: the backward's 8; 2 where three CTAs share an
  // SM's shared memory
  static constexpr int kSlotsPerThread = kCtasPerSm == 3 ? 2 : 8;
  static constexpr int kSlotChunk = kProducerThreads * kSlotsPerThread;
  // Blocks are padded only at multiples of this many slots: the loss-and-gradient
  // kernel's chunk, so that both kernels give a row's keys to the same threads
  // and their row statistics are the same bits (producer_gather.cuh).
  static constexpr int kBlockPadSlots = 1024;
  static_assert(kBlockPadSlots % kSlotChunk == 0, "chunks tile the padding span");

  using Element = cutlass::bfloat16_t;
  using SmemAtom = decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{});
  // sQ: (heads, D, stage); sK: (keys, D, stage) — the backward's layouts
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kHeadTile>, cute::Int<kHeadDim>, cute::Int<kStagesQ>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDim>, cute::Int<kStagesK>>{}));
  // GEMM1 transposed against the backward's, S^T (keys, heads) = K Q^T: keys as M
  // put a key's heads in one thread and its quad, so the head sum needs two
  // shuffles and no exchange between warps.
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadTile>, cute::Int<kHeadDim>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));
};

}  // namespace dsaib::hopper
