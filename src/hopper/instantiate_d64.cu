// Explicit instantiation: fused kernel, D = 64.
#include "hopper/launch_impl.cuh"

namespace dsaib::hopper {
template void launch_indexer_backward<64, true>(const IndexerBackwardParams&, cudaStream_t);
template void launch_indexer_backward<64, false>(const IndexerBackwardParams&, cudaStream_t);
template void launch_indexer_backward<64, false, true>(const IndexerBackwardParams&, cudaStream_t);
template int indexer_backward_smem_bytes<64, true>();
template int indexer_backward_smem_bytes<64, false>();
}  // namespace dsaib::hopper
