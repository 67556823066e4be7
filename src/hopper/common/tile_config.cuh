// Tile choices of the sm_90a indexer backward, away from the kernel body.
//
// One task = one query row and one group of up to kHeadTile heads. A task walks
// the row's VALID selected keys (compacted by the producer) in blocks of
// kBlockKeys, and per block runs:
//   GEMM1  S   (heads x keys) = Q (heads x D) . K_blk^T        wgmma RS: Q from registers / K-major
//   GEMM2  dK  (keys x D)     = A^T (keys x heads) . Q          wgmma SS, K-major / MN-major
//   GEMM3  dQ (heads x D)    += A (heads x keys) . K_blk        wgmma RS: A from registers / MN-major
// H < 64 is zero-padded to 64 in shared memory (never read from global);
// H > 64 becomes several tasks per row.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <type_traits>

namespace dsaib::hopper {

template <int kHeadDim_, bool kSplitA_, bool kL2KeepDk_ = false, bool kFixedPointDk_ = false>
struct TileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  // The scatter role's dK reds carry an L2 evict_last policy for part of the
  // lines (l2_policy.cuh); launched when dK and K outgrow the L2 (l2_hints.hpp).
  // Instantiated for the one-term kernels only (launch.hpp).
  static constexpr bool kL2KeepDk = kL2KeepDk_;
  // The deterministic d_index_k (options.deterministic): the scatter role adds
  // int64 fixed-point terms instead of fp32 values (fixed_point_dk.cuh). Not
  // combined with the L2 hint (launch.hpp).
  static constexpr bool kFixedPointDk = kFixedPointDk_;
  static_assert(!(kL2KeepDk_ && kFixedPointDk_), "the deterministic kernels have no L2-hinted variant");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "D must be 64 or 128");

  static constexpr int kBlockKeys = 64;  // keys per gathered block
  static constexpr int kHeadTile = 64;   // heads per task (wgmma M)
  // Gathered-K pipeline depth. 6: -6.5 [-8.2, -4.7] causal, -8.0 [-10.1, -6.0]
  // random ns/row at S 16384 against 4 (5 pairs on the H200). Every
  // instantiation still fits the 227 KiB opt-in (static_assert in
  // shared_storage.cuh).
  // The split-A D=128 kernel stages dK for the scatter role in two buffers
  // and its sA holds two terms: 5 K stages are what fit in 227 KiB there.
  static constexpr int kStagesK = (kSplitA_ && kHeadDim_ == 128) ? 5 : 6;
  static constexpr int kStagesQ = 2;     // per-task Q/w pipeline depth

  // Four roles, one warpgroup each (indexer_backward_kernel.cuh): producer
  // (gather), score MMA (GEMM1, dW, A, GEMM3 -> dQ), dK MMA (GEMM2 -> dK,
  // staging) and scatter (dK reds). The score and dK roles are one consumer
  // warpgroup split in two: its chain (GEMM1, A, GEMM2, dK staging, GEMM3) was
  // the bound (wait-time probe, ncu source view); the split took -2.5% to -3%
  // at S 16384 (one A term, 3 pairs).
  static constexpr int kThreadsPerWarpgroup = 128;
  static constexpr int kProducerThreads = kThreadsPerWarpgroup;
  static constexpr int kScoreThreads = kThreadsPerWarpgroup;
  static constexpr int kDkThreads = kThreadsPerWarpgroup;
  // Scatter role: the dK scatter-add from double-buffered staging, so the reds
  // leave continuously instead of in an MMA role's chain (-13 to -15% against
  // reds issued by the consumer, at S 4096 and 16384, both id patterns). Two
  // buffers: a third measured no change.
  static constexpr int kScatterThreads = kThreadsPerWarpgroup;
  static constexpr int kDkBuffers = 2;
  // Warpgroup index of each role (the kernel's role split).
  static constexpr int kProducerWarpgroup = 0;
  static constexpr int kScoreWarpgroup = 1;
  static constexpr int kDkWarpgroup = 2;
  static constexpr int kScatterWarpgroup = 3;
  static constexpr int kThreads = kProducerThreads + kScoreThreads + kDkThreads + kScatterThreads;
  // Stage 1 walks a row in chunks of kSlotChunk slots, kSlotsPerThread slots
  // per producer thread (strided by kProducerThreads: coalesced warp loads),
  // loads batched before use.
  static constexpr int kSlotsPerThread = 8;
  static constexpr int kSlotChunk = kProducerThreads * kSlotsPerThread;
  // setmaxnreg budgets. The CTA starts with kEntryRegisters per thread (ptxas's
  // limit for 512 threads, __launch_bounds__(512, 1)), and setmaxnreg.inc only
  // takes what the other warpgroups gave back with setmaxnreg.dec: the four
  // budgets must sum to exactly 4 * kEntryRegisters, or the raising warpgroup
  // waits forever (CUTLASS issue 2007). The score role holds S (32 fp32), dQ
  // (64 at D=128) and the A fragments (16 per term); the dK role holds dK (64 at
  // D=128); the scatter role kSteps float4 values and key rows. ptxas -v with
  // -warn-spills -Werror and cmake/ptxas_gate.sh (serialised wgmma) check that
  // each role fits its budget.
  static constexpr int kEntryRegisters = 128;
  // Since GEMM1 takes Q from registers the score role also holds Q (32 at
  // D=128) for the whole task: its SASS reaches R174 of 184 (one term) and R189
  // of 192 (split A, D=128), so the split kernel has no room left there.
  static constexpr int kProducerRegisters = 112;
  static constexpr int kScoreRegisters = kSplitA_ ? 192 : 184;
  static constexpr int kDkRegisters = 104;
  static constexpr int kScatterRegisters = kSplitA_ ? 104 : 112;
  static_assert(kProducerRegisters + kScoreRegisters + kDkRegisters + kScatterRegisters == 4 * kEntryRegisters,
                "setmaxnreg.inc can only take the registers the other warpgroups released");
  static_assert(kThreads == 512 && kEntryRegisters == 65536 / 512 / 8 * 8,
                "four 128-thread warpgroups, ptxas's entry limit at 512 threads");

  // dK blocks leave the accumulator through a per-warp staging area in shared
  // memory (each warp's 16 key rows, padded by kDkStagePad floats), and every
  // lane issues float4 atomicAdd (red.global.add.v4.f32) on contiguous columns
  // of one key row: ~-16% against float4 reds straight from the
  // accumulator's fragments (16 rows of 32 B per warp instruction; the L2 adds
  // whole rows at ~3.5 TB/s, that pattern at ~2.2 TB/s). One bulk reduce per
  // staged row instead of the float4 reds took +21 ns/row at random ids.
  static constexpr int kDkStagePad = 8;

  // A = gs * w * sm_scale * [x > 0] is a wgmma operand, so it is bf16. One bf16
  // rounding of A alone gives ~1.7e-3 relative RMS in dQ and dK, over the 1e-3
  // budget of fp32 outputs. With kSplitA, A = A_hi + A_lo (two bf16 terms, error
  // ~2^-16) and GEMM2/GEMM3 run once per term: 5 GEMMs per block instead of 3.
  // Chosen per call (AOperandPrecision; automatic: split iff an fp32 dQ/dK output).
  static constexpr bool kSplitA = kSplitA_;
  static constexpr int kATerms = kSplitA ? 2 : 1;
  // The score role holds K stage j-1 until GEMM1 of block j completes, while
  // it waits for block j, which the producer commits only after acquiring
  // block j+1 (deferred commit, producer_gather.cuh): three stages, or the two
  // roles wait on each other.
  static_assert(kStagesK >= 3, "the score role holds one K stage while it waits for the next, deferred one");

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
  // double-buffered across blocks (kABuffers): the score role writes block
  // j+1's A while the dK role's GEMM2 still reads block j's (a_full / a_empty,
  // shared_storage.cuh).
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
  // GEMM1 takes Q from registers (wgmma RS), loaded once per task with
  // ldmatrix, so it reads no sQ per block (16 KiB per block at D 128): -1.6 to
  // -3.1% at S 4096 to 65536, except ~0 at random S 65536.
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kHeadTile>, cute::Int<kBlockKeys>, cute::Int<kHeadDim>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>()));
  using TiledMmaDK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDim>, cute::Int<kHeadTile>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  // GEMM3 takes A from registers (wgmma RS; -0.5 to -1.2% at S 16384 / 65536):
  // A (heads x keys) is computed in the GEMM1 accumulator's layout, which is the
  // 16-bit wgmma A fragment over the same keys (FA3 feeds P to P.V so); GEMM3
  // reads no sA.
  using TiledMmaDQ = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kHeadTile>, cute::Int<kHeadDim>, cute::Int<kBlockKeys>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
};

