// The launch plans of every kernel family (launch_plan.hpp): host code, built
// with or without CUDA.
#include "hopper/launch/launch_plan.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "hopper/common/kernel_params.hpp"
#include "hopper/launch/workspace.hpp"

namespace dsaib::hopper {

int64_t persistent_grid(int64_t tasks, const DeviceProperties& device) {
  const int64_t resident = static_cast<int64_t>(device.sm_count) * device.ctas_per_sm;
  return tasks > 0 ? std::min(tasks, resident) : 0;
}

bool a_operand_split(AOperandPrecision precision, DType d_index_q, DType d_index_k) {
  switch (precision) {
    case AOperandPrecision::bf16x2: return true;
    case AOperandPrecision::bf16: return false;
    case AOperandPrecision::automatic: break;
  }
  return d_index_q == DType::f32 || d_index_k == DType::f32;
}

std::size_t dk_fixed_bound_offset(int64_t num_k_rows, int64_t head_dim) {
  const std::size_t acc = static_cast<std::size_t>(num_k_rows * head_dim) * sizeof(unsigned long long);
  return (acc + 255) / 256 * 256;
}

std::size_t dk_fixed_workspace_bytes(int64_t num_k_rows, int64_t head_dim) {
  return dk_fixed_bound_offset(num_k_rows, head_dim) + sizeof(DkFixedBound);
}

std::size_t workspace_bytes(const detail::ProblemGeometry& g, DType d_index_k, bool deterministic) {
  if (deterministic) return dk_fixed_workspace_bytes(g.num_k_rows, g.head_dim);
  return d_index_k == DType::bf16 ? static_cast<std::size_t>(g.num_k_rows * g.head_dim) * sizeof(float) : 0;
}

BackwardPlan plan_backward(const detail::ProblemGeometry& g, DType d_index_q, DType d_index_k,
                       const IndexerOptions& options, const DeviceProperties& device) {
  detail::check_cuda_key_rows(g);  // validation raised it already; a plan of a geometry made by hand too
  BackwardPlan plan;
  plan.device = device;
  plan.kernel.head_dim = static_cast<int32_t>(g.head_dim);
  plan.kernel.split_a = a_operand_split(options.a_operand_precision, d_index_q, d_index_k);
  plan.kernel.fixed_point_dk = options.deterministic;
  plan.head_groups = (g.heads + kHeadsPerTask - 1) / kHeadsPerTask;
  plan.num_tasks = g.num_q_rows * plan.head_groups;
  plan.workspace_bytes = workspace_bytes(g, d_index_k, options.deterministic);

  // The L2 hint (l2_hints.hpp): one-term, non-deterministic kernels only.
  if (!plan.kernel.split_a && !plan.kernel.fixed_point_dk && options.l2_hints != L2Hints::off &&
      l2_hints_for_launch(options.l2_hints, g.q_len, g.k_len, plan.head_groups, device.sm_count, device.l2_bytes,
                          g.head_dim, device.persisting_l2_bytes)) {
    plan.kernel.l2_keep_dk = true;
    const int64_t key_rows = key_rows_for_launch(g.q_len, g.k_len, plan.head_groups, device.sm_count,
                                                 WindowStart::first_row);
    plan.l2_keep_fraction = l2_keep_fraction(device.persisting_l2_bytes, key_rows, g.head_dim);
  }

  // The persistent grid, then the start delays for it (start_stagger.hpp).
  plan.grid = persistent_grid(plan.num_tasks, device);
  if (options.start_stagger == StartStagger::automatic) {
    plan.start_delays = start_delays_for_launch(plan.num_tasks, plan.grid, plan.head_groups, g.topk, g.q_len, g.k_len,
                                                g.head_dim);
  }
  return plan;
}


ForwardKernel forward_kernel_for(const detail::ProblemGeometry& g, bool from_logits) {
  return ForwardKernel{static_cast<int32_t>(g.head_dim), g.heads <= 32 ? 32 : g.heads <= 64 ? 64 : 128, from_logits};
}

ForwardPlan plan_kl_forward(const detail::ProblemGeometry& g, const DeviceProperties& device, bool from_logits) {
  detail::check_cuda_key_rows(g);  // validation raised it already
  ForwardPlan plan;
  plan.kernel = forward_kernel_for(g, from_logits);
  plan.device = device;
  plan.grid = persistent_grid(g.num_q_rows, device);
  WorkspaceCarver ws;
  plan.loss_terms_at = ws.add(static_cast<std::size_t>(g.num_q_rows) * sizeof(double));
  if (!from_logits) {  // the given logits are read where they lie
    plan.z_stride = (g.topk + 63) / 64 * 64;
    plan.z_scratch_at = ws.add(static_cast<std::size_t>(plan.grid * plan.z_stride) * sizeof(float));
  }
  plan.workspace_bytes = ws.total();
  return plan;
}

bool p_free_needs_prepass(bool p_free, const detail::ProblemGeometry& g, const IndexerOptions& options) {
  return p_free && (g.heads > kHeadsPerTask || options.deterministic);
}

BackwardCallPlan plan_backward_call(const detail::ProblemGeometry& g, DType d_index_q, DType d_index_k,
                                    const IndexerOptions& options, bool p_free, const DeviceProperties& backward,
                                    const DeviceProperties& forward) {
  BackwardCallPlan plan;
  plan.prepass = p_free_needs_prepass(p_free, g, options);
  plan.p_free_kernels = p_free && !plan.prepass;
  IndexerOptions kernel_options = options;
  if (plan.p_free_kernels) kernel_options.l2_hints = L2Hints::off;  // the P-free kernels have no hinted variant
  plan.kernel = plan_backward(g, d_index_q, d_index_k, kernel_options, backward);
  WorkspaceCarver ws;
  if (plan.p_free_kernels) {
    plan.packed_stats_at = ws.add(static_cast<std::size_t>(g.num_q_rows) * 2 * sizeof(float));  // float2 per row
  }
  plan.kernel_at = ws.add(plan.kernel.workspace_bytes);
  if (plan.prepass) {
    plan.forward = plan_kl_forward(g, forward);
    const std::size_t rows = static_cast<std::size_t>(g.num_q_rows) * sizeof(float);
    plan.p_at = ws.add(rows * static_cast<std::size_t>(g.topk));
    plan.lse_at = ws.add(rows);
    plan.mass_at = ws.add(rows);
    plan.loss_at = ws.add(sizeof(float));
    plan.forward_at = ws.add(plan.forward.workspace_bytes);
  }
  plan.workspace_bytes = ws.total();
  return plan;
}

bool loss_and_grad_in_one_kernel(const detail::ProblemGeometry& g, DType d_index_q, DType d_index_k,
                                 const IndexerOptions& options, bool from_logits) {
  return !from_logits && options.forward_fusion == ForwardFusion::automatic && g.heads <= kHeadsPerTask &&
         !options.deterministic && !a_operand_split(options.a_operand_precision, d_index_q, d_index_k);
}

LossAndGradPlan plan_loss_and_grad(const detail::ProblemGeometry& g, DType d_index_q, DType d_index_k,
                                   const IndexerOptions& options, const DeviceProperties& backward,
                                   const DeviceProperties& forward, bool from_logits) {
  LossAndGradPlan plan;
  plan.one_kernel = loss_and_grad_in_one_kernel(g, d_index_q, d_index_k, options, from_logits);
  const std::size_t rows = static_cast<std::size_t>(g.num_q_rows) * sizeof(float);
  WorkspaceCarver ws;
  plan.lse_at = ws.add(rows);
  plan.mass_at = ws.add(rows);
  if (plan.one_kernel) {
    IndexerOptions p_free = options;
    p_free.l2_hints = L2Hints::off;  // the P-free backward's plan
    plan.kernel = plan_backward(g, d_index_q, d_index_k, p_free, backward);
    plan.z_stride = (g.topk + 63) / 64 * 64;
    plan.loss_terms_at = ws.add(static_cast<std::size_t>(g.num_q_rows) * sizeof(double));
    plan.z_scratch_at = ws.add(static_cast<std::size_t>(plan.kernel.grid * plan.z_stride) * sizeof(float));
    if (d_index_k == DType::bf16) {
      plan.dk_at = ws.add(static_cast<std::size_t>(g.num_k_rows * g.head_dim) * sizeof(float));
    }
    plan.workspace_bytes = ws.total();
    return plan;
  }
  plan.with_p = g.heads > kHeadsPerTask || options.deterministic;
  if (plan.with_p) plan.p_at = ws.add(rows * static_cast<std::size_t>(g.topk));
  plan.forward = plan_kl_forward(g, forward, from_logits);
  // With P the backward takes the P form; else the P-free kernels (H <= 64, not deterministic).
  plan.backward = plan_backward_call(g, d_index_q, d_index_k, options, !plan.with_p, backward, forward);
  plan.scratch_at = ws.add(std::max(plan.forward.workspace_bytes, plan.backward.workspace_bytes));
  plan.workspace_bytes = ws.total();
  return plan;
}

TargetKernel target_kernel_for(const detail::ProblemGeometry& g) {
  return TargetKernel{g.heads <= 64 ? 64 : 128, g.head_dim <= 192 ? 3 : 9};
}

void check_attention_target_limits(const detail::ProblemGeometry& g) {
  if (g.num_k_rows > std::numeric_limits<int32_t>::max()) {
    throw Error(ErrorCode::invalid_argument, "kv",
                "kv: expected fewer than 2^31 key rows on the cuda backend, got " + std::to_string(g.num_k_rows));
  }
  if (g.topk > std::numeric_limits<int32_t>::max() / 2) {
    throw Error(ErrorCode::invalid_argument, "topk_indices",
                "topk_indices: expected topk below 2^30 on the cuda backend, got " + std::to_string(g.topk));
  }
}

TargetPlan plan_attention_target(const detail::ProblemGeometry& g, const DeviceProperties& device) {
  check_attention_target_limits(g);
  TargetPlan plan;
  plan.kernel = target_kernel_for(g);
  plan.device = device;
  plan.grid = persistent_grid(g.num_q_rows, device);
  return plan;  // no workspace: the kernel keeps everything in shared memory and the output
}

TopkPlan plan_indexer_topk(const detail::ProblemGeometry& g, bool with_logits, bool with_lengths,
                           const DeviceProperties& device, bool e4m3) {
  TopkPlan plan;
  plan.device = device;
  plan.e4m3 = e4m3;
  plan.head_dim = static_cast<int32_t>(g.head_dim);
  plan.head_tile = g.heads <= 32 ? 32 : g.heads <= 64 ? 64 : 128;
  plan.rows_per_task = 256 / plan.head_tile;
  // A buffer takes one tile's appends (64 keys) past its trigger, capacity -
  // 64; a cut keeps at most topk + (capacity - 64 - topk) / 2 (about 1.5 topk),
  // so about topk / 2 appends fit between cuts.
  plan.candidate_capacity = static_cast<int32_t>(2 * std::max<int64_t>(g.topk, 128) + 64);
  plan.num_tasks = (g.num_q_rows + plan.rows_per_task - 1) / plan.rows_per_task;
  plan.grid = persistent_grid(plan.num_tasks, device);
  plan.order_grid = std::min<int64_t>(g.num_q_rows, std::max<int64_t>(1, int64_t{device.sm_count} * 16));
  WorkspaceCarver carver;
  // Each row of a task belongs to one score warpgroup: rows_per_task rows x 2 halves per CTA.
  const std::size_t buffers_per_cta = static_cast<std::size_t>(plan.rows_per_task) * 2 *
                                      static_cast<std::size_t>(plan.candidate_capacity) * sizeof(unsigned long long);
  plan.candidates_at = carver.add(static_cast<std::size_t>(plan.grid) * buffers_per_cta);
  plan.key_hi_in_workspace = !with_logits;
  plan.row_count_in_workspace = !with_lengths;
  if (plan.key_hi_in_workspace) {
    plan.key_hi_at = carver.add(static_cast<std::size_t>(g.num_q_rows) * static_cast<std::size_t>(g.topk) * 4);
  }
  if (plan.row_count_in_workspace) plan.row_count_at = carver.add(static_cast<std::size_t>(g.num_q_rows) * 4);
  plan.workspace_bytes = plan.grid > 0 ? carver.total() : 0;
  return plan;
}

}  // namespace dsaib::hopper
