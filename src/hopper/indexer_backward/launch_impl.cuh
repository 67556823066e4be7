// Template bodies of indexer_backward_ctas_per_sm and launch_indexer_backward, included by
// the per-D instantiation files.
#pragma once

#include "hopper/common/cuda_check.hpp"
#include "hopper/indexer_backward/indexer_backward_kernel.cuh"
#include "hopper/indexer_backward/launch.hpp"

namespace dsaib::hopper {

template <int kHeadDim, bool kSplitA>
int indexer_backward_smem_bytes() {
  return shared_storage_bytes<TileConfig<kHeadDim, kSplitA>>();
}

/// Resident CTAs per SM of indexer_backward_kernel<Config> (which also gets its
/// dynamic shared memory attribute set); at least one, else cuda_error.
template <class Config>
int ctas_per_sm_of() {
  return resident_ctas_per_sm(indexer_backward_kernel<Config>, Config::kThreads, shared_storage_bytes<Config>(),
                              "indexer_backward_kernel");
}

/// indexer_backward_kernel<Config> over `grid` persistent CTAs (none for grid 0),
/// with the dynamic shared memory of SmemConfig's storage.
template <class Config, class SmemConfig = Config>
void launch_kernel_of(const IndexerParams& params, int64_t grid, cudaStream_t stream) {
  if (grid <= 0) return;  // no tasks
  const int smem = shared_storage_bytes<SmemConfig>();
  auto kernel = indexer_backward_kernel<Config>;
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(indexer_backward_kernel)");
  kernel<<<static_cast<unsigned>(grid), Config::kThreads, smem, stream>>>(params);
  cuda_check_launch("indexer_backward_kernel");
}

template <int kHeadDim, bool kSplitA>
int indexer_backward_ctas_per_sm() {  // the shared memory of indexer_backward_smem_bytes<kHeadDim, kSplitA>()
  return ctas_per_sm_of<TileConfig<kHeadDim, kSplitA>>();
}

template <int kHeadDim, bool kSplitA, bool kL2KeepDk, bool kFixedPointDk>
void launch_indexer_backward(const IndexerParams& params, int64_t grid, cudaStream_t stream) {
  static_assert(!(kSplitA && kL2KeepDk), "the L2-hinted kernels are the one-term ones (launch.hpp)");
  launch_kernel_of<TileConfig<kHeadDim, kSplitA, kL2KeepDk, kFixedPointDk>, TileConfig<kHeadDim, kSplitA>>(
      params, grid, stream);
}

template <int kHeadDim, bool kSplitA>
int indexer_backward_p_free_ctas_per_sm() {
  return ctas_per_sm_of<PFreeConfig<TileConfig<kHeadDim, kSplitA>>>();
}

template <int kHeadDim, bool kSplitA>
void launch_indexer_backward_p_free(const IndexerParams& params, int64_t grid, cudaStream_t stream) {
  launch_kernel_of<PFreeConfig<TileConfig<kHeadDim, kSplitA>>>(params, grid, stream);
}

}  // namespace dsaib::hopper

/// The P-free kernels of one head dim (instantiate_p_free_d*.cu): one and two a terms.
#define DSAIB_INSTANTIATE_INDEXER_BACKWARD_P_FREE(D)                                                             \
  namespace dsaib::hopper {                                                                                          \
  template void launch_indexer_backward_p_free<D, true>(const IndexerParams&, int64_t, cudaStream_t);  \
  template void launch_indexer_backward_p_free<D, false>(const IndexerParams&, int64_t, cudaStream_t); \
  template int indexer_backward_p_free_ctas_per_sm<D, true>();                                                 \
  template int indexer_backward_p_free_ctas_per_sm<D, false>();                                                \
  }

/// The explicit instantiations of one head dim (instantiate_d64.cu, instantiate_d128.cu:
/// one translation unit per D, compiled in parallel): the launch of the two-term,
/// the one-term and the L2-hinted one-term kernel, the occupancy query and the
/// shared-memory size.
#define DSAIB_INSTANTIATE_INDEXER_BACKWARD(D)                                                                  \
  namespace dsaib::hopper {                                                                                   \
  template void launch_indexer_backward<D, true>(const IndexerParams&, int64_t, cudaStream_t);        \
  template void launch_indexer_backward<D, false>(const IndexerParams&, int64_t, cudaStream_t);       \
  template void launch_indexer_backward<D, false, true>(const IndexerParams&, int64_t, cudaStream_t); \
  template int indexer_backward_ctas_per_sm<D, true>();                                                       \
  template int indexer_backward_ctas_per_sm<D, false>();                                                      \
  template int indexer_backward_smem_bytes<D, true>();                                                        \
  template int indexer_backward_smem_bytes<D, false>();                                                       \
  }

/// The deterministic kernels of one head dim (instantiate_fixed_point_dk.cu): two-term
/// and one-term, each with the fixed-point dK (TileConfig::kFixedPointDk).
#define DSAIB_INSTANTIATE_INDEXER_BACKWARD_FIXED_POINT_DK(D)                                                   \
  namespace dsaib::hopper {                                                                                   \
  template void launch_indexer_backward<D, true, false, true>(const IndexerParams&, int64_t,          \
                                                              cudaStream_t);                                  \
  template void launch_indexer_backward<D, false, false, true>(const IndexerParams&, int64_t,         \
                                                               cudaStream_t);                                 \
  }
