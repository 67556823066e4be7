// Tile choices of the sm_90a indexer backward, away from the kernel body.
//
// One task = one query row and one group of up to kHeadTile heads. A task walks
// the row's VALID selected keys (compacted by the producer) in blocks of
// kBlockKeys, and per block runs:
//   GEMM1  S   (heads x keys) = Q (heads x D) . K_blk^T        wgmma SS, K-major / K-major
//   GEMM2  dK  (keys x D)     = A^T (keys x heads) . Q          wgmma SS, K-major / MN-major
//   GEMM3  dQ (heads x D)    += A (heads x keys) . K_blk        wgmma SS, MN-major / MN-major
// H < 64 is zero-padded to 64 in shared memory (never read from global);
// H > 64 becomes several tasks per row.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace dsaib::hopper {

template <int kHeadDim_, bool kSplitA_>
struct TileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "D must be 64 or 128");

  static constexpr int kBlockKeys = 64;  // keys per gathered block
  static constexpr int kHeadTile = 64;   // heads per task (wgmma M)
  // Gathered-K pipeline depth. 6 (perf-log, fifth session): -6.5 [-8.2, -4.7]
  // causal, -8.0 [-10.1, -6.0] random ns/row at S 16384 against 4 (5 pairs);
  // -2% on v11 before. Every instantiation still fits the 227 KiB opt-in
  // (static_assert in shared_storage.cuh).
  // The split-A D=128 kernel (v24) stages dK for the scatter role in two buffers
  // and its sA holds two terms: 5 K stages are what fit in 227 KiB there.
  static constexpr int kStagesK = (kSplitA_ && kHeadDim_ == 128) ? 5 : 6;
  static constexpr int kStagesQ = 2;     // per-task Q/w pipeline depth

  static constexpr int kProducerWarpgroups = 1;
  static constexpr int kConsumerWarpgroups = 1;
  // Scatter role (perf-log v16): a third warpgroup does the dK scatter-add from
  // double-buffered staging, so the reds leave continuously instead of in the
  // consumer's chain (-13 to -15% against v11 at S 4096 and 16384, both id
  // patterns). Since v24 every kernel has it: the split (A_lo) kernel at D=128
  // raises its consumer's limit with setmaxnreg (below; -15% against its
  // two-role layout, perf-log v24). Two buffers: a third measured no change
  // (perf-log).
  static constexpr int kScatterWarpgroups = 1;
  static constexpr int kScatterThreads = kScatterWarpgroups * 128;
  static constexpr int kDkBuffers = 2;
  static constexpr int kThreadsPerWarpgroup = 128;
  static constexpr int kProducerThreads = kProducerWarpgroups * kThreadsPerWarpgroup;
  // Stage 1 walks a row in chunks of kSlotChunk slots, kSlotsPerThread slots
  // per producer thread (strided by kProducerThreads: coalesced warp loads),
  // loads batched before use.
  static constexpr int kSlotsPerThread = 8;
  static constexpr int kSlotChunk = kProducerThreads * kSlotsPerThread;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * kThreadsPerWarpgroup;
  static constexpr int kThreads = (kProducerWarpgroups + kConsumerWarpgroups + kScatterWarpgroups) * kThreadsPerWarpgroup;
  // setmaxnreg budgets. The CTA starts with kEntryRegisters per thread (ptxas's
  // limit for 384 threads, __launch_bounds__(384, 1)), and setmaxnreg.inc only takes
  // what the other warpgroups gave back with setmaxnreg.dec: producer + consumer +
  // scatter <= 3 * kEntryRegisters, or the raising warpgroup waits forever (CUTLASS
  // issue 2007). The producer lowers to 128. The split-A consumers (5 GEMMs per
  // block, two A terms, GEMM1 one block ahead) raise to 232 and their scatter
  // role lowers to 144 (v24 at D=128, v26 at D=64; SASS: up to R213 at D=128,
  // R176 at D=64; ptxas -v: no spill, no wgmma serialisation; the build fails on
  // either, cmake/ptxas_gate.sh); the one-term kernels' consumer and scatter
  // role keep the 168 they start with.
  static constexpr int kEntryRegisters = 168;
  static constexpr int kProducerRegisters = 128;
  static constexpr bool kRaisedConsumer = kSplitA_;
  static constexpr int kScatterRegisters = kRaisedConsumer ? 144 : kEntryRegisters;
  static constexpr int kConsumerRegisters = kRaisedConsumer ? 232 : kEntryRegisters;
  // One warpgroup per role. A kernel that raises a limit must give back exactly
  // what it takes (CUTLASS issue 2007: a hang with a sum below the entry total);
  // one that does not may only lower.
  static_assert(kConsumerRegisters <= kEntryRegisters
                    ? kProducerRegisters + kConsumerRegisters + kScatterRegisters <= 3 * kEntryRegisters
                    : kProducerRegisters + kConsumerRegisters + kScatterRegisters == 3 * kEntryRegisters,
                "setmaxnreg.inc can only take the registers the other warpgroups released");
  static_assert(kThreads == 384 && kEntryRegisters == 65536 / 384 / 8 * 8,
                "three 128-thread warpgroups, ptxas's entry limit at 384 threads");

  // dK blocks leave the accumulator through a per-warp staging area in shared
  // memory (each warp's 16 key rows, padded by kDkStagePad floats), and every
  // lane issues float4 atomicAdd (red.global.add.v4.f32) on contiguous columns
  // of one key row. (perf-log: v3 bulk reduce per row, v4 float4 red straight
  // from registers, v10 staged rows; v10 kept.)
  static constexpr int kDkStagePad = 8;

  // A = gs * w * sm_scale * [x > 0] is a wgmma operand, so it is bf16. One bf16
  // rounding of A alone gives ~1.7e-3 relative RMS in dQ and dK, over the 1e-3
  // budget of fp32 outputs. With kSplitA, A = A_hi + A_lo (two bf16 terms, error
  // ~2^-16) and GEMM2/GEMM3 run once per term: 5 GEMMs per block instead of 3.
  // Chosen per call (AOperandPrecision; automatic: split iff an fp32 dQ/dK output).
  static constexpr bool kSplitA = kSplitA_;
  static constexpr int kATerms = kSplitA ? 2 : 1;
  // GEMM1 one block ahead (consumer_mma.cuh): GEMM1 of block j+1 is issued
  // after GEMM2/3 of block j and overlaps block j's dK staging. Split kernels
  // only (v26, perf-log tenth session, S 16384, 3 pairs, against v24): D=128
  // -5.0% causal / -7.7% random, D=64 -7.7% / -7.9%. In the one-term kernels the
  // same loop cost +3.5% / +4.1% (v25) and +3.3% / +3.8% with their scatter
  // role kept at 168 (v26x).
  static constexpr bool kGemm1Ahead = kSplitA;
  // The consumer then holds K block j while it waits for block j+1, which the
  // producer commits only after acquiring block j+2 (deferred commit,
  // producer_gather.cuh): three stages, or the two roles wait on each other.
  static_assert(!kGemm1Ahead || kStagesK >= 3, "GEMM1 one block ahead needs at least 3 K stages");

  using Element = cutlass::bfloat16_t;

  // Shared-memory layouts (128-byte swizzle, K-major atoms of 8 x 64 bf16).
  using SmemAtom = decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{});
  // sQ: (heads, D, stage)
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kHeadTile>, cute::Int<kHeadDim>, cute::Int<kStagesQ>>{}));
  // sK: (keys, D, stage)
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDim>, cute::Int<kStagesK>>{}));
  // sA: (keys, heads, term, buf), heads contiguous; term 0 = A_hi, 1 = A_lo;
  // double-buffered across blocks (kABuffers) so that no barrier is needed
  // between a block's GEMM2/3 and the next block's A stores.
  static constexpr int kABuffers = 2;
  using SmemLayoutA = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadTile>, cute::Int<kATerms>, cute::Int<kABuffers>>{}));
  // Transposed views of the same bytes.
  // sQt: (D, heads, stage)
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kHeadTile>, cute::Int<kStagesQ>>{},
                                       cute::Stride<cute::Int<kHeadTile>, cute::_1, cute::Int<kHeadTile * kHeadDim>>{})));
  // sKt: (D, keys, stage)
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockKeys>, cute::Int<kStagesK>>{},
                                       cute::Stride<cute::Int<kBlockKeys>, cute::_1, cute::Int<kBlockKeys * kHeadDim>>{})));
  // sAt: (heads, keys, term, buf)
  using SmemLayoutAt = decltype(cute::composition(
      SmemLayoutA{}, cute::make_layout(cute::Shape<cute::Int<kHeadTile>, cute::Int<kBlockKeys>, cute::Int<kATerms>, cute::Int<kABuffers>>{},
                                       cute::Stride<cute::Int<kBlockKeys>, cute::_1, cute::Int<kBlockKeys * kHeadTile>,
                                                    cute::Int<kBlockKeys * kHeadTile * kATerms>>{})));

  // Tiled MMAs, one warpgroup each.
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kHeadTile>, cute::Int<kBlockKeys>, cute::Int<kHeadDim>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));
  using TiledMmaDK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDim>, cute::Int<kHeadTile>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  using TiledMmaDQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kHeadTile>, cute::Int<kHeadDim>, cute::Int<kBlockKeys>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>()));
};

}  // namespace dsaib::hopper
