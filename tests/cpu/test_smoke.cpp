#include <gtest/gtest.h>
#include "dsaib/indexer_backward.hpp"
TEST(Smoke, CudaBackendAvailabilityIsABool) { (void)dsaib::cuda_backend_available(); SUCCEED(); }
