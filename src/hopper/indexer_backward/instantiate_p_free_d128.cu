// Explicit instantiation: the P-free kernels, D = 128.
#include "hopper/indexer_backward/launch_impl.cuh"

DSAIB_INSTANTIATE_INDEXER_BACKWARD_P_FREE(128)
