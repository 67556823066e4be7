// The compacted list of a chunk's valid slots, in slot order: shared by the
// producers of the indexer kernels (producer_gather.cuh) and of the attention
// target (attention_target_producer.cuh).
#pragma once

#include <cstdint>

namespace dsaib::hopper {

/// A producer warpgroup of kThreads threads holds a chunk of kThreads *
/// kPerThread slots; thread tid holds slots tid + j * kThreads (slot row j),
/// key_row[j] < 0 marking an invalid one. Returns the chunk's valid slots and
/// sets pos[j], the position of each valid slot in the list of valid slots in
/// slot order:
///   (valid slots of rows j' < j) + (valid slots of threads < tid in row j).
/// A ballot per slot row, the (row, warp) counts through `scan_rows`, and one
/// `sync()` (the warpgroup's named barrier) after their writes; the caller
/// orders any later rewrite of `scan_rows` after every thread's reads here
/// (a barrier of its own, e.g. after the list writes).
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
