// The attention target's producer (warpgroup 0). Per row: Q and lse2 into a Q
// stage; pass 1, the row's blocks and the zeros at invalid slots; pass 2 per
// chunk, the compacted list, then one K stage per block and 64-dim slice (with
// kSelectedLse pass 2 runs twice, the consumers' two sweeps). Copies
// complete on the stage's mbarrier (cp.async.mbarrier.arrive.noinc): the producer
// never waits for its own copies, only for free stages.
#pragma once

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <cuda/ptx>

#include "hopper/attention_target/attention_target_tile_config.cuh"
#include "hopper/common/l2_prefetch.cuh"
#include "hopper/common/named_barriers.cuh"
#include "hopper/common/pipeline.cuh"
#include "hopper/common/problem_device.cuh"
#include "hopper/common/slot_compaction.cuh"

namespace dsaib::hopper {

/// An arrival on `bar` when all of this thread's earlier cp.async copies have
/// landed (counted in the barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(addr) : "memory");
}

template <class Config>
struct AttentionTargetProducer {
  using Storage = AttentionTargetStorage<Config>;
  static constexpr int kThreads = Config::kProducerThreads;
  static constexpr int kPerThread = Config::kSlotsPerThread;
  static constexpr int kBlock = Config::kBlockKeys;
  static constexpr int kN = Config::kHeadsPadded;
  static constexpr int kKeysPerThread = Config::kGatherKeysPerThread;  // 4
  // Chunks whose ids stay in registers from before the Q stage's wait to pass 2.
  static constexpr int kRegChunks = 2;
  static_assert(kKeysPerThread == 4, "one int4 of key rows per thread and block");

  const AttentionTargetParams& tp;
  Storage& ss;

  __device__ static void copy16(const void* src, void* dst, bool pred) {
    using Chunk = cute::uint128_t;
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(*reinterpret_cast<const Chunk*>(src),
                                                       *reinterpret_cast<Chunk*>(dst), pred);
  }

  /// Ids of this thread's slots of the chunk at chunk0 (-1 past topk): loads only.
  __device__ void load_ids(int chunk0, const int32_t* ids, int32_t (&id)[kPerThread]) const {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = chunk0 + threadIdx.x + j * kThreads;
      id[j] = i < tp.in.topk ? ids[i] : -1;
    }
  }
  /// Ids to key rows in place (-1: invalid or past topk).
  __device__ void to_key_rows(const RowSequence& seq, int32_t (&kr)[kPerThread]) const {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) kr[j] = static_cast<int32_t>(key_row_of(tp.in, seq, kr[j]));
  }
  /// Key rows of this thread's slots of the chunk at chunk0.
  __device__ void load_key_rows(int chunk0, const RowSequence& seq, const int32_t* ids, int32_t (&kr)[kPerThread]) const {
    load_ids(chunk0, ids, kr);
    to_key_rows(seq, kr);
  }

  /// Q rows and ids of `row` into the L2 (the copies and loads then hit it).
  __device__ void prefetch_row(int64_t row) const {
    const IndexerParams& p = tp.in;
    if (row >= p.num_tasks) return;
    const int32_t* ids = p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride);
    for (int off = static_cast<int>(threadIdx.x) * 32; off < p.topk; off += kThreads * 32) {
      prefetch_l2(ids + off);
    }
    const char* q = reinterpret_cast<const char*>(
        p.index_q + batched_offset(row, p.q_rows_per_batch, p.q_batch_stride, p.q_row_stride));
    const uint32_t head_bytes = static_cast<uint32_t>(p.head_dim) * 2;  // a multiple of 128
    if (static_cast<int>(threadIdx.x) < p.heads) {
      prefetch_l2_bulk(q + static_cast<int64_t>(threadIdx.x) * p.q_head_stride * 2, head_bytes);
    }
  }

  __device__ void run() {
    using namespace cute;
    const IndexerParams& p = tp.in;
    const int tid = threadIdx.x;  // 0..127 in warpgroup 0
    const int ns = tp.num_slices;
    Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});  // (heads, 64, slice)
    Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Config::SmemLayoutK{});  // (64 keys, 64, stage)
    // Thread t copies 16-byte chunk t % 8 of the slices of keys 4 (t / 8) .. + 3:
    // a warp instruction covers 4 whole 128-byte key slices.
    const int gather_col = (tid % 8) * 8;
    const int gather_key0 = (tid / 8) * kKeysPerThread;
    // Destinations in stage 0, once: stage ks is stage 0 plus ks * kStageElems.
    using Element = typename Config::Element;
    constexpr int kStageElems = kBlock * Config::kSliceDims;
    static_assert(decltype(cute::cosize(cute::take<0, 2>(typename Config::SmemLayoutK{})))::value == kStageElems &&
                      (kStageElems * sizeof(Element)) % 1024 == 0,
                  "a K stage is kStageElems contiguous elements spanning whole 128-byte-swizzle periods");
    Element* k_dst[kKeysPerThread];
