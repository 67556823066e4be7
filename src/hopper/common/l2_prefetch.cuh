// Hints that bring global memory into the L2 ahead of its loads. They change no
// value and fault on nothing a load of the same bytes would not.
#pragma once

#include <cstdint>

namespace dsaib::hopper {

/// The 128-byte line holding `src` into the L2.
__device__ __forceinline__ void prefetch_l2(const void* src) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src) : "memory");
}

/// `bytes` (a multiple of 16) from 16-byte aligned global memory into the L2.
__device__ __forceinline__ void prefetch_l2_bulk(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}

}  // namespace dsaib::hopper
