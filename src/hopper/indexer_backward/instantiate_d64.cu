// Explicit instantiation: the backward kernels, D = 64.
#include "hopper/indexer_backward/launch_impl.cuh"

DSAIB_INSTANTIATE_INDEXER_BACKWARD(64)
