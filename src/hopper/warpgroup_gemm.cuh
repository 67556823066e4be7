// One warpgroup GEMM (wgmma, SS operands) over all k-blocks of its operands,
// used by both MMA roles (score_mma.cuh, dk_mma.cuh).
#pragma once

#include <cute/tensor.hpp>

namespace dsaib::hopper {

/// Issues one warpgroup GEMM over all k-blocks of the operands as one wgmma
/// commit group (async; the caller waits with warpgroup_wait). kZeroInit: the
/// first k-block overwrites the accumulator instead of adding to it.
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

}  // namespace dsaib::hopper