#pragma unroll
    for (int i = 0; i < kKeysPerThread; ++i) k_dst[i] = &sK(gather_key0 + i, gather_col, 0);
    const int q_chunks_per_head = 8 * ns;

    // one ring per consumer: the row's block g goes to ring g % 2
    auto ring0 = make_producer_start_state<Config::kStagesPerConsumer>();
    auto ring1 = make_producer_start_state<Config::kStagesPerConsumer>();
    auto q_state = make_producer_start_state<Config::kStagesQ>();
    uint32_t n = 0;  // rows so far (u_row's parity)
    prefetch_row(blockIdx.x);
    for (int64_t row = blockIdx.x; row < p.num_tasks; row += gridDim.x, ++n) {
      prefetch_row(row + gridDim.x);
      const RowSequence seq = row_sequence(p, row);
      const int32_t* ids = p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride);
      float* out = tp.attn_score + row * static_cast<int64_t>(p.topk);

      // Loaded before the Q stage's wait, which hides their latency.
      int32_t kr_first[kRegChunks][kPerThread];
#pragma unroll
      for (int c = 0; c < kRegChunks; ++c) load_ids(c * Config::kSlotChunk, ids, kr_first[c]);
#pragma unroll
      for (int c = 0; c < kRegChunks; ++c) to_key_rows(seq, kr_first[c]);
      const int num_chunks = (p.topk + Config::kSlotChunk - 1) / Config::kSlotChunk;

      // ---- Q, lse2
      const int qs = static_cast<int>(q_state.index);
      target_wait(&ss.q_empty[qs], q_state.phase, 4u);
      const uint16_t* q_row = p.index_q + batched_offset(row, p.q_rows_per_batch, p.q_batch_stride, p.q_row_stride);
      for (int chunk = tid; chunk < kN * q_chunks_per_head; chunk += kThreads) {
        const int h = chunk / q_chunks_per_head, c = chunk % q_chunks_per_head;
        const int s = c / 8, col = (c % 8) * 8;
        const bool in_range = h < p.heads;  // padded heads: zero-filled, nothing read
        const uint16_t* src = in_range ? q_row + h * p.q_head_stride + s * 64 + col : p.index_q;
        copy16(src, &sQ(h, col, qs * Config::kMaxSlices + s), in_range);
      }
      cp_async_arrive_noinc(&ss.q_full[qs]);
      if (!Config::kSelectedLse && tid < kN) {  // kSelectedLse: the consumers write lse2
        float l2 = INFINITY;
        if (tid < p.heads) {
          const int64_t off = batched_offset(row, p.q_rows_per_batch, tp.lse_batch_stride, tp.lse_row_stride) +
                              tid * tp.lse_head_stride;
          l2 = tp.lse[off] * tp.lse_to_log2;
        }
        ss.lse2[qs][tid] = l2;
      }

      // ---- pass 1: the row's blocks; zeros at invalid slots (-0.0, the final
      //      pass's mark, when it normalises), in u_row after q_empty above
      const float zero = tp.normalize ? -0.0f : 0.0f;
      float* u_row = ss.u_row[n & 1u];
      int num_blocks = 0;
      auto pass1_chunk = [&](int chunk0, const int32_t (&kr)[kPerThread]) {
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
          const int i = chunk0 + tid + j * kThreads;
          if (i < p.topk && kr[j] < 0) {
            if (tp.u_in_smem) u_row[i] = zero;
            else out[i] = zero;
          }
        }
        int pos[kPerThread];
        const int chunk_valid = slot_list_positions<kThreads, kPerThread>(kr, pos, ss.producer_scan_rows, tid,
                                                                           [] { producer_sync<Config>(); });
        producer_sync<Config>();  // producer_scan_rows read by every thread before its next writes
        num_blocks += (chunk_valid + kBlock - 1) / kBlock;
      };
