// The launch plans of every kernel family: which kernel (tile choice), its
// persistent grid, the start delays and L2 share of the backward, and where
// each part of the call's workspace lies. Computed from the validated problem,
// the options and the device's properties alone: host code without CUDA
// headers, so the CPU tests plan for an H200-like device without a GPU. The
// cuda backend queries the device once per call and launches from a plan.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/problem.hpp"
#include "hopper/common/l2_hints.hpp"
#include "hopper/common/start_stagger.hpp"

namespace dsaib::hopper {

/// Heads per backward task (TileConfig::kHeadTile; the backward's host code
/// asserts they agree): a query row with H heads is ceil(H / 64) tasks.
inline constexpr int64_t kHeadsPerTask = 64;

/// What a plan needs to know of the device, queried once per call.
struct DeviceProperties {
  /// SMs (cudaDevAttrMultiProcessorCount): 132 on the H200.
  int32_t sm_count = 0;
  /// L2 bytes (cudaDevAttrL2CacheSize): 60 MiB on the H200. 0 = unknown: no
  /// automatic L2 hints.
  int64_t l2_bytes = 0;
  /// The context's L2 set-aside for persisting lines in force
  /// (cudaLimitPersistingL2CacheSize). 0 when it cannot be queried.
  int64_t persisting_l2_bytes = 0;
  /// Resident CTAs per SM of the kernel the plan launches
  /// (cudaOccupancyMaxActiveBlocksPerMultiprocessor): 1 for every kernel here
  /// on the H200, whose shared memory or registers each fill an SM.
  int32_t ctas_per_sm = 1;
};

/// A persistent grid: min(tasks, SMs x resident CTAs per SM), 0 for no tasks.
int64_t persistent_grid(int64_t tasks, const DeviceProperties& device);

// ---------------------------------------------------------------------------
// The indexer backward (indexer_backward/).

/// One of the ten backward kernels: TileConfig<head_dim, split_a, l2_keep_dk,
/// fixed_point_dk>. Per head dim (64, 128): one bf16 term of a, two terms, one
/// term with the L2-hinted dK reds, and the fixed-point dK with one and with two
/// terms. The P-free kernels are PFreeConfig over the one- and two-term ones.
struct BackwardKernel {
  int32_t head_dim = 128;       // D
  bool split_a = false;         // a as two bf16 terms (AOperandPrecision)
  bool l2_keep_dk = false;      // dK reds with an L2 evict_last share (L2Hints; one term only)
  bool fixed_point_dk = false;  // deterministic d_index_k (IndexerOptions::deterministic)
};

/// The backward kernel's launch.
struct BackwardPlan {
  BackwardKernel kernel;
  /// Tasks per query row (ceil(H / kHeadsPerTask)) and in all (query rows x head_groups).
  int64_t head_groups = 0;
  int64_t num_tasks = 0;
  /// Persistent CTAs (persistent_grid).
  int64_t grid = 0;
  /// Start delays of the CTAs with a task fewer (start_stagger.hpp); none with
  /// StartStagger::off.
  StartDelays start_delays;
  /// The L2-hinted kernel's evict_last share of the dK reds (l2_hints.hpp);
  /// f035 (ignored) for the other kernels.
  L2KeepFraction l2_keep_fraction = L2KeepFraction::f035;
  /// Scratch bytes of the kernel (workspace_bytes below).
  std::size_t workspace_bytes = 0;
  /// The device it was planned for.
  DeviceProperties device;
};

/// Whether the a operand runs as two bf16 terms: bf16x2 always, bf16 never,
/// automatic when d_index_q or d_index_k is f32.
bool a_operand_split(AOperandPrecision precision, DType d_index_q, DType d_index_k);

/// Offset of the DkFixedBound in the deterministic workspace: after the int64
/// (num_k_rows, D) accumulator (fixed_point_dk.cuh), rounded up to 256 bytes.
std::size_t dk_fixed_bound_offset(int64_t num_k_rows, int64_t head_dim);

/// Bytes of the deterministic workspace: the accumulator, then the bound.
std::size_t dk_fixed_workspace_bytes(int64_t num_k_rows, int64_t head_dim);

/// Scratch bytes of the backward kernel: deterministic, dk_fixed_workspace_bytes;
/// else the fp32 dK accumulator (num_k_rows x D x 4) for a bf16 d_index_k, 0 for f32.
std::size_t workspace_bytes(const detail::ProblemGeometry& g, DType d_index_k, bool deterministic);

/// The backward kernel's plan: `g` from validation, the output dtypes, the
/// options (a_operand_precision, deterministic, l2_hints, start_stagger) and
/// the device (ctas_per_sm: the backward kernel's). Reads nothing else.
/// Throws Error(invalid_argument, "index_k") for 2^31 key rows or more (or a topk
/// that large), which the kernels' 32-bit row ids cannot address.
BackwardPlan plan_backward(const detail::ProblemGeometry& g, DType d_index_q, DType d_index_k,
                           const IndexerOptions& options, const DeviceProperties& device);

// ---------------------------------------------------------------------------
// The loss forward (kl_forward/).

/// The loss forward's kernel: ForwardTileConfig<head_dim, head_tile>, the head
/// tile holding every head of a row (32 for H <= 32, 64 for H <= 64, else 128); or, given the
/// top-k's logits (`from_logits`), the kernel that reads them and runs no GEMM
/// (kl_forward_from_logits_kernel.cuh).
struct ForwardKernel {
  int32_t head_dim = 128;
  int32_t head_tile = 64;
  bool from_logits = false;
};
ForwardKernel forward_kernel_for(const detail::ProblemGeometry& g, bool from_logits = false);

/// The loss forward's launch and its workspace: the fp64 row loss terms, then
/// (recomputing the logits) the z scratch rows of its grid (topk rounded up to
/// 64 floats each).
struct ForwardPlan {
  ForwardKernel kernel;
  int64_t grid = 0;  // persistent_grid over the query rows
  std::size_t loss_terms_at = 0, z_scratch_at = 0;
  int64_t z_stride = 0;
  std::size_t workspace_bytes = 0;
  DeviceProperties device;  // ctas_per_sm: the forward kernel's
};
/// `device`: with the resident CTAs of forward_kernel_for(g, from_logits).
ForwardPlan plan_kl_forward(const detail::ProblemGeometry& g, const DeviceProperties& device,
                            bool from_logits = false);

// ---------------------------------------------------------------------------
// indexer_backward() on cuda: the backward kernel, with what the P-free form
// adds around it.

/// The P-free backward (index_score absent) runs the loss forward's kernel
/// first to write P into the workspace when the P-free kernels do not apply: H
/// above one task's 64 heads (z sums over every head of the row), or deterministic.
bool p_free_needs_prepass(bool p_free, const detail::ProblemGeometry& g, const IndexerOptions& options);

/// A backward call's plan and workspace. P form: the kernel's workspace alone.
/// P-free with the P-free kernels: the packed row statistics (LSE, mass) per
/// row, then the kernel's. P-free with the prepass: the kernel's, then P, the
/// row statistics, the loss and the forward's workspace (`forward`).
struct BackwardCallPlan {
  BackwardPlan kernel;       // the P-free kernels' when p_free_kernels (no L2 hint)
  bool p_free_kernels = false;
  bool prepass = false;
  ForwardPlan forward;       // the prepass's
  std::size_t packed_stats_at = 0, kernel_at = 0;
  std::size_t p_at = 0, lse_at = 0, mass_at = 0, loss_at = 0, forward_at = 0;
  std::size_t workspace_bytes = 0;
};
/// `backward` and `forward`: the device with the resident CTAs of the backward
/// and the forward kernel.
BackwardCallPlan plan_backward_call(const detail::ProblemGeometry& g, DType d_index_q, DType d_index_k,
                                    const IndexerOptions& options, bool p_free, const DeviceProperties& backward,
                                    const DeviceProperties& forward);

// ---------------------------------------------------------------------------
// indexer_kl_loss_and_grad() on cuda (loss_and_grad/).

/// The loss-and-gradient kernel applies (forward_fusion automatic): H <= 64,
/// one A term, the fp32 dK of atomics, and the logits recomputed (not given
/// as topk_logits: then the forward is the from-logits kernel's, before the
/// backward).
bool loss_and_grad_in_one_kernel(const detail::ProblemGeometry& g, DType d_index_q, DType d_index_k,
                                 const IndexerOptions& options, bool from_logits = false);

/// The one call's plan and workspace. One kernel: the P-free backward's plan
/// (its grid and start delays), and the row statistics (LSE, mass), the row
/// loss terms, the z scratch rows of its grid and the fp32 dK accumulator (bf16
/// d_index_k). Two kernels: the row statistics, with H > 64 or deterministic P,
/// then the scratch the forward and the backward use one after the other.
struct LossAndGradPlan {
  bool one_kernel = false;
  BackwardPlan kernel;          // one kernel
  ForwardPlan forward;          // two kernels
  BackwardCallPlan backward;    // two kernels: the P-free kernels, or the P form over P
  bool with_p = false;          // two kernels: P in the workspace
  std::size_t lse_at = 0, mass_at = 0, p_at = 0;
  std::size_t loss_terms_at = 0, z_scratch_at = 0, dk_at = 0;  // one kernel
  int64_t z_stride = 0;
  std::size_t scratch_at = 0;   // two kernels
  std::size_t workspace_bytes = 0;
};
/// `backward`, `forward`: the device with the resident CTAs of the backward
/// and the forward kernel (the loss-and-gradient kernel runs on the P-free
/// backward's grid, one CTA per SM).
LossAndGradPlan plan_loss_and_grad(const detail::ProblemGeometry& g, DType d_index_q, DType d_index_k,
                                   const IndexerOptions& options, const DeviceProperties& backward,
                                   const DeviceProperties& forward, bool from_logits = false);

// ---------------------------------------------------------------------------
// The attention target (attention_target/).

/// AttentionTargetConfig<heads_padded, max_slices, selected_lse>: Hq rounded up
/// to 64 or 128, Dqk / 64 rounded up to 3 (Dqk <= 192) or 9 slices; selected_lse
/// when no lse is given (each row's keys swept twice), set by the backend.
struct TargetKernel {
  int32_t heads_padded = 64;
  int32_t max_slices = 9;
  bool selected_lse = false;
};
TargetKernel target_kernel_for(const detail::ProblemGeometry& g);

/// The target's launch; it needs no workspace.
struct TargetPlan {
  TargetKernel kernel;
  int64_t grid = 0;  // persistent_grid over the query rows
  std::size_t workspace_bytes = 0;
  DeviceProperties device;
};
/// Throws Error(invalid_argument) naming "kv" for 2^31 key rows or more and
/// "topk_indices" for topk of 2^30 or more, which its 32-bit offsets cannot
/// address (check_attention_target_limits, also run alone before the device is
/// queried).
void check_attention_target_limits(const detail::ProblemGeometry& g);
TargetPlan plan_attention_target(const detail::ProblemGeometry& g, const DeviceProperties& device);

// ---------------------------------------------------------------------------
// The indexer's top-k forward (indexer_topk/).

/// The largest topk the cuda backend selects (its ordering kernel sorts a row
/// in one CTA of at most 512 threads x 16 keys).
inline constexpr int64_t kMaxCudaTopk = 8192;

/// One task = rows_per_task consecutive query rows whose heads, padded to
/// head_tile, fill 256 columns (two score warpgroups' wgmma N of 128), against
/// every key tile the rows see; persistent grid. The workspace: each CTA's
/// candidate buffers (rows_per_task x 2 halves x candidate_capacity 8-byte keys),
/// then, when the caller wants no logits, the high words of each row's
/// selection (num_q_rows x topk x 4 bytes), and, without topk_lengths, the rows'
/// counts (num_q_rows x 4 bytes); docs/indexer-topk.md, "Memory".
struct TopkPlan {
  int32_t head_dim = 128;
  int32_t head_tile = 64;       // H padded: 32, 64 or 128
  bool e4m3 = false;            // float8 index_q and index_k (D 128): the e4m3 kernel
  int32_t rows_per_task = 4;    // 256 / head_tile
  int32_t candidate_capacity = 0;  // keys in one buffer half: 2 max(topk, 128) + 64
  int64_t num_tasks = 0;
  int64_t grid = 0;             // persistent_grid over the tasks
  int64_t order_grid = 0;       // CTAs of the ordering kernel (rows in a grid-stride loop)
  std::size_t candidates_at = 0, key_hi_at = 0, row_count_at = 0;
  bool key_hi_in_workspace = false, row_count_in_workspace = false;
  std::size_t workspace_bytes = 0;
  DeviceProperties device;
};
/// For a problem that validate_topk_problem() accepted on the cuda backend (its
/// limits: H a multiple of 8 up to 128, D 64 or 128, topk up to kMaxCudaTopk,
/// key rows below 2^31).
/// `with_logits` / `with_lengths`: the caller gave topk_logits / topk_lengths,
/// which then hold the selection between the two kernels.
/// `e4m3`: float8 index_q and index_k.
TopkPlan plan_indexer_topk(const detail::ProblemGeometry& g, bool with_logits, bool with_lengths,
                           const DeviceProperties& device, bool e4m3 = false);

}  // namespace dsaib::hopper

namespace dsaib::detail {

/// The backward kernel's plan of this call now: validates like
/// indexer_backward() (options.backend must be cuda), queries the device of
/// index_q as a call does, and returns its plan. Launches, allocates and
/// writes nothing. Raises indexer_backward()'s errors, and invalid_argument
/// naming "backend" for a cpu backend.
hopper::BackwardPlan plan_indexer_backward(const IndexerInputs& inputs, const IndexerBackwardOutputs& outputs,
                                           const IndexerOptions& options);

}  // namespace dsaib::detail
