// Producer role (warpgroup 0): per task, Q and w, stage 1 (the score gradient
// g_i = -c max(T_i, eps) [P_i >= eps], G = sum g_i, gs_i = g_i - P_i G), the
// compacted list of the valid slots, and their keys gathered into K stages
// (docs/hopper-kernel.md §4). Thread t owns slots t, t + kThreads, ... of a
// chunk, so that a warp's load covers 128 contiguous bytes, and issues all their
// loads before using any. Invalid slots' keys are never dereferenced.
#pragma once

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <cuda/ptx>

#include "hopper/common/l2_prefetch.cuh"
#include "hopper/common/problem_device.cuh"
#include "hopper/common/shared_storage.cuh"
#include "hopper/common/slot_compaction.cuh"
#include "hopper/common/start_stagger.hpp"

namespace dsaib::hopper {

/// kScoreGradient: the backward's producer (each gathered key carries its gs).
/// Without it (the loss forward) there is no stage 1: each key carries its slot
/// (key_slot, -1 on tail entries) and T~ = max(T, eps) (key_target). With a
/// PFreeConfig each key carries g~_i = -c max(T_i, eps) in gs and the Q stage
/// the row's LSE and G; the score role forms gs (score_mma.cuh).
template <class Config, class Storage = SharedStorage<Config>, bool kScoreGradient = true>
struct ProducerGather {
  using Element = typename Config::Element;
  static constexpr int kD = Config::kHeadDim;
  static constexpr int kChunksPerRow = kD / 8;  // 16-byte chunks per K/Q row
  static constexpr int kBlock = Config::kBlockKeys;
  static constexpr int kThreads = Config::kProducerThreads;
  static constexpr int kPerThread = Config::kSlotsPerThread;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kGatherRows = kBlock * kChunksPerRow / kThreads;  // rows per thread per block: 8 (D128), 4 (D64)
  static_assert(kGatherRows % 4 == 0 && kGatherRows * kThreads == kBlock * kChunksPerRow, "whole rows, int4 loads");
  static constexpr bool kPFree = kIsPFree<Config>;
  static constexpr int kInFlight = kGatherBlocksInFlight<Config>;  // blocks of copies in flight
  static_assert(kInFlight == 2 || kInFlight == 3, "two or three blocks of copies in flight");
  static_assert(kInFlight <= Config::kStagesK - 1, "the consumer holds a stage while it waits for the next");
  static_assert(!kPFree || kScoreGradient, "the P-free producer is the backward's");

  const IndexerParams& p;
  Storage& ss;
  MbarrierPipeline<Config::kStagesK> k_pipe;
  MbarrierPipeline<Config::kStagesQ> q_pipe;

  __device__ static void copy16(const void* src, Element* dst, bool pred) {
    using Chunk = cute::uint128_t;
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(*reinterpret_cast<const Chunk*>(src),
                                                       *reinterpret_cast<Chunk*>(dst), pred);
  }

  /// One thread's slots of a chunk: key rows (-1 invalid) and, when wanted, T and P.
  struct SlotBatch {
    int32_t key_row[kPerThread];
    float attn_score[kPerThread];
    float index_score[kPerThread];
  };

  /// The loads of a batch (kScores: also T, and P where the backward is given
  /// it), into s: the raw ids in key_row until resolve_key_rows. T and P are
  /// dense (rows, topk): every slot's value is read beside its id, not after it,
  /// so a batch costs one memory latency, not two.
  template <bool kScores>
  __device__ void issue_batch_loads(int first_slot, const int32_t* ids, const float* attn_score,
                                    const float* index_score, SlotBatch& s) const {
    CUTE_UNROLL
    for (int j = 0; j < kPerThread; ++j) {
      const int i = first_slot + j * kThreads;
      const bool in_row = i < p.topk;
      s.key_row[j] = in_row ? ids[i] : -1;
      if constexpr (kScores) {
        s.attn_score[j] = in_row ? attn_score[i] : 0.0f;
        if constexpr (kScoreGradient && !kPFree) s.index_score[j] = in_row ? index_score[i] : 0.0f;
      }
    }
  }

