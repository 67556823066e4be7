// Explicit instantiation: the P-free kernels, D = 128.
#include "hopper/launch_impl.cuh"

DSAIB_INSTANTIATE_INDEXER_BACKWARD_RECOMPUTE_P(128)
