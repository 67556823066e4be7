// Producer role of the loss-and-gradient kernel. The CTA's rows are
// r_n = blockIdx.x + n * gridDim.x; step n gathers, in turn, the backward pass
// of r_{n-1} (as the P-free backward's producer, into the score role's ring) and
// the forward pass of r_n (as the loss forward's, in slot order, into the dK
// role's ring): r_n's block count, backward block 0, r_n's Q stage, forward
// block 0, backward block 1, ... Each pass compacts into its own slot list, so
// the two passes' chunks interleave freely; r_n's Q stage stays until its
// backward pass ends a step later (two Q stages).
#pragma once

#include "hopper/common/producer_gather.cuh"

namespace dsaib::hopper {

template <class Config>
struct LossAndGradProducer : ProducerGather<Config> {
  using Base = ProducerGather<Config>;
  using Element = typename Base::Element;
  static constexpr int kBlock = Base::kBlock;
  static constexpr int kThreads = Base::kThreads;
  static constexpr int kPerThread = Base::kPerThread;
  static constexpr int kGatherRows = Base::kGatherRows;
  static_assert(kFusesForward<Config>, "the producer of the loss-and-gradient kernels");

  MbarrierPipeline<Config::kForwardStages> f_pipe;  // the forward blocks' ring (this role fills it)

  /// One row's pass over its chunks, and where it stands.
  struct RowPass {
    RowSequence seq;
    const uint16_t* k_seq_col;  // this thread's column of the sequence's first key row
    int32_t k_start;
    const int32_t* ids;
    const float* attn_score;
    int num_chunks, next_chunk;
    int chunk_valid, chunk_blocks, blk;  // the compacted chunk: valid slots, blocks, blocks gathered
    bool reverse;                        // chunks last to first
  };

  __device__ RowPass begin_pass(int64_t row, bool reverse, int tid) const {
    const IndexerParams& p = this->p;
    RowPass r;
    r.seq = row_sequence(p, row);
    r.k_seq_col = key_row_ptr(p, r.seq.k_start) + Base::gather_col(tid);
    r.k_start = static_cast<int32_t>(r.seq.k_start);
    r.ids = p.topk_indices + batched_offset(row, p.q_rows_per_batch, p.ids_batch_stride, p.ids_row_stride);
    r.attn_score = p.attn_score + batched_offset(row, p.q_rows_per_batch, p.attn_score_batch_stride, p.attn_score_row_stride);
    r.num_chunks = (p.topk + Config::kSlotChunk - 1) / Config::kSlotChunk;
    r.next_chunk = 0;
    r.chunk_valid = r.chunk_blocks = r.blk = 0;
    r.reverse = reverse;
    return r;
  }

  /// The row's blocks of valid keys (each chunk pads its last block).
  __device__ int count_blocks(const RowPass& r, int tid) {
    int num_blocks = 0;
    for (int chunk0 = 0; chunk0 < this->p.topk; chunk0 += Config::kSlotChunk) {
      typename Base::SlotBatch s;
      this->template load_batch<false>(chunk0 + tid, r.seq, r.ids, r.attn_score, nullptr, s);
      int count = 0;
      CUTE_UNROLL
      for (int j = 0; j < kPerThread; ++j) count += s.key_row[j] >= 0 ? 1 : 0;
      int chunk_valid = 0;
      (void)this->warpgroup_exclusive_scan(count, &chunk_valid);
      producer_sync<Config>();  // producer_scan is reused
      num_blocks += (chunk_valid + kBlock - 1) / kBlock;
    }
    return num_blocks;
  }

  /// Compacts the pass's next chunk that has a valid slot into its list; the
  /// barrier inside slot_list_positions orders the writes after the previous
  /// list's reads.
  template <bool kForward>
  __device__ void compact_next_chunk(RowPass& r, float c, float eps, int tid) {
    do {
      const int ci = r.next_chunk++;
      const int chunk0 = (r.reverse ? r.num_chunks - 1 - ci : ci) * Config::kSlotChunk;
      typename Base::SlotBatch s;
      this->template load_batch<true>(chunk0 + tid, r.seq, r.ids, r.attn_score, nullptr, s);
      int pos[kPerThread];
      r.chunk_valid = slot_list_positions<kThreads, kPerThread>(s.key_row, pos, this->ss.producer_scan_rows, tid,
                                                                [] { producer_sync<Config>(); });
      CUTE_UNROLL
      for (int j = 0; j < kPerThread; ++j) {
        if (s.key_row[j] >= 0) {
          const float target = max_keeping_nan(s.attn_score[j], eps);
          if constexpr (kForward) {
            this->ss.fused.slot_index[pos[j]] = chunk0 + tid + j * kThreads;
            this->ss.fused.slot_target[pos[j]] = target;
            this->ss.fused.slot_key_row[pos[j]] = s.key_row[j];
          } else {
            this->ss.slot_gs[pos[j]] = -c * target;  // g~_i: masked by the score role
            this->ss.slot_key_row[pos[j]] = s.key_row[j];
          }
        }
      }
      producer_sync<Config>();  // list complete; producer_scan_rows read by every thread
      r.chunk_blocks = (r.chunk_valid + kBlock - 1) / kBlock;
      r.blk = 0;
    } while (r.chunk_blocks == 0);
  }

  // The block gathered last, committed once the next block's copies are issued
  // (two blocks of copies in flight), or by flush(): its ring's full barrier.
  uint64_t* pending_full = nullptr;