  /// The ids of issue_batch_loads to key rows (-1: invalid or past topk), T and
  /// P zeroed at invalid slots: the first use of the loads.
  template <bool kScores>
  __device__ void resolve_key_rows(const RowSequence& seq, SlotBatch& s) const {
    CUTE_UNROLL
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t kr = key_row_of(p, seq, s.key_row[j]);
      s.key_row[j] = static_cast<int32_t>(kr);
      if constexpr (kScores) {
        if (kr < 0) s.attn_score[j] = 0.0f;
        if constexpr (kScoreGradient && !kPFree) {
          if (kr < 0) s.index_score[j] = 0.0f;
        }
      }
    }
  }

  /// One thread's slots of the chunk at first_slot - tid. kScores: also T (and P
  /// where the backward is given it); a counting pass needs the key rows alone.
  template <bool kScores>
  __device__ void load_batch(int first_slot, const RowSequence& seq, const int32_t* ids, const float* attn_score,
                             const float* index_score, SlotBatch& s) const {
    issue_batch_loads<kScores>(first_slot, ids, attn_score, index_score, s);
    resolve_key_rows<kScores>(seq, s);
  }

  /// The 128-byte lines of [first, first + bytes) into the L2, thread t taking
  /// lines t, t + kThreads, ...
  __device__ static void prefetch_span(const void* first, int64_t bytes, int tid) {
    if (bytes <= 0) return;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(first) & ~uintptr_t{127};
    const uintptr_t end = reinterpret_cast<uintptr_t>(first) + static_cast<uintptr_t>(bytes);  // past the last byte
    for (uintptr_t line = begin + static_cast<uintptr_t>(tid) * 128; line < end; line += kThreads * 128) {
      // the first line may start before `first`: prefetch from inside the span
      prefetch_l2(reinterpret_cast<const void*>(line < reinterpret_cast<uintptr_t>(first)
                                                    ? reinterpret_cast<uintptr_t>(first)
                                                    : line));
    }
  }

