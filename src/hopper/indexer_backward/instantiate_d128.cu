// Explicit instantiation: the backward kernels, D = 128.
#include "hopper/indexer_backward/launch_impl.cuh"

DSAIB_INSTANTIATE_INDEXER_BACKWARD(128)
