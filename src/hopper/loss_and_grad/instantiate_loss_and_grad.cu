// Explicit instantiation: the loss-and-gradient kernels, D = 64 and 128.
#include "hopper/common/cuda_check.hpp"
#include "hopper/loss_and_grad/launch.hpp"
#include "hopper/loss_and_grad/loss_and_grad_kernel.cuh"

namespace dsaib::hopper {

template <int kHeadDim>
using LossAndGradTileConfig = LossAndGradConfig<TileConfig<kHeadDim, false>>;

template <int kHeadDim>
void launch_indexer_kl_loss_and_grad(const IndexerKLForwardParams& params, int64_t grid, cudaStream_t stream) {
  if (grid <= 0) return;
  using Config = LossAndGradTileConfig<kHeadDim>;
  const int smem = shared_storage_bytes<Config>();
  auto kernel = indexer_kl_loss_and_grad_kernel<Config>;
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(indexer_kl_loss_and_grad_kernel)");
  kernel<<<static_cast<unsigned>(grid), Config::kThreads, smem, stream>>>(params);
  cuda_check_launch("indexer_kl_loss_and_grad_kernel");
}

template <int kHeadDim>
void prepare_indexer_kl_loss_and_grad() {
  using Config = LossAndGradTileConfig<kHeadDim>;
  (void)resident_ctas_per_sm(indexer_kl_loss_and_grad_kernel<Config>, Config::kThreads, shared_storage_bytes<Config>(),
                             "indexer_kl_loss_and_grad_kernel");
}

template void prepare_indexer_kl_loss_and_grad<64>();
template void prepare_indexer_kl_loss_and_grad<128>();
template void launch_indexer_kl_loss_and_grad<64>(const IndexerKLForwardParams&, int64_t, cudaStream_t);
template void launch_indexer_kl_loss_and_grad<128>(const IndexerKLForwardParams&, int64_t, cudaStream_t);

}  // namespace dsaib::hopper