  /// The ids, T (and P where given), Q rows and weights of `task` into the L2,
  /// a task ahead of their loads, which then wait on the L2 and not on HBM.
  __device__ void prefetch_task(int64_t task, int tid) const {
    if (task >= p.num_tasks) return;
    const int64_t row = task / p.head_groups;
    const int h0 = static_cast<int>(task % p.head_groups) * Config::kHeadTile;
    const int nh = min(Config::kHeadTile, p.heads - h0);
    const int64_t slot_bytes = static_cast<int64_t>(p.topk) * 4;  // int32 ids, f32 T and P
    prefetch_span(p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride),
                  slot_bytes, tid);
    prefetch_span(
        p.attn_score + batched_offset(row, p.q_rows_per_batch, p.attn_score_batch_stride, p.attn_score_row_stride),
        slot_bytes, tid);
    if constexpr (kScoreGradient && !kPFree) {
      prefetch_span(p.index_score +
                        batched_offset(row, p.q_rows_per_batch, p.index_score_batch_stride, p.index_score_row_stride),
                    slot_bytes, tid);
    }
    const uint16_t* q_row = p.index_q + batched_offset(row, p.q_rows_per_batch, p.q_batch_stride, p.q_row_stride);
    if (tid < nh) prefetch_l2_bulk(q_row + (h0 + tid) * p.q_head_stride, kD * 2);
    const int w_size = p.weights_f32 ? 4 : 2;
    const int64_t w_off = batched_offset(row, p.q_rows_per_batch, p.w_batch_stride, p.w_row_stride) + h0;
    prefetch_span(static_cast<const char*>(p.weights) + w_off * w_size, static_cast<int64_t>(nh) * w_size, tid);
  }

  /// Sum of v over the producer warpgroup (every thread gets it). Uses
  /// producer_partial[.][slot]; ends with the partials free for reuse.
  __device__ float warpgroup_sum(float v, int slot) {
    CUTE_UNROLL
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) ss.producer_partial[warp][slot] = v;
    producer_sync<Config>();
    float total = 0.0f;
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) total += ss.producer_partial[w][slot];  // fixed order: deterministic
    producer_sync<Config>();
    return total;
  }

  /// Exclusive prefix of `count` over producer threads in thread order, and the total.
  __device__ int warpgroup_exclusive_scan(int count, int* total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int inclusive = count;
    CUTE_UNROLL
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, off);
      if (lane >= off) inclusive += v;
    }
    if (lane == 31) ss.producer_scan[warp] = inclusive;
    producer_sync<Config>();
    int before = 0, all = 0;
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) {
      const int t = ss.producer_scan[w];
      if (w < warp) before += t;
      all += t;
    }
    *total = all;
    return before + inclusive - count;
  }

  // Thread t copies 16-byte column chunk t % kChunksPerRow of kGatherRows
  // consecutive rows from gather_row0: a warp's copy i covers whole key rows.
  __device__ static int gather_col(int tid) { return (tid % kChunksPerRow) * 8; }
  __device__ static int gather_row0(int tid) { return (tid / kChunksPerRow) * kGatherRows; }
  static constexpr int kStageElems = kBlock * kD;

  /// This thread's destinations in K stage 0, once: a stage spans whole swizzle
  /// periods, so stage ks is stage 0 plus ks * kStageElems.
  __device__ void gather_destinations(Element* (&k_dst)[kGatherRows], int tid) const {
    static_assert(decltype(cute::cosize(cute::take<0, 2>(typename Config::SmemLayoutK{})))::value == kStageElems &&
                      (kStageElems * sizeof(Element)) % 1024 == 0,
                  "a K stage is kStageElems contiguous elements spanning whole 128-byte-swizzle periods");
    cute::Tensor sK = cute::make_tensor(cute::make_smem_ptr(ss.k), typename Config::SmemLayoutK{});
    CUTE_UNROLL
    for (int i = 0; i < kGatherRows; ++i) k_dst[i] = &sK(gather_row0(tid) + i, gather_col(tid), 0);
  }

  /// The Q tile (cp.async, then one commit group) and w_scaled of a task into Q stage qs.
  __device__ void load_q(int64_t row, int h0, int nh, int qs, int tid) {
    cute::Tensor sQ = cute::make_tensor(cute::make_smem_ptr(ss.q), typename Config::SmemLayoutQ{});
    const uint16_t* q_row = p.index_q + batched_offset(row, p.q_rows_per_batch, p.q_batch_stride, p.q_row_stride);
    for (int chunk = tid; chunk < Config::kHeadTile * kChunksPerRow; chunk += kThreads) {
      const int hh = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * 8;
      const bool in_range = hh < nh;  // padded heads: zero-filled, nothing read
      const uint16_t* src = in_range ? q_row + (h0 + hh) * p.q_head_stride + col : p.index_q;
      copy16(src, &sQ(hh, col, qs), in_range);
    }
    cute::cp_async_fence();
    if (tid < Config::kHeadTile) {
      float w = 0.0f;
      if (tid < nh) {
        const int64_t w_off = batched_offset(row, p.q_rows_per_batch, p.w_batch_stride, p.w_row_stride) + h0 + tid;
        w = weight_at(p, w_off);
      }
      ss.w_scaled[qs][tid] = w * p.sm_scale;
    }
  }

  /// The copies (one commit group) of list entries first... into K stage ks, those
  /// at or past chunk_valid zero-filled. k_seq_col: this thread's column of the
  /// sequence's first key row.
  __device__ void gather_block(int ks, int first, int chunk_valid, const int32_t* list_key_row,
                               Element* const (&k_dst)[kGatherRows], const uint16_t* k_seq_col, int32_t k_start,
                               int tid) const {
    const int row0 = gather_row0(tid);
    // This thread's kGatherRows consecutive rows: one vector load of their key rows.
    int32_t kr[kGatherRows];
    CUTE_UNROLL
    for (int q = 0; q < kGatherRows / 4; ++q) {
      const int4 v = *reinterpret_cast<const int4*>(&list_key_row[first + row0 + 4 * q]);
      kr[4 * q] = v.x, kr[4 * q + 1] = v.y, kr[4 * q + 2] = v.z, kr[4 * q + 3] = v.w;
    }
    CUTE_UNROLL
    for (int i = 0; i < kGatherRows; ++i) {
      const bool valid = first + row0 + i < chunk_valid;  // entries past the list are stale
      const int32_t local = valid ? kr[i] - k_start : 0;  // zero-filled copies read nothing
      copy16(k_seq_col + static_cast<int64_t>(local) * p.k_row_stride, k_dst[i] + ks * kStageElems, valid);
    }
    cute::cp_async_fence();
  }

  /// The forward's blocks carry no count: each says whether its row ends with
  /// it (block_last), written just before the block's full arrival.
  __device__ void commit_block(const PipelineState<Config::kStagesK>& state, [[maybe_unused]] bool last_of_row,
                               [[maybe_unused]] int tid) {
    if constexpr (!kScoreGradient) {
      if (tid == 0) ss.block_last[state.index] = last_of_row ? 1 : 0;
    }
    k_pipe.producer_commit(state);
  }

  /// Blocks whose copies are issued and not yet committed, oldest first. A block
  /// is committed once kInFlight - 1 later blocks are issued (kInFlight blocks
  /// of copies in flight), or when the producer drains.
  struct PendingBlocks {
    PipelineState<Config::kStagesK> oldest, newest;  // newest: the second of two (kInFlight 3)
    int count = 0;
  };

  /// Commits the oldest pending block once its copies have landed: at most
  /// kOutstanding commit groups are then left in flight.
  template <int kOutstanding>
  __device__ void commit_oldest(PendingBlocks& pending, bool last_of_row, int tid) {
    cute::cp_async_wait<kOutstanding>();
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
    commit_block(pending.oldest, last_of_row, tid);
    if constexpr (kInFlight == 3) pending.oldest = pending.newest;
    --pending.count;
  }

  /// Commits all but the newest pending block (whether it ends its row is not
  /// known yet): pending.count - 1 of them, each of the older blocks in flight.
  __device__ void commit_all_but_newest(PendingBlocks& pending, int tid) {
    if constexpr (kInFlight == 3) {
      if (pending.count == 2) commit_oldest<1>(pending, false, tid);
    }
  }

  /// List entries first.. (those at or past chunk_valid: tail entries) into the
  /// next K stage; then the oldest pending block is committed if kInFlight
  /// blocks are in flight.
  __device__ void gather_list_block(PipelineState<Config::kStagesK>& k_state, int first, int chunk_valid,
                                    Element* const (&k_dst)[kGatherRows], const uint16_t* k_seq_col,
                                    int32_t k_start, PendingBlocks& pending, int tid) {
    k_pipe.producer_acquire(k_state);
    const int ks = k_state.index;
    if (tid < kBlock) {
      const bool in_list = first + tid < chunk_valid;
      if constexpr (kScoreGradient) {
        ss.gs[ks][tid] = in_list ? ss.slot_gs[first + tid] : 0.0f;
      } else {
        ss.key_slot[ks][tid] = in_list ? ss.slot_index[first + tid] : -1;
        ss.key_target[ks][tid] = in_list ? ss.slot_target[first + tid] : 0.0f;
      }
      ss.key_row[ks][tid] = in_list ? ss.slot_key_row[first + tid] : -1;
    }
    gather_block(ks, first, chunk_valid, ss.slot_key_row, k_dst, k_seq_col, k_start, tid);
    // all but the kInFlight - 1 blocks issued after the oldest have landed
    if (pending.count == kInFlight - 1) commit_oldest<kInFlight - 1>(pending, false, tid);
    if (kInFlight == 2 || pending.count == 0) {
      pending.oldest = k_state;
    } else {
      pending.newest = k_state;
    }
    ++pending.count;
    k_state.advance();
  }

  __device__ void run() {
    const int tid = threadIdx.x;  // 0..127 in warpgroup 0
    const float c = loss_scale(p);
    const float eps = eps_exp_minus_100();

    Element* k_dst[kGatherRows];
    gather_destinations(k_dst, tid);

    auto k_state = make_producer_start_state<Config::kStagesK>();
    auto q_state = make_producer_start_state<Config::kStagesQ>();

    // Start delay (start_stagger.hpp): only this role waits, touching no memory.
    if (const uint64_t delay = start_delay_ns(p.start_stagger_max_ns, p.start_stagger_first_delayed_cta, blockIdx.x)) {
      const uint64_t start = cuda::ptx::get_sreg_globaltimer();
      while (cuda::ptx::get_sreg_globaltimer() - start < delay) __nanosleep(500);
    }
    for (int64_t task = blockIdx.x; task < p.num_tasks; task += gridDim.x) {
      prefetch_task(task + gridDim.x, tid);
      const int64_t row = task / p.head_groups;
      const int h0 = static_cast<int>(task % p.head_groups) * Config::kHeadTile;
      const int nh = min(Config::kHeadTile, p.heads - h0);
      const RowSequence seq = row_sequence(p, row);
      // One division per task, none per copy: a key row kr's chunk is at
      // k_seq_col + (kr - k_start) * k_row_stride (32-bit: key rows < 2^31).
      const uint16_t* k_seq_col = key_row_ptr(p, seq.k_start) + gather_col(tid);
      const int32_t k_start = static_cast<int32_t>(seq.k_start);
      const int32_t* ids = p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride);
      const float* attn_score = p.attn_score + batched_offset(row, p.q_rows_per_batch, p.attn_score_batch_stride, p.attn_score_row_stride);
      const float* index_score = nullptr;
      if constexpr (!kPFree) {
        index_score = p.index_score + batched_offset(row, p.q_rows_per_batch, p.index_score_batch_stride, p.index_score_row_stride);
      }

      // ---- Q tile and weights of this task
      q_pipe.producer_acquire(q_state);
      const int qs = q_state.index;
      load_q(row, h0, nh, qs, tid);
      // Q lands (no K copy of this task is issued yet: the last task's ended with
      // a wait for all), then every producer thread arrives.
      auto commit_q = [&] {
        cute::cp_async_wait<0>();                              // this thread's Q copies landed
        cuda::ptx::fence_proxy_async(cuda::ptx::space_shared); // ...and are visible to wgmma
        q_pipe.producer_commit(q_state);
        q_state.advance();
      };

      float G = 0.0f;
      if constexpr (kScoreGradient) {
        // ---- stage 1, pass 1: G and the number of blocks (chunks pad their last block)
        float g_part = 0.0f;
        int num_blocks = 0;
        for (int chunk0 = 0; chunk0 < p.topk; chunk0 += Config::kSlotChunk) {
          SlotBatch s;
          load_batch<true>(chunk0 + tid, seq, ids, attn_score, index_score, s);
          int count = 0;
          CUTE_UNROLL
          for (int j = 0; j < kPerThread; ++j) {
            if (s.key_row[j] >= 0) {
              ++count;
              if constexpr (!kPFree) {
                if (s.index_score[j] >= eps) g_part += -c * max_keeping_nan(s.attn_score[j], eps);
              }
            }
          }
          int chunk_valid = 0;
          (void)warpgroup_exclusive_scan(count, &chunk_valid);
          producer_sync<Config>();  // producer_scan is reused
          num_blocks += (chunk_valid + kBlock - 1) / kBlock;
        }
        if constexpr (kPFree) {
          // G = sum_i g_i = -c * sum_i T~_i m_i: the row's target mass, given.
          if (tid == 0) {
            // (LSE, mass) of the row, packed by the host (kernel_params.hpp)
            const float2 stats = reinterpret_cast<const float2*>(p.index_score)[row];
            ss.p_free.row_lse[qs] = stats.x;
            ss.p_free.row_g[qs] = -c * stats.y;
          }
        } else {
          G = warpgroup_sum(g_part, 0);
        }
        if (tid == 0) ss.num_blocks[qs] = num_blocks;
        commit_q();
      }

      // ---- pass 2 per chunk: compact, then gather blocks; block j is committed
      //      once block j + kInFlight - 1 is issued
      PendingBlocks pending;
      // Odd waves walk the chunks last to first: with ascending ids, the keys a
      // wave touched last are the next wave's first. The forward keeps slot
      // order: its statistics accumulate in arrival order, which must not
      // depend on the grid.
      const int num_chunks = (p.topk + Config::kSlotChunk - 1) / Config::kSlotChunk;
      const bool reverse_chunks = kScoreGradient && ((task / gridDim.x) & 1) != 0;
      // The forward's Q stage goes out once its first chunk's loads are back.
      bool q_committed = kScoreGradient;
      // The forward issues a chunk's loads before the blocks of the chunk before
      // it, so that they are back when it compacts (kPerThread ids and T a thread).
      SlotBatch ahead;
      if constexpr (!kScoreGradient) {
        if (num_chunks > 0) issue_batch_loads<true>(tid, ids, attn_score, index_score, ahead);
      }
      // The forward pads a block only at a multiple of kBlockPadSlots slots (and
      // at the row's end): the entries past a chunk's last whole block are carried
      // to the front of the next chunk's list, so that a row's keys take the same
      // blocks, and the same threads of the score role, whatever the chunk size.
      int carry = 0;
      for (int ci = 0; ci < num_chunks; ++ci) {
        const int chunk0 = (reverse_chunks ? num_chunks - 1 - ci : ci) * Config::kSlotChunk;
        SlotBatch s;
        if constexpr (kScoreGradient) {
          load_batch<true>(chunk0 + tid, seq, ids, attn_score, index_score, s);
        } else {
          s = ahead;
          if (ci + 1 < num_chunks) {
            issue_batch_loads<true>(chunk0 + Config::kSlotChunk + tid, ids, attn_score, index_score, ahead);
          }
          resolve_key_rows<true>(seq, s);
        }
        if (!q_committed) {
          commit_q();
          q_committed = true;
        }
        int pos[kPerThread];  // the previous list was read (the barrier after its blocks)
        const int chunk_valid = slot_list_positions<kThreads, kPerThread>(s.key_row, pos, ss.producer_scan_rows, tid,
                                                                           [] { producer_sync<Config>(); });
        CUTE_UNROLL
        for (int j = 0; j < kPerThread; ++j) {
          if (s.key_row[j] >= 0) {
            if constexpr (kPFree) {
              ss.slot_gs[pos[j]] = -c * max_keeping_nan(s.attn_score[j], eps);  // g~_i: masked by the score role
            } else if constexpr (kScoreGradient) {
              const float g = s.index_score[j] >= eps ? -c * max_keeping_nan(s.attn_score[j], eps) : 0.0f;
              ss.slot_gs[pos[j]] = g - s.index_score[j] * G;
            } else {
              ss.slot_index[carry + pos[j]] = chunk0 + tid + j * kThreads;
              ss.slot_target[carry + pos[j]] = max_keeping_nan(s.attn_score[j], eps);
            }
            ss.slot_key_row[(kScoreGradient ? 0 : carry) + pos[j]] = s.key_row[j];
          }
        }
        producer_sync<Config>();  // list complete; producer_scan_rows read by every thread
        const int list_valid = (kScoreGradient ? 0 : carry) + chunk_valid;
        bool pad_last_block = true;
        if constexpr (!kScoreGradient) {
          pad_last_block = ci == num_chunks - 1 || (chunk0 + Config::kSlotChunk) % Config::kBlockPadSlots == 0;
        }
        const int chunk_blocks = pad_last_block ? (list_valid + kBlock - 1) / kBlock : list_valid / kBlock;
        for (int blk = 0; blk < chunk_blocks; ++blk) {
          gather_list_block(k_state, blk * kBlock, list_valid, k_dst, k_seq_col, k_start, pending, tid);
        }
        // The next chunk's compaction would hold these back from the consumers.
        commit_all_but_newest(pending, tid);
        producer_sync<Config>();  // every thread is done reading the list
        if constexpr (!kScoreGradient) {
          // The entries past the whole blocks to the list's front. Source and
          // destination do not overlap once a block was taken; the next chunk's
          // compaction writes the list after a barrier (slot_list_positions).
          const int first_left = chunk_blocks * kBlock;
          carry = pad_last_block ? 0 : list_valid - first_left;  // 0..kBlock-1
          if (first_left > 0 && tid < carry) {
            ss.slot_index[tid] = ss.slot_index[first_left + tid];
            ss.slot_target[tid] = ss.slot_target[first_left + tid];
            ss.slot_key_row[tid] = ss.slot_key_row[first_left + tid];
          }
        }
      }
      if constexpr (!kScoreGradient) {
        if (!q_committed) commit_q();  // topk 0: no chunk
        // A forward row without a valid slot still sends the block that ends it:
        // zero-filled, every entry a tail entry.
        if (pending.count == 0) gather_list_block(k_state, 0, 0, k_dst, k_seq_col, k_start, pending, tid);
      }
      commit_all_but_newest(pending, tid);
      if (pending.count > 0) commit_oldest<0>(pending, true, tid);  // the row's last block
    }
  }
};

}  // namespace dsaib::hopper
