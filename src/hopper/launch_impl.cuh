// Template body of launch_indexer_backward, included by the per-D instantiation files.
#pragma once

#include "hopper/cuda_check.hpp"
#include "hopper/indexer_backward_kernel.cuh"
#include "hopper/launch.hpp"
#include "hopper/start_stagger.hpp"

namespace dsaib::hopper {

template <int kHeadDim, bool kSplitA>
int indexer_backward_smem_bytes() {
  return shared_storage_bytes<TileConfig<kHeadDim, kSplitA>>();
}

template <int kHeadDim, bool kSplitA, bool kL2KeepDk>
void launch_indexer_backward(const IndexerBackwardParams& params, cudaStream_t stream) {
  static_assert(!(kSplitA && kL2KeepDk), "the L2-hinted kernels are the one-term ones (launch.hpp)");
  using Config = TileConfig<kHeadDim, kSplitA, kL2KeepDk>;
  if (params.num_tasks == 0) return;
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
  const int64_t grid = std::min<int64_t>(params.num_tasks, static_cast<int64_t>(sms) * blocks_per_sm);
  IndexerBackwardParams launch_params = params;
  const StartStagger stagger = start_stagger_for_launch(params.num_tasks, grid, params.max_valid_slots_per_row,
                                                          params.head_dim);
  launch_params.start_stagger_max_ns = stagger.max_ns;
  launch_params.start_stagger_first_cta = stagger.first_delayed_cta;
  kernel<<<static_cast<unsigned>(grid), Config::kThreads, smem, stream>>>(launch_params);
  cuda_check_launch("indexer_backward_kernel");
}

}  // namespace dsaib::hopper
