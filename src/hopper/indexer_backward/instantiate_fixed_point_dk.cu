// Explicit instantiation: the deterministic backward kernels (fixed-point dK), D = 64 and 128.
#include "hopper/indexer_backward/launch_impl.cuh"

DSAIB_INSTANTIATE_INDEXER_BACKWARD_FIXED_POINT_DK(64)
DSAIB_INSTANTIATE_INDEXER_BACKWARD_FIXED_POINT_DK(128)
