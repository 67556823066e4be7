// Exact selection over a row's candidate rank keys (topk_rank_key.cuh) by one
// warpgroup: a most-significant-digit radix select finds the k-th largest key
// (or a prefix that only the k largest keys reach, or, for a buffer cut, a
// coarser prefix that at most keep_at_most keys reach), then the kept keys are
// written elsewhere. Keys are distinct (the low word is the key row), so an
// exact select keeps exactly k, whatever the order of the entries: the result
// depends on the set alone.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "hopper/indexer_topk/topk_shared_storage.cuh"

namespace dsaib::hopper {

/// The k largest keys are those with (key & mask) >= prefix; any key of the
/// row's top-k is >= prefix.
struct RadixCut {
  unsigned long long prefix = 0;
  unsigned long long mask = 0;
  __device__ bool keeps(unsigned long long key) const { return (key & mask) >= prefix; }
};

/// Calls f(load(e)) for e = tid, tid + kThreads, ... below n, kBatch loads
/// issued before the first call: the entries are L2 reads, and a loop that
/// waits for each before the next would pay the L2's latency once per entry.
template <int kThreads, int kBatch, class Load, class F>
__device__ __forceinline__ void for_each_entry(int n, int tid, Load&& load, F&& f) {
  for (int e0 = tid; e0 < n; e0 += kBatch * kThreads) {
    unsigned long long v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int e = e0 + b * kThreads;
      v[b] = e < n ? load(e) : 0ull;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (e0 + b * kThreads < n) f(v[b]);
    }
  }
}

/// Up to kItems x kThreads entries held in registers, entry tid + i kThreads in
/// v[i]: loaded once (all loads in flight together), then every radix pass and
/// the write pass read registers, not the L2.
template <int kThreads, int kItems>
struct RegisterEntries {
  static constexpr int kCapacity = kThreads * kItems;
  unsigned long long v[kItems];
  int n;

  template <class Load>
  __device__ __forceinline__ void load(int count, int tid, Load&& at) {
    n = count;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = tid + i * kThreads;
      v[i] = e < count ? at(e) : 0ull;
    }
  }
  template <class F>
  __device__ __forceinline__ void for_each(int tid, F&& f) const {
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      if (tid + i * kThreads < n) f(v[i]);
    }
  }
};

/// kThreads threads (one warpgroup) with their own barrier `sync()`.
template <int kRows, int kThreads = 128>
struct CandidateSelect {
  TopkSelection<kRows>& sel;
  int tid;  // 0..kThreads-1

  /// A cut that keeps the k largest of the entries that for_each(f) passes to
  /// f across the warpgroup (each entry to one thread), and at most
  /// keep_at_most >= k entries in all: with keep_at_most == k exactly the k
  /// largest; a larger keep_at_most ends the digit passes as soon as the bin
  /// that holds the k-th largest entry, with every entry above it, fits (a
  /// buffer cut needs no more, and most rows then need two passes, not four).
  /// Needs more than k entries. Ends with a sync(); reads, writes nothing but
  /// sel.hist/found_*.
  template <class Sync, class ForEach>
  __device__ RadixCut radix_cut(int k, int keep_at_most, Sync&& sync, ForEach&& for_each) {
    RadixCut cut;
    int need = k;
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int b = tid; b < 256; b += kThreads) sel.hist[b] = 0;
      sync();
      for_each([&](unsigned long long key) {
        // Logits cluster in few bins (the top digit is the sign and exponent):
        // one add per distinct bin per warp, not one per lane on the same word.
        const bool counted = (key & cut.mask) == cut.prefix;
        const uint32_t bin = counted ? static_cast<uint32_t>(key >> shift) & 255u : 256u;
        const uint32_t peers = __match_any_sync(__activemask(), bin);
        if (counted && (threadIdx.x % 32) == static_cast<uint32_t>(__ffs(peers) - 1)) {
          atomicAdd(&sel.hist[bin], static_cast<uint32_t>(__popc(peers)));
        }
      });
      sync();
      if (tid < 32) {  // lane l: bins 255 - 8 l down to 248 - 8 l, counted from the top
        const int lane = tid;
        uint32_t c[8], s = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          c[i] = sel.hist[255 - 8 * lane - i];
          s += c[i];
        }
        uint32_t inclusive = s;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const uint32_t v = __shfl_up_sync(0xffffffffu, inclusive, off);
          if (lane >= off) inclusive += v;
        }
        uint32_t above = inclusive - s;
        const uint32_t n = static_cast<uint32_t>(need);
        if (above < n && n <= inclusive) {  // one lane: the bin holding the need-th key
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if (above + c[i] >= n) {
              sel.found_bin = 255 - 8 * lane - i;
              sel.found_above = static_cast<int32_t>(above);
              sel.found_count = static_cast<int32_t>(c[i]);
              break;
            }
            above += c[i];
          }
        }
      }
      sync();
      const int bin = sel.found_bin;
      need -= sel.found_above;
      cut.prefix |= static_cast<unsigned long long>(bin) << shift;
      cut.mask |= 0xffull << shift;
      if (k - need + sel.found_count <= keep_at_most) break;  // the whole bin is kept
    }
    sync();  // found_* and hist read by every thread before they are rewritten
    return cut;
  }

  /// Writes the entries that `cut` keeps (or all, for a default cut) to
  /// out(position, key) at positions 0, 1, ... in no particular order; returns
  /// their count. Ends with a sync().
  template <class Sync, class ForEach, class Out>
  __device__ int write_kept(const RadixCut& cut, Sync&& sync, ForEach&& for_each, Out&& out) {
    if (tid == 0) sel.out_count = 0;
    sync();
    for_each([&](unsigned long long key) {
      // one shared atomic per warp, not one per kept key on the same word
      const uint32_t active = __activemask();
      const bool keep = cut.keeps(key);
      const uint32_t kept = __ballot_sync(active, keep);
      if (kept == 0u) return;
      const uint32_t lane = threadIdx.x % 32;
      const int leader = __ffs(kept) - 1;
      int base = 0;
      if (lane == static_cast<uint32_t>(leader)) base = atomicAdd(&sel.out_count, __popc(kept));
      base = __shfl_sync(active, base, leader);
      if (keep) out(base + __popc(kept & ((1u << lane) - 1u)), key);
    });
    sync();
    const int n = sel.out_count;
    sync();  // out_count read before it is reset
    return n;
  }
};

}  // namespace dsaib::hopper
