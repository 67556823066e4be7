// Explicit instantiation: the P-free kernels, D = 64.
#include "hopper/indexer_backward/launch_impl.cuh"

DSAIB_INSTANTIATE_INDEXER_BACKWARD_P_FREE(64)