  __device__ void flush() {
    if (pending_full == nullptr) return;
    cute::cp_async_wait<0>();
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
    (void)cuda::ptx::mbarrier_arrive(pending_full);
    pending_full = nullptr;
  }

  /// The pass's next block into the next stage of its ring (k stages 0.. for the
  /// backward, kStagesK.. for the forward), while the pass has blocks left.
  template <bool kForward, int kStages>
  __device__ void gather_next(RowPass& r, const MbarrierPipeline<kStages>& pipe, PipelineState<kStages>& state,
                              Element* const (&k_dst)[kGatherRows], float c, float eps, int tid) {
    auto& ss = this->ss;
    if (r.blk == r.chunk_blocks) {
      flush();  // the consumers get the last block before this pass compacts
      compact_next_chunk<kForward>(r, c, eps, tid);
    }
    pipe.producer_acquire(state);
    const int s = state.index;
    const int first = r.blk * kBlock;
    if (tid < kBlock) {
      const bool in_list = first + tid < r.chunk_valid;
      if constexpr (kForward) {
        ss.fused.key_target[s][tid] = in_list ? ss.fused.slot_target[first + tid] : 0.0f;
        ss.fused.key_slot[s][tid] = in_list ? ss.fused.slot_index[first + tid] : -1;
      } else {
        ss.gs[s][tid] = in_list ? ss.slot_gs[first + tid] : 0.0f;
        ss.key_row[s][tid] = in_list ? ss.slot_key_row[first + tid] : -1;
      }
    }
    const int ks = kForward ? Config::kStagesK + s : s;
    this->gather_block(ks, first, r.chunk_valid, kForward ? ss.fused.slot_key_row : ss.slot_key_row, k_dst,
                       r.k_seq_col, r.k_start, tid);
    if (pending_full != nullptr) {
      cute::cp_async_wait<1>();  // all but the block just issued have landed
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
      (void)cuda::ptx::mbarrier_arrive(pending_full);
    }
    pending_full = &pipe.full[s];
    state.advance();
    ++r.blk;
  }

  __device__ void run() {
    const IndexerParams& p = this->p;
    const int tid = threadIdx.x;  // 0..127 in warpgroup 0
    const float c = loss_scale(p);
    const float eps = eps_exp_minus_100();
    Element* k_dst[kGatherRows];
    this->gather_destinations(k_dst, tid);
    auto k_state = make_producer_start_state<Config::kStagesK>();
    auto f_state = make_producer_start_state<Config::kForwardStages>();
    auto q_state = make_producer_start_state<Config::kStagesQ>();
    if (const uint64_t delay = start_delay_ns(p.start_stagger_max_ns, p.start_stagger_first_delayed_cta, blockIdx.x)) {
      const uint64_t start = cuda::ptx::get_sreg_globaltimer();
      while (cuda::ptx::get_sreg_globaltimer() - start < delay) __nanosleep(500);
    }
    const int nh = min(Config::kHeadTile, p.heads);  // one task per row: H <= kHeadTile
    bool backward_row = false;
    int64_t b_task = 0;
    int b_blocks = 0;
    for (uint32_t n = 0;; ++n) {
      const int64_t f_task = blockIdx.x + static_cast<int64_t>(n) * gridDim.x;
      const bool forward_row = f_task < p.num_tasks;
      if (!forward_row && !backward_row) break;
      this->prefetch_task(f_task + gridDim.x, tid);  // the next step's forward row
      RowPass f{}, b{};
      int f_blocks = 0;
      if (forward_row) {
        f = begin_pass(f_task, false, tid);
        f_blocks = count_blocks(f, tid);
      }
      // Odd waves of rows take the backward's chunks last to first (producer_gather.cuh).
      if (backward_row) b = begin_pass(b_task, ((b_task / gridDim.x) & 1) != 0, tid);
      const int nb = backward_row ? b_blocks : 0;
      // The backward row's first block goes out before the forward row's Q stage is
      // acquired (which waits for the row two steps back): the ring stays fed.
      const int early = min(nb, 1);
      for (int i = 0; i < early; ++i) gather_next<false>(b, this->k_pipe, k_state, k_dst, c, eps, tid);
      if (forward_row) {
        flush();  // the Q stage may wait for the consumers of the last block
        this->q_pipe.producer_acquire(q_state);
        const int qs = q_state.index;
        this->load_q(f_task, 0, nh, qs, tid);
        if (tid == 0) this->ss.num_blocks[qs] = f_blocks;
        cute::cp_async_wait<0>();                               // this thread's Q copies landed
        cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // ...and are visible to wgmma
        this->q_pipe.producer_commit(q_state);                  // every producer thread arrives
        q_state.advance();
      }
      const int both = min(nb, f_blocks);
      for (int i = 0; i < both; ++i) {
        if (i >= early) gather_next<false>(b, this->k_pipe, k_state, k_dst, c, eps, tid);
        gather_next<true>(f, f_pipe, f_state, k_dst, c, eps, tid);
      }
      for (int i = max(both, early); i < nb; ++i) gather_next<false>(b, this->k_pipe, k_state, k_dst, c, eps, tid);
      for (int i = both; i < f_blocks; ++i) gather_next<true>(f, f_pipe, f_state, k_dst, c, eps, tid);
      backward_row = forward_row;
      b_task = f_task;
      b_blocks = f_blocks;
    }
    flush();
  }
};

}  // namespace dsaib::hopper
