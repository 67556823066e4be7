// Template bodies of indexer_backward_grid and launch_indexer_backward, included by
// the per-D instantiation files.
#pragma once

#include "hopper/cuda_check.hpp"
#include "hopper/indexer_backward_kernel.cuh"
#include "hopper/launch.hpp"

namespace dsaib::hopper {

template <int kHeadDim, bool kSplitA>
int indexer_backward_smem_bytes() {
  return shared_storage_bytes<TileConfig<kHeadDim, kSplitA>>();
}

template <int kHeadDim, bool kSplitA, bool kL2KeepDk, bool kFixedPointDk>
int64_t indexer_backward_grid(int64_t num_tasks) {
  static_assert(!(kSplitA && kL2KeepDk), "the L2-hinted kernels are the one-term ones (launch.hpp)");
  using Config = TileConfig<kHeadDim, kSplitA, kL2KeepDk, kFixedPointDk>;
  if (num_tasks <= 0) return 0;
  const int smem = indexer_backward_smem_bytes<kHeadDim, kSplitA>();
  auto kernel = indexer_backward_kernel<Config>;
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(indexer_backward_kernel)");
  int device = 0, sms = 0, blocks_per_sm = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, Config::kThreads, smem),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  if (blocks_per_sm < 1) {
    throw Error(ErrorCode::cuda_error, "indexer_backward_kernel",
                "indexer_backward_kernel: expected at least one resident CTA per SM, got 0 (shared memory " +
                    std::to_string(smem) + " bytes)");
  }
  return std::min<int64_t>(num_tasks, static_cast<int64_t>(sms) * blocks_per_sm);
}

template <int kHeadDim, bool kSplitA, bool kL2KeepDk, bool kFixedPointDk>
void launch_indexer_backward(const IndexerBackwardParams& params, int64_t grid, cudaStream_t stream) {
  static_assert(!(kSplitA && kL2KeepDk), "the L2-hinted kernels are the one-term ones (launch.hpp)");
  using Config = TileConfig<kHeadDim, kSplitA, kL2KeepDk, kFixedPointDk>;
  if (grid <= 0) return;  // indexer_backward_grid gives 0 for 0 tasks
  const int smem = indexer_backward_smem_bytes<kHeadDim, kSplitA>();
  indexer_backward_kernel<Config><<<static_cast<unsigned>(grid), Config::kThreads, smem, stream>>>(params);
  cuda_check_launch("indexer_backward_kernel");
}

}  // namespace dsaib::hopper

/// The explicit instantiations of one head dim (instantiate_d64.cu, instantiate_d128.cu:
/// one translation unit per D, compiled in parallel): the grid and the launch of the
/// two-term, the one-term and the L2-hinted one-term kernel, and the shared-memory size.
#define DSAIB_INSTANTIATE_INDEXER_BACKWARD(D)                                                                  \
  namespace dsaib::hopper {                                                                                   \
  template int64_t indexer_backward_grid<D, true>(int64_t);                                                   \
  template void launch_indexer_backward<D, true>(const IndexerBackwardParams&, int64_t, cudaStream_t);        \
  template int64_t indexer_backward_grid<D, false>(int64_t);                                                  \
  template void launch_indexer_backward<D, false>(const IndexerBackwardParams&, int64_t, cudaStream_t);       \
  template int64_t indexer_backward_grid<D, false, true>(int64_t);                                            \
  template void launch_indexer_backward<D, false, true>(const IndexerBackwardParams&, int64_t, cudaStream_t); \
  template int indexer_backward_smem_bytes<D, true>();                                                        \
  template int indexer_backward_smem_bytes<D, false>();                                                       \
  }

/// The deterministic kernels of one head dim (instantiate_fixed_point_dk.cu): two-term
/// and one-term, each with the fixed-point dK (TileConfig::kFixedPointDk).
#define DSAIB_INSTANTIATE_INDEXER_BACKWARD_FIXED_POINT_DK(D)                                                   \
  namespace dsaib::hopper {                                                                                   \
  template int64_t indexer_backward_grid<D, true, false, true>(int64_t);                                      \
  template void launch_indexer_backward<D, true, false, true>(const IndexerBackwardParams&, int64_t,          \
                                                              cudaStream_t);                                  \
  template int64_t indexer_backward_grid<D, false, false, true>(int64_t);                                     \
  template void launch_indexer_backward<D, false, false, true>(const IndexerBackwardParams&, int64_t,         \
                                                               cudaStream_t);                                 \
  }
