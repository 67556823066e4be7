// The top-k forward's ordering kernel: one CTA per query row sorts the row's
// selection (rank keys in key_lo / key_hi, its count in row_count, written by
// indexer_topk_kernel) and rewrites the same memory as ids and logits in the
// order asked for, -1 and -inf past the count. A block radix sort over the
// 64-bit keys: distinct keys, so the order is total and the output does not
// depend on where the selection kernel put each key.
#pragma once

#include <cub/block/block_radix_sort.cuh>
#include <cuda/std/limits>

#include "hopper/common/kernel_params.hpp"
#include "hopper/indexer_topk/topk_rank_key.cuh"
#include "hopper/indexer_topk/topk_rows.cuh"

namespace dsaib::hopper {

/// kThreads x kItems >= topk. Dynamic shared memory: the sort's TempStorage.
template <int kThreads, int kItems>
__global__ void __launch_bounds__(kThreads) topk_order_kernel(const __grid_constant__ IndexerTopkParams p) {
  using Sort = cub::BlockRadixSort<unsigned long long, kThreads, kItems>;
  extern __shared__ uint8_t smem_raw[];
  auto& temp = *reinterpret_cast<typename Sort::TempStorage*>(smem_raw);
  for (int64_t row = blockIdx.x; row < p.num_q_rows; row += gridDim.x) {
    const int n = p.row_count[row];
    uint32_t* lo = p.key_lo + row * p.topk;
    uint32_t* hi = p.key_hi + row * p.topk;
    // Blocked: thread t holds entries t * kItems ...; by id, (key row, logit
    // bits) ascending with padding last; by logit, the rank key descending with
    // padding (0) last.
    unsigned long long keys[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = threadIdx.x * kItems + i;
      if (e < n) {
        const unsigned long long rank = (static_cast<unsigned long long>(hi[e]) << 32) | lo[e];
        keys[i] = p.id_ascending ? (static_cast<unsigned long long>(key_row_of_rank_key(rank)) << 32) | hi[e] : rank;
      } else {
        keys[i] = p.id_ascending ? ~0ull : 0ull;
      }
    }
    __syncthreads();  // every read of this row's entries precedes the writes below
    if (p.id_ascending) Sort(temp).Sort(keys);
    else Sort(temp).SortDescending(keys);
    const int64_t k_start = topk_row_sequence(p, row).k_start;
    int32_t* ids = reinterpret_cast<int32_t*>(lo);
    float* logits = reinterpret_cast<float*>(hi);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = threadIdx.x * kItems + i;
      if (e >= p.topk) continue;
      int32_t id = -1;
      float logit = -cuda::std::numeric_limits<float>::infinity();
      if (e < n) {
        const uint32_t key_row = p.id_ascending ? static_cast<uint32_t>(keys[i] >> 32) : key_row_of_rank_key(keys[i]);
        const uint32_t bits = p.id_ascending ? static_cast<uint32_t>(keys[i]) : static_cast<uint32_t>(keys[i] >> 32);
        id = static_cast<int32_t>(p.global_ids ? static_cast<int64_t>(key_row) : static_cast<int64_t>(key_row) - k_start);
        logit = logit_from_order_bits(bits);
      }
      ids[e] = id;
      if (p.write_logits) logits[e] = logit;
    }
    __syncthreads();  // the sort's storage is reused by the next row
  }
}

}  // namespace dsaib::hopper
