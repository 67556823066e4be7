// Tile choices of the sm_90a indexer backward. A task (one query row, up to
// kHeadTile heads) walks the row's valid keys in blocks of kBlockKeys, each
// through GEMM1 S = Q K^T, GEMM2 dK = A^T Q and GEMM3 dQ += A K
// (docs/hopper-kernel.md §3).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <type_traits>

namespace dsaib::hopper {

template <int kHeadDim_, bool kSplitA_, bool kL2KeepDk_ = false, bool kFixedPointDk_ = false>
struct TileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  // The scatter role's dK reds carry an L2 evict_last policy (l2_policy.cuh).
  static constexpr bool kL2KeepDk = kL2KeepDk_;
  // The deterministic d_index_k: int64 fixed-point reds (fixed_point_dk.cuh).
  static constexpr bool kFixedPointDk = kFixedPointDk_;
  static_assert(!(kL2KeepDk_ && kFixedPointDk_), "the deterministic kernels have no L2-hinted variant");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "D must be 64 or 128");

  static constexpr int kBlockKeys = 64;  // keys per gathered block
  static constexpr int kHeadTile = 64;   // heads per task (wgmma M)
  // K ring depth 6, faster than 4 or 5 (docs/design-decisions.md); 5 in the
  // split-A D=128 kernel, whose shared memory has no room for a sixth.
  static constexpr int kStagesK = (kSplitA_ && kHeadDim_ == 128) ? 5 : 6;
  static constexpr int kStagesQ = 2;     // per-task Q/w pipeline depth

  // Four roles, one warpgroup each: producer, score (GEMM1, dW, A, GEMM3), dK
  // (GEMM2, staging), scatter (dK reds). Two MMA roles overlap the GEMM chain
  // that one consumer warpgroup ran in series and that bound the kernel.
  static constexpr int kThreadsPerWarpgroup = 128;
  static constexpr int kProducerThreads = kThreadsPerWarpgroup;
  static constexpr int kScoreThreads = kThreadsPerWarpgroup;
  static constexpr int kDkThreads = kThreadsPerWarpgroup;
  // The scatter role issues every dK red from kDkBuffers staging buffers, so
  // the reds leave continuously instead of inside an MMA role's chain.
  static constexpr int kScatterThreads = kThreadsPerWarpgroup;
  static constexpr int kDkBuffers = 2;
  static constexpr int kProducerWarpgroup = 0;
  static constexpr int kScoreWarpgroup = 1;
  static constexpr int kDkWarpgroup = 2;
  static constexpr int kScatterWarpgroup = 3;
  static constexpr int kThreads = kProducerThreads + kScoreThreads + kDkThreads + kScatterThreads;
  // Stage 1 walks a row in chunks of kSlotChunk slots, kSlotsPerThread per
  // producer thread, strided by kProducerThreads (coalesced warp loads).
  static constexpr int kSlotsPerThread = 8;
  static constexpr int kSlotChunk = kProducerThreads * kSlotsPerThread;
  // setmaxnreg budgets (docs/hopper-kernel.md §8): every warpgroup starts at
  // kEntryRegisters (ptxas's limit at 512 threads) and .inc only takes what the
  // others released with .dec, so the four sum to 4 * kEntryRegisters or the
  // raising warpgroup waits forever. A spill fails the build.
  static constexpr int kEntryRegisters = 128;
  static constexpr int kProducerRegisters = 112;
  static constexpr int kScoreRegisters = kSplitA_ ? 192 : 184;
  static constexpr int kDkRegisters = 104;
  static constexpr int kScatterRegisters = kSplitA_ ? 104 : 112;
  static_assert(kProducerRegisters + kScoreRegisters + kDkRegisters + kScatterRegisters == 4 * kEntryRegisters,
                "setmaxnreg.inc can only take the registers the other warpgroups released");
  static_assert(kThreads == 512 && kEntryRegisters == 65536 / 512 / 8 * 8,
                "four 128-thread warpgroups, ptxas's entry limit at 512 threads");

  // dK leaves through shared staging rows padded by kDkStagePad floats (a
  // warp's float2 stores of 8 rows then hit distinct bank pairs), so that each
  // float4 red covers contiguous columns of one key row: the L2 adds whole rows
  // much faster than the accumulator fragments' 32 B of 16 rows.
  static constexpr int kDkStagePad = 8;

  // A is a bf16 wgmma operand; kSplitA: A = A_hi + A_lo, for fp32 outputs' accuracy.
  static constexpr bool kSplitA = kSplitA_;
  static constexpr int kATerms = kSplitA ? 2 : 1;
  // The score role holds stage j-1 while it waits for block j, which the
  // producer commits only after acquiring block j+1: with two stages the two
  // roles would wait on each other.
  static_assert(kStagesK >= 3, "the score role holds one K stage while it waits for the next, deferred one");

  using Element = cutlass::bfloat16_t;

  // Shared-memory layouts (128-byte swizzle atoms).
  using SmemAtom = decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{});
  // sQ: (heads, D, stage)
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kHeadTile>, cute::Int<kHeadDim>, cute::Int<kStagesQ>>{}));
  // sK: (keys, D, stage)
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDim>, cute::Int<kStagesK>>{}));
  // sA: (keys, heads, term, buf), heads contiguous; term 0 = A_hi, 1 = A_lo.
  // Two buffers: the score role writes block j+1's A while GEMM2 reads block j's.
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

  // Tiled MMAs, one warpgroup each. GEMM1 takes Q from registers (wgmma RS),
  // loaded once per task, so no block reads sQ again.
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kHeadTile>, cute::Int<kBlockKeys>, cute::Int<kHeadDim>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));
  using TiledMmaDK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDim>, cute::Int<kHeadTile>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  // GEMM3 takes A from registers (wgmma RS): the GEMM1 accumulator layout is
  // the 16-bit A fragment over the same keys, so GEMM3 reads no sA.
  using TiledMmaDQ = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kHeadTile>, cute::Int<kHeadDim>, cute::Int<kBlockKeys>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
};

