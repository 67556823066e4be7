// The compacted list of a chunk's valid slots, in slot order, for every producer.
#pragma once

#include <cstdint>

namespace dsaib::hopper {

/// Thread tid holds slots tid + j * kThreads (slot row j; key_row[j] < 0:
/// invalid). Returns the chunk's valid slots and sets pos[j], the list position
/// of each valid slot: (valid slots of rows < j) + (of threads < tid in row j).
/// One sync() after the (row, warp) counts; the caller orders any rewrite of
/// scan_rows after every thread's reads here.
template <int kThreads, int kPerThread, class Sync>
__device__ __forceinline__ int slot_list_positions(const int32_t (&key_row)[kPerThread], int (&pos)[kPerThread],
                                                   int32_t (&scan_rows)[kPerThread][kThreads / 32], int tid,
                                                   Sync&& sync) {
  constexpr int kWarps = kThreads / 32;
  const int lane = tid % 32, warp = tid / 32;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const unsigned valid = __ballot_sync(0xffffffffu, key_row[j] >= 0);
    pos[j] = __popc(valid & ((1u << lane) - 1u));
    if (lane == 0) scan_rows[j][warp] = __popc(valid);
  }
  sync();
  int chunk_valid = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int n = scan_rows[j][w];
      if (w == warp) pos[j] += chunk_valid;
      chunk_valid += n;
    }
  }
  return chunk_valid;
}

}  // namespace dsaib::hopper
