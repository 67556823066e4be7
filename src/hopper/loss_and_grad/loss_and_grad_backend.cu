// indexer_kl_loss_and_grad() on cuda (api/cuda_backend.hpp): the loss and the
// gradients in the loss-and-gradient kernel where it applies
// (loss_and_grad_in_one_kernel), else the loss forward's kernel (from the
// top-k's logits when they are given) writing the row statistics (and, with
// H > 64 or deterministic, P) into the workspace and the backward from them.
// No host synchronisation.
#include <cuda_runtime.h>

#include "api/cuda_backend.hpp"
#include "hopper/common/cuda_check.hpp"
#include "hopper/common/device_cu_seqlens.hpp"
#include "hopper/common/support_kernels.hpp"
#include "hopper/indexer_backward/indexer_backward_backend.hpp"
#include "hopper/kl_forward/kl_forward_backend.hpp"
#include "hopper/launch/device.hpp"
#include "hopper/launch/problem_params.hpp"
#include "hopper/loss_and_grad/launch.hpp"

namespace dsaib::hopper {
namespace {

/// The loss-and-gradient kernel: dK zeroed, the kernel, the loss terms' sum,
/// the bf16 cast of dK.
void run_one_kernel(const LossAndGradPlan& plan, const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                    const IndexerOptions& opt, const detail::ProblemGeometry& g, char* ws, cudaStream_t stream) {
  const BackwardPlan& kp = plan.kernel;
  const bool dk_bf16 = out.d_index_k.dtype == DType::bf16;
  float* dk_accum = dk_bf16 ? reinterpret_cast<float*>(ws + plan.dk_at) : static_cast<float*>(out.d_index_k.data);
  const std::size_t dk_bytes = static_cast<std::size_t>(g.num_k_rows * g.head_dim) * sizeof(float);
  IndexerKLForwardParams params{};
  IndexerInputs p_free = in;
  p_free.index_score = {};
  params.in = indexer_params(p_free, {out.d_index_q, out.d_weights, out.d_index_k}, opt, g, kp.head_groups, dk_accum);
  params.in.index_score = nullptr;
  params.in.index_score_batch_stride = params.in.index_score_row_stride = 0;
  params.in.start_stagger_max_ns = kp.start_delays.max_ns;
  params.in.start_stagger_first_delayed_cta = kp.start_delays.first_delayed_cta;
  params.in.l2_keep_fraction = static_cast<int32_t>(kp.l2_keep_fraction);
  params.row_lse = reinterpret_cast<float*>(ws + plan.lse_at);
  params.row_target_mass = reinterpret_cast<float*>(ws + plan.mass_at);
  params.index_score = nullptr;
  params.loss_terms = reinterpret_cast<double*>(ws + plan.loss_terms_at);
  params.z_scratch = reinterpret_cast<float*>(ws + plan.z_scratch_at);
  params.z_stride = plan.z_stride;
  if (dk_bytes > 0) cuda_check(cudaMemsetAsync(dk_accum, 0, dk_bytes, stream), "cudaMemsetAsync (dK accumulator)");
  if (g.head_dim == 64) launch_indexer_kl_loss_and_grad<64>(params, kp.grid, stream);
  else launch_indexer_kl_loss_and_grad<128>(params, kp.grid, stream);
  const double coeff_over_n = static_cast<double>(opt.loss_coeff) / static_cast<double>(g.normalization_count);
  launch_sum_loss_terms(params.loss_terms, g.num_q_rows, coeff_over_n, static_cast<float*>(out.loss.data), stream);
  if (dk_bf16) launch_cast_dk_to_bf16(dk_accum, out.d_index_k.data, g.num_k_rows * g.head_dim, stream);
}

/// The loss forward into the workspace (the row statistics, with H > 64 or
/// deterministic P too, then its scratch), then the backward from them.
void run_two_kernels(const LossAndGradPlan& plan, const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                     const IndexerOptions& opt, const detail::ProblemGeometry& g, char* ws, cudaStream_t stream) {
  const int device = in.index_q.device_index;
  IndexerKLForwardOutputs fwd;
  fwd.loss = out.loss;
  fwd.row_lse = rows_view(ws + plan.lse_at, g, device);
  fwd.row_target_mass = rows_view(ws + plan.mass_at, g, device);
  if (plan.with_p) fwd.index_score = rows_view(ws + plan.p_at, g, device, g.topk);
  run_kl_forward_kernel(plan.forward, in, fwd, opt, g, ws + plan.scratch_at, stream);
  IndexerInputs bwd_in = in;
  bwd_in.topk_logits = {};  // the backward recomputes its logits
  if (plan.with_p) {
    bwd_in.index_score = fwd.index_score;
  } else {
    bwd_in.index_score = {};
    bwd_in.row_lse = fwd.row_lse;
    bwd_in.row_target_mass = fwd.row_target_mass;
  }
  run_backward_kernel(plan.backward, bwd_in, {out.d_index_q, out.d_weights, out.d_index_k}, opt, g,
                      ws + plan.scratch_at, stream);
}

}  // namespace
}  // namespace dsaib::hopper

