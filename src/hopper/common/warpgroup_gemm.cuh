// Warpgroup GEMMs (wgmma) over all k-blocks of their operands.
#pragma once

#include <cute/tensor.hpp>

namespace dsaib::hopper {

/// One wgmma commit group over all k-blocks (the caller waits with
/// warpgroup_wait); kZeroInit: the first k-block overwrites the accumulator.
template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, const TA& tA, const TB& tB, TC& tC) {
  cute::warpgroup_fence_operand(tC);
  cute::warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < cute::size<2>(tA); ++kb) {
    cute::gemm(mma, tA(cute::_, cute::_, kb), tB(cute::_, cute::_, kb), tC);
    mma.accumulate_ = cute::GMMA::ScaleOut::One;
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_fence_operand(tC);
}

/// With A in registers (wgmma RS), fenced so that the compiler neither moves its
/// writes past the issue nor reuses its registers before the caller's wait.
template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm_rs(TiledMma& mma, TA& tA, const TB& tB, TC& tC) {
  cute::warpgroup_fence_operand(tA);
  warpgroup_gemm<kZeroInit>(mma, tA, tB, tC);
  cute::warpgroup_fence_operand(tA);
}

/// The wgmma accumulator layout ((2, 2, N/8), M, N') as the A-operand register
/// layout of a 16-bit wgmma whose K is that N: ((2, 2, 2), M, N/16) (FA3's
/// convert_layout_acc_Aregs for SM90 and 16-bit A).
template <class Layout>
__device__ __forceinline__ auto acc_layout_as_a_operand(Layout acc) {
  using namespace cute;
  static_assert(decltype(rank<0>(acc))::value == 3 && decltype(size<0, 0>(acc))::value == 2 &&
                    decltype(size<0, 1>(acc))::value == 2,
                "an SM90 wgmma accumulator layout");
  static_assert(decltype(size<2>(acc))::value == 1,
                "one N tile: with several, the k-block order would have to be (N/16, N')");
  auto l = logical_divide(get<0, 2>(acc), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(l)), get<1>(acc),
                     coalesce(make_layout(get<2>(acc), get<0, 1>(l))));
}

}  // namespace dsaib::hopper