/// The P-free backward (row_lse / row_target_mass instead of index_score): the
/// score role rebuilds P_i = exp(z_i - LSE) from its own GEMM1, so only for
/// H <= kHeadTile. A distinct type, so the P form's kernels keep their code.
template <class Base>
struct PFreeConfig : Base {
  static constexpr bool kPFree = true;
};

/// Whether a tile config is a PFreeConfig (false for every config without
/// the member, the loss forward's included).
template <class Config, class = void>
inline constexpr bool kIsPFree = false;
template <class Config>
inline constexpr bool kIsPFree<Config, std::void_t<decltype(Config::kPFree)>> = Config::kPFree;

/// Blocks of key copies a ProducerGather keeps in flight (producer_gather.cuh):
/// Config::kGatherBlocksInFlight where the config has it, else two.
template <class Config, class = void>
inline constexpr int kGatherBlocksInFlight = 2;
template <class Config>
inline constexpr int kGatherBlocksInFlight<Config, std::void_t<decltype(Config::kGatherBlocksInFlight)>> =
    Config::kGatherBlocksInFlight;

/// The loss and its gradients in one kernel (loss_and_grad_kernel.cuh): the
/// P-free backward of Base whose CTA also runs the loss forward's pass over its
/// next row, in the dK role. One A term only: the one-term kernels' shared
/// memory has room for the forward's slot list.
template <class Base>
struct LossAndGradConfig : PFreeConfig<Base> {
  static_assert(!Base::kSplitA && !Base::kL2KeepDk && !Base::kFixedPointDk,
                "the loss-and-gradient kernel is the one-term P-free kernel");
  static constexpr bool kFusesForward = true;
  // Two rings in one K buffer: kStagesK stages for the backward blocks, then
  // kForwardStages for the forward blocks. Five, not six: the forward's slot
  // list (12 KiB) takes the sixth stage's place.
  static constexpr int kStagesK = 3;
  static constexpr int kForwardStages = 2;
  using Element = typename Base::Element;
  using SmemLayoutK = decltype(cute::tile_to_shape(
      typename Base::SmemAtom{},
      cute::Shape<cute::Int<Base::kBlockKeys>, cute::Int<Base::kHeadDim>, cute::Int<kStagesK + kForwardStages>>{}));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_layout(cute::Shape<cute::Int<Base::kHeadDim>, cute::Int<Base::kBlockKeys>, cute::Int<kStagesK + kForwardStages>>{},
                                       cute::Stride<cute::Int<Base::kBlockKeys>, cute::_1, cute::Int<Base::kBlockKeys * Base::kHeadDim>>{})));
  // The score role spilled at 184 registers at D 128, the producer (two rows'
  // passes) at 112 at D 64, where the score role's dQ leaves room.
  static constexpr int kProducerRegisters = Base::kHeadDim == 64 ? 120 : 112;
  static constexpr int kScoreRegisters = Base::kHeadDim == 64 ? 184 : 192;
  static constexpr int kScatterRegisters = 104;
  static_assert(kProducerRegisters + kScoreRegisters + Base::kDkRegisters + kScatterRegisters ==
                    4 * Base::kEntryRegisters,
                "setmaxnreg.inc can only take the registers the other warpgroups released");
  // The forward pass's GEMM1: S^T (keys, heads) = K Q^T, both from shared memory.
  using TiledMmaForwardS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<Base::kBlockKeys>, cute::Int<Base::kHeadTile>, cute::Int<Base::kHeadDim>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));
};

/// The forward blocks' K stages of a LossAndGradConfig (1, unused, for the others).
template <class Config, class = void>
inline constexpr int kForwardStagesOf = 1;
template <class Config>
inline constexpr int kForwardStagesOf<Config, std::void_t<decltype(Config::kForwardStages)>> = Config::kForwardStages;

/// Whether a tile config is a LossAndGradConfig.
template <class Config, class = void>
inline constexpr bool kFusesForward = false;
template <class Config>
inline constexpr bool kFusesForward<Config, std::void_t<decltype(Config::kFusesForward)>> = Config::kFusesForward;

}  // namespace dsaib::hopper
