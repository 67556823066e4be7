// The cuda backend's launch plan (launch_plan.hpp): host code, built with or
// without CUDA.
#include "hopper/launch/launch_plan.hpp"

#include <algorithm>
#include <string>

#include "hopper/common/kernel_params.hpp"

namespace dsaib::hopper {

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

LaunchPlan plan_launch(const detail::ProblemGeometry& g, DType d_index_q, DType d_index_k,
                       const IndexerOptions& options, const DeviceProperties& device) {
  detail::check_cuda_key_rows(g);  // validation raised it already; a plan of a geometry made by hand too
  LaunchPlan plan;
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
  const int64_t resident = static_cast<int64_t>(device.sm_count) * device.ctas_per_sm;
  plan.grid = plan.num_tasks > 0 ? std::min(plan.num_tasks, resident) : 0;
  if (options.start_stagger == StartStagger::automatic) {
    plan.start_delays = start_delays_for_launch(plan.num_tasks, plan.grid, plan.head_groups, g.topk, g.q_len, g.k_len,
                                                g.head_dim);
  }
  return plan;
}

}  // namespace dsaib::hopper