namespace dsaib::detail {

hopper::LossAndGradPlan plan_cuda_loss_and_grad(const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                                                const IndexerOptions& opt, const ProblemGeometry& g) {
  hopper::DeviceGuard guard(in.index_q.device_index);
  const DType dq = out.d_index_q.dtype, dk = out.d_index_k.dtype;
  const hopper::DeviceProperties device = hopper::query_device_properties();
  const bool split_a = hopper::a_operand_split(opt.a_operand_precision, dq, dk);
  const hopper::DeviceProperties backward =
      hopper::with_ctas_per_sm(device, hopper::backward_ctas_per_sm(g.head_dim, split_a));
  const bool from_logits = in.topk_logits.present();
  if (hopper::loss_and_grad_in_one_kernel(g, dq, dk, opt, from_logits)) {
    // The kernel's attribute and occupancy before anything is allocated or written.
    if (g.head_dim == 64) hopper::prepare_indexer_kl_loss_and_grad<64>();
    else hopper::prepare_indexer_kl_loss_and_grad<128>();
    return hopper::plan_loss_and_grad(g, dq, dk, opt, backward, device);
  }
  const hopper::DeviceProperties forward =
      hopper::with_ctas_per_sm(device, hopper::kl_forward_ctas_per_sm(g, from_logits));
  return hopper::plan_loss_and_grad(g, dq, dk, opt, backward, forward, from_logits);
}

void run_cuda_loss_and_grad(const hopper::LossAndGradPlan& plan, const IndexerInputs& inputs,
                            const IndexerKLLossAndGradOutputs& out, const IndexerOptions& opt, const ProblemGeometry& g,
                            void* workspace, std::size_t workspace_bytes) {
  hopper::DeviceGuard guard(inputs.index_q.device_index);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  hopper::CallWorkspace ws(workspace, workspace_bytes, plan.workspace_bytes, stream, "loss and gradients workspace");
  const DeviceCuSeqlens seqs = g.cu_seqlens_on_device_only
                                   ? check_device_cu_seqlens(inputs.cu_seqlens_q, inputs.cu_seqlens_k, g, stream)
                                   : DeviceCuSeqlens{};
  IndexerInputs in = with_checked_cu_seqlens(inputs, seqs);
  if (plan.one_kernel) hopper::run_one_kernel(plan, in, out, opt, g, ws.data(), stream);
  else hopper::run_two_kernels(plan, in, out, opt, g, ws.data(), stream);
  finish_device_cu_seqlens(seqs, {&out.loss, &out.d_index_q, &out.d_weights, &out.d_index_k}, stream);
  ws.release();
}

}  // namespace dsaib::detail
