// Explicit instantiation: fused kernel, D = 128.
#include "hopper/launch_impl.cuh"

namespace dsaib::hopper {
template void launch_indexer_backward<128, true>(const IndexerBackwardParams&, cudaStream_t);
template void launch_indexer_backward<128, false>(const IndexerBackwardParams&, cudaStream_t);
template void launch_indexer_backward<128, false, true>(const IndexerBackwardParams&, cudaStream_t);
template int indexer_backward_smem_bytes<128, true>();
template int indexer_backward_smem_bytes<128, false>();
}  // namespace dsaib::hopper