/// The P-free backward (IndexerInputs::row_lse / row_target_mass instead of
/// index_score): a TileConfig whose score role rebuilds P_i = exp(z_i - LSE) from
/// its own GEMM1 (z sums over the task's heads, so only for H <= kHeadTile) and
/// forms gs there; the producer hands it -c * max(T, eps) per gathered key and
/// the row's LSE and G = -c * mass per task (PFreeStorage, shared_storage.cuh).
/// A distinct type, so the kernels of the P form keep their names and code.
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

/// The loss and its gradients in one kernel (loss_and_grad_kernel.cuh): the
/// P-free backward of Base whose CTA also runs the loss forward's pass over its
/// next row. Its producer gathers the blocks of two rows in turn, the backward
/// blocks of row r and the forward blocks of the CTA's next row r', into two
/// rings of K stages; the score role runs the backward blocks as
/// PFreeConfig's, and the dK role, after each GEMM2, one forward block: GEMM1 with keys as M and heads as N
/// (TiledMmaForwardS, the loss forward's, forward_kernel.cuh), the head sum
/// and the row statistics. r''s LSE and target mass come out of its forward
/// pass before its backward pass starts, one step of rows later. One A term
/// only (the one-term kernels' shared memory has room for the second slot list).
template <class Base>
struct LossAndGradConfig : PFreeConfig<Base> {
  static_assert(!Base::kSplitA && !Base::kL2KeepDk && !Base::kFixedPointDk,
                "the loss-and-gradient kernel is the one-term P-free kernel");
  static constexpr bool kFusesForward = true;
  // Two rings of K stages: kStagesK for the backward blocks (the score role's,
  // as in the other kernels) and kForwardStages for the forward blocks (the dK
  // role's), stages kStagesK.. of the same buffer. Five in all, not six: the
  // forward row's compacted slot list (12 KiB at kSlotChunk 1024) takes the
  // sixth stage's place in the 227 KiB.
  static constexpr int kStagesK = 3;
  static constexpr int kForwardStages = 2;
  using Element = typename Base::Element;
  using SmemLayoutK = decltype(cute::tile_to_shape(
      typename Base::SmemAtom{},
      cute::Shape<cute::Int<Base::kBlockKeys>, cute::Int<Base::kHeadDim>, cute::Int<kStagesK + kForwardStages>>{}));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_layout(cute::Shape<cute::Int<Base::kHeadDim>, cute::Int<Base::kBlockKeys>, cute::Int<kStagesK + kForwardStages>>{},
                                       cute::Stride<cute::Int<Base::kBlockKeys>, cute::_1, cute::Int<Base::kBlockKeys * Base::kHeadDim>>{})));
  // The score role waits for its row's statistics (stats_full) besides the
  // P-free kernel's work: at 184 registers it spilled at D 128. The producer
  // holds both rows' passes: at 112 it spilled at D 64, where the score role
  // (dQ 32 fp32) has room. The scatter role takes the split kernels' budget.
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

/// The forward blocks' K stages of a LossAndGradConfig (1 for the other configs,
/// which have none: the size of an unused pipeline).
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
