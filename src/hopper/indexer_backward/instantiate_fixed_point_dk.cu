// Explicit instantiation: the deterministic fused kernels (fixed-point dK,
// fixed_point_dk.cuh), D = 64 and 128, in a translation unit of their own.
#include "hopper/indexer_backward/launch_impl.cuh"

DSAIB_INSTANTIATE_INDEXER_BACKWARD_FIXED_POINT_DK(64)
DSAIB_INSTANTIATE_INDEXER_BACKWARD_FIXED_POINT_DK(128)
