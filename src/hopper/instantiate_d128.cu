// Explicit instantiation: fused kernel, D = 128.
#include "hopper/launch_impl.cuh"

namespace dsaib::hopper {
template void launch_indexer_backward<128>(const IndexerBackwardParams&, cudaStream_t);
template int indexer_backward_smem_bytes<128>();
}  // namespace dsaib::hopper
