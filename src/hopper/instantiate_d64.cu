// Explicit instantiation: fused kernel, D = 64.
#include "hopper/launch_impl.cuh"

namespace dsaib::hopper {
template int64_t indexer_backward_grid<64, true>(int64_t);
template void launch_indexer_backward<64, true>(const IndexerBackwardParams&, int64_t, cudaStream_t);
template int64_t indexer_backward_grid<64, false>(int64_t);
template void launch_indexer_backward<64, false>(const IndexerBackwardParams&, int64_t, cudaStream_t);
template int64_t indexer_backward_grid<64, false, true>(int64_t);
template void launch_indexer_backward<64, false, true>(const IndexerBackwardParams&, int64_t, cudaStream_t);
template int indexer_backward_smem_bytes<64, true>();
template int indexer_backward_smem_bytes<64, false>();
}  // namespace dsaib::hopper
