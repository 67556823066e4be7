// The ABI between the host launch layer and the sm_90a kernels: plain pointers,
// sizes and strides (in elements). Filled by launch/problem_params.hpp.
#pragma once

#include <cstdint>

namespace dsaib::hopper {

/// The deterministic d_index_k's scale (fixed_point_dk.cuh), written by the bound
/// pass before the backward kernel: the largest per-row bound on the sum of the
/// magnitudes of a row's dK contributions (an fp64's bits: non-negative doubles
/// order as unsigned integers, so atomicMax keeps the largest, in any order),
/// and whether a row's bound was not finite. Zeroed before the pass.
struct DkFixedBound {
  unsigned long long max_row_bound_bits;
  unsigned int non_finite;
  unsigned int reserved;
};

struct IndexerParams {
  // Inputs. A flat query row r lives at (r / q_rows_per_batch) * *_batch_stride +
  // (r % q_rows_per_batch) * *_row_stride; THD sets q_rows_per_batch = T_q and
  // batch strides 0. Same for key rows with k_rows_per_batch.
  const uint16_t* index_q;  // bf16
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  const void* weights;  // bf16 or f32
  int64_t w_batch_stride, w_row_stride;
  const uint16_t* index_k;  // bf16
  int64_t k_batch_stride, k_row_stride;
  const int32_t* topk_indices;
  int64_t ids_batch_stride, ids_row_stride;
  const float* attn_score;  // T
  int64_t attn_score_batch_stride, attn_score_row_stride;
  // P. The P-free kernels (PFreeConfig) read here instead the row
  // statistics packed by the host, (LSE, row_target_mass) of flat row r as the
  // float2 at index r; its strides are then unused.
  const float* index_score;
  int64_t index_score_batch_stride, index_score_row_stride;
  const int32_t* cu_seqlens_q;  // THD only (B + 1), device
  const int32_t* cu_seqlens_k;

  int64_t num_q_rows, q_rows_per_batch;
  int64_t num_k_rows, k_rows_per_batch;
  int32_t batch, heads, head_dim, topk;
  int32_t head_groups;  // ceil(heads / kHeadTile)
  int64_t num_tasks;    // num_q_rows * head_groups
  bool thd, global_ids, weights_f32;

  // c = grad_loss * loss_coeff / N, with grad_loss read in the kernel.
  float sm_scale;
  float loss_coeff_over_n;
  const float* grad_loss_ptr;  // device scalar or null
  float grad_loss_value;

  // Outputs (contiguous).
  void* d_index_q;  // (num_q_rows, H, D)
  void* d_weights;  // (num_q_rows, H)
  bool dq_f32, dw_f32;
  float* dk_accum;  // (num_k_rows, D) fp32, zeroed before the kernel

  // Start delays of the persistent CTAs (start_stagger.hpp): CTA b waits
  // start_delay_ns(start_stagger_max_ns, start_stagger_first_delayed_cta, b)
  // before its first task. From the launch plan (launch_plan.hpp); 0 = none.
  uint32_t start_stagger_max_ns;
  int64_t start_stagger_first_delayed_cta;

  // The L2-hinted kernels' evict_last share of the dK reds: an L2KeepFraction
  // (l2_hints.hpp) from the launch plan; the other kernels ignore it. After the
  // fields every kernel reads, so that adding it moved none of their offsets.
  int32_t l2_keep_fraction = 0;

  // The deterministic kernels (TileConfig::kFixedPointDk, options.deterministic):
  // the scatter role adds round(v * 2^E) to int64 dk_fixed (num_k_rows, D) instead
  // of v to dk_accum, with E from *dk_bound (fixed_point_dk.cuh). Null otherwise.
  unsigned long long* dk_fixed = nullptr;
  const DkFixedBound* dk_bound = nullptr;
};

/// The loss forward's parameters: the inputs as the backward's producer reads
/// them (head_groups 1, num_tasks = query rows, no index_score), the outputs and
/// the workspace.
struct IndexerKLForwardParams {
  IndexerParams in;
  float* row_lse;          // (num_q_rows)
  float* row_target_mass;  // (num_q_rows): sum T~ [Pb >= eps] / sum Pb, Pb = exp(z - row_lse) (forward_score.cuh)
  float* index_score;      // (num_q_rows, topk) contiguous, or null
  double* loss_terms;      // (num_q_rows) workspace: sum_i T~_i log(max(P_i, eps)) per row
  float* z_scratch;        // (gridDim.x, z_stride) workspace: a row's logits by slot
  int64_t z_stride;
  // The forward from the top-k's logits (kl_forward_from_logits_kernel.cuh):
  // I of each slot, rows as attn_score's; null for the kernels that recompute them.
  const float* topk_logits;
  int64_t topk_logits_batch_stride, topk_logits_row_stride;
};

/// The indexer top-k forward's parameters (indexer_topk/). Query and key rows
/// are flat as in IndexerParams; THD sets *_rows_per_batch to the row counts
/// and the batch strides to 0.
struct IndexerTopkParams {
  const void* index_q;  // bf16 or e4m3 (the kernel's Element)
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  const void* weights;  // bf16 or f32, heads contiguous
  int64_t w_batch_stride, w_row_stride;
  const void* index_k;  // index_q's dtype
  int64_t k_batch_stride, k_row_stride;
  // e4m3 only, each null when absent: f32 index_q_scale (rows, heads contiguous)
  // and index_k_scale (key rows), rows as the other tensors'.
  const float* index_q_scale;
  int64_t qs_batch_stride, qs_row_stride;
  const float* index_k_scale;
  int64_t ks_batch_stride, ks_row_stride;
  // Visible ranges [starts, ends) per query row (null: causal), in the
  // sequence's key coordinates: BSHD positions in [0, S_kv), THD flat key rows.
  const int32_t* starts;
  int64_t starts_batch_stride, starts_row_stride;
  const int32_t* ends;
  int64_t ends_batch_stride, ends_row_stride;
  const int32_t* cu_seqlens_q;  // THD only (B + 1), device
  const int32_t* cu_seqlens_k;

  int64_t num_q_rows, q_rows_per_batch;
  int64_t num_k_rows, k_rows_per_batch;
  int32_t batch, heads, topk;
  bool thd, global_ids, weights_f32, id_ascending, causal_offset_auto;
  int64_t causal_offset;  // used when !causal_offset_auto and starts is null

  int32_t rows_per_task;  // consecutive flat query rows per task
  int64_t num_tasks;      // ceil(num_q_rows / rows_per_task)

  // Each CTA's candidate buffers: (gridDim.x, 2 warpgroups, rows_per_task, 2
  // halves, candidate_capacity) 64-bit rank keys (topk_rank_key.cuh).
  unsigned long long* candidates;
  int32_t candidate_capacity;

  // A row's selection between the two kernels, unordered: the low and high
  // words of its rank keys in (num_q_rows, topk) (the memory of topk_indices
  // and of topk_logits or the workspace), its count in row_count (topk_lengths
  // or the workspace). The ordering kernel rewrites them in place as ids and
  // logits.
  uint32_t* key_lo;
  uint32_t* key_hi;
  int32_t* row_count;
  bool write_logits;  // key_hi is topk_logits: the ordering kernel writes the logits there
};

}  // namespace dsaib::hopper