#pragma unroll
      for (int c = 0; c < kRegChunks; ++c) {
        if (c < num_chunks) pass1_chunk(c * Config::kSlotChunk, kr_first[c]);
      }
      for (int ci = kRegChunks; ci < num_chunks; ++ci) {
        int32_t kr[kPerThread];
        load_key_rows(ci * Config::kSlotChunk, seq, ids, kr);
        pass1_chunk(ci * Config::kSlotChunk, kr);
      }
      if (tid == 0) ss.num_blocks[qs] = num_blocks;
      (void)cuda::ptx::mbarrier_arrive(&ss.q_full[qs]);  // lse2, num_blocks and the zeros above
      q_state.advance();

      // ---- pass 2 per chunk: block g into consumer g % 2's ring, two blocks
      //      slice by slice in turn, so that both consumers are fed; once per
      //      sweep of the consumers, each sweep's blocks in the same rings
      int row_blocks = 0;  // blocks of the earlier chunks of the row in this sweep
      auto pass2_chunk = [&](int chunk0, const int32_t (&kr)[kPerThread]) {
        int pos[kPerThread];
        // the previous chunk's list was fully read (the barrier after its blocks)
        const int chunk_valid = slot_list_positions<kThreads, kPerThread>(kr, pos, ss.producer_scan_rows, tid,
                                                                           [] { producer_sync<Config>(); });
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
          if (kr[j] >= 0) {
            ss.slot_index[pos[j]] = chunk0 + tid + j * kThreads;
            ss.slot_key_row[pos[j]] = kr[j];
          }
        }
        producer_sync<Config>();  // list complete; producer_scan_rows read by every thread
        const int chunk_blocks = (chunk_valid + kBlock - 1) / kBlock;
        for (int blk = 0; blk < chunk_blocks; blk += 2) {
          const int pair = min(2, chunk_blocks - blk);  // blocks copied in turn
          const uint16_t* src[2][kKeysPerThread];
          bool valid[2][kKeysPerThread];
          int32_t slot[2];
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int first = (blk + b) * kBlock;
            const int4 rows4 = *reinterpret_cast<const int4*>(&ss.slot_key_row[first + gather_key0]);
            const int32_t krs[kKeysPerThread] = {rows4.x, rows4.y, rows4.z, rows4.w};
#pragma unroll
            for (int i = 0; i < kKeysPerThread; ++i) {
              // entries past the list (and a missing second block) are stale: zero-filled
              valid[b][i] = b < pair && first + gather_key0 + i < chunk_valid;
              src[b][i] = valid[b][i] ? key_row_ptr(p, krs[i]) + gather_col : p.index_k;
            }
            slot[b] = b < pair && tid < kBlock && first + tid < chunk_valid ? ss.slot_index[first + tid] : -1;
          }
          if constexpr (Config::kPrefetchBlocksAhead > 0) {
            // The kv rows kPrefetchBlocksAhead blocks on, one bulk L2 prefetch per key row.
            const int ahead = (blk + Config::kPrefetchBlocksAhead) * kBlock + tid;
            if (ahead < chunk_valid) {
              prefetch_l2_bulk(key_row_ptr(p, ss.slot_key_row[ahead]), static_cast<uint32_t>(p.head_dim) * 2);
            }
          }
          const bool ring_of_first = ((row_blocks + blk) & 1) != 0;  // ring of block blk; blk + 1 takes the other
          // slice s of block b into the next stage of a ring
          auto issue = [&](PipelineState<Config::kStagesPerConsumer>& st, int ring_base, int b, int s) {
            const int ks = ring_base + static_cast<int>(st.index);
            target_wait(&ss.k_empty[ks], st.phase, 3u);
            if (s == 0 && tid < kBlock) ss.key_slot[ks][tid] = slot[b];
#pragma unroll
            for (int i = 0; i < kKeysPerThread; ++i) {
              // a zero-filled copy reads nothing; its source stays within index_k's first row
              copy16(src[b][i] + s * 64, k_dst[i] + ks * kStageElems, valid[b][i]);
            }
            cp_async_arrive_noinc(&ss.k_full[ks]);
            (void)cuda::ptx::mbarrier_arrive(&ss.k_full[ks]);  // key_slot (slice 0)
            st.advance();
          };
          for (int s = 0; s < ns; ++s) {
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              if (b < pair) {
                if (ring_of_first != (b == 1)) issue(ring1, Config::kStagesPerConsumer, b, s);
                else issue(ring0, 0, b, s);
              }
            }
          }
        }
        row_blocks += chunk_blocks;
        producer_sync<Config>();  // every thread is done reading the list
      };
      for (int sweep = 0; sweep < (Config::kSelectedLse ? 2 : 1); ++sweep) {
        row_blocks = 0;
#pragma unroll
        for (int c = 0; c < kRegChunks; ++c) {
          if (c < num_chunks) pass2_chunk(c * Config::kSlotChunk, kr_first[c]);
        }
        for (int ci = kRegChunks; ci < num_chunks; ++ci) {
          int32_t kr[kPerThread];
          load_key_rows(ci * Config::kSlotChunk, seq, ids, kr);
          pass2_chunk(ci * Config::kSlotChunk, kr);
        }
      }
    }
  }
};

}  // namespace dsaib::hopper
