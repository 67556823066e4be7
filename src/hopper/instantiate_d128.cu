// Explicit instantiation: fused kernel, D = 128.
#include "hopper/launch_impl.cuh"

namespace dsaib::hopper {
template int64_t indexer_backward_grid<128, true>(int64_t);
template void launch_indexer_backward<128, true>(const IndexerBackwardParams&, int64_t, cudaStream_t);
template int64_t indexer_backward_grid<128, false>(int64_t);
template void launch_indexer_backward<128, false>(const IndexerBackwardParams&, int64_t, cudaStream_t);
template int64_t indexer_backward_grid<128, false, true>(int64_t);
template void launch_indexer_backward<128, false, true>(const IndexerBackwardParams&, int64_t, cudaStream_t);
template int indexer_backward_smem_bytes<128, true>();
template int indexer_backward_smem_bytes<128, false>();
}  // namespace dsaib::hopper
