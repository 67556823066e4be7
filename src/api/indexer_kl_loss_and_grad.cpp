// indexer_kl_loss_and_grad(): validate, then the forward and the P-free backward
// on one backend.
#include "dsaib/indexer_kl_loss_and_grad.hpp"

#include <cstdint>
#include <string>

#include "api/cuda_backend.hpp"
#include "api/workspace_allocator.hpp"
#include "core/element_access.hpp"
#include "core/float_mode.hpp"
#include "core/problem.hpp"
#include "dsaib/indexer_kl_forward.hpp"
#include "reference/cpu_reference.hpp"

namespace dsaib {
namespace {

detail::ProblemGeometry validate_loss_and_grad(const IndexerInputs& in, const IndexerKLLossAndGradOutputs& out,
                                               const IndexerOptions& opt) {
  detail::check_options_and_backend(opt);
  const bool cuda = opt.backend == Backend::cuda;
  const bool capturing = cuda && opt.layout == Layout::thd && detail::cuda_stream_capturing(opt.stream);
  return detail::validate_kl_loss_and_grad_problem(in, out, opt, cuda ? &detail::cuda_copy_to_host : nullptr, capturing);
}

}  // namespace

std::size_t indexer_kl_loss_and_grad_workspace_size(const IndexerInputs& inputs,
                                                    const IndexerKLLossAndGradOutputs& outputs,
                                                    const IndexerOptions& options) {
  const detail::ProblemGeometry g = validate_loss_and_grad(inputs, outputs, options);
  return options.backend == Backend::cuda ? detail::plan_cuda_loss_and_grad(inputs, outputs, options, g).workspace_bytes
                                          : 0;
}

namespace {

/// The call after validation (`g`): the cpu backend, or the cuda backend's plan,
/// its workspace (the caller's, from `allocator`, or, with neither, the
/// backend's own) checked against it, and the run.
void run_validated(const IndexerInputs& inputs, const IndexerKLLossAndGradOutputs& outputs,
                   const IndexerOptions& options, const detail::ProblemGeometry& g, void* workspace,
                   std::size_t workspace_bytes,
                   const WorkspaceAllocator* allocator = nullptr) {
  if (options.backend == Backend::cpu) {
    // The fp64 forward's statistics go to the fp64 P-free backward unrounded.
    const detail::IeeeSubnormalsScope ieee;
    const ReferenceKLForward fwd = reference_kl_forward(inputs, options);
    detail::RowStatistics stats{fwd.row_lse, fwd.row_target_mass};
    IndexerInputs in = inputs;
    in.index_score = {};
    in.topk_logits = {};  // the backward recomputes its logits
    detail::run_cpu_backend(in, {outputs.d_index_q, outputs.d_weights, outputs.d_index_k}, options, g, &stats);
    detail::store_element(outputs.loss.dtype, outputs.loss.data, 0, fwd.loss);  // f32, or f64 unrounded
    return;
  }
  const hopper::LossAndGradPlan plan = detail::plan_cuda_loss_and_grad(inputs, outputs, options, g);
  if (allocator != nullptr && allocator->allocate != nullptr && plan.workspace_bytes > 0) {
    workspace = detail::allocate_workspace(*allocator, plan.workspace_bytes);
    workspace_bytes = plan.workspace_bytes;
  }
  detail::check_caller_workspace(workspace, workspace_bytes, plan.workspace_bytes,
                                 "indexer_kl_loss_and_grad_workspace_size");
  detail::run_cuda_loss_and_grad(plan, inputs, outputs, options, g, workspace, workspace_bytes);
}

}  // namespace

void indexer_kl_loss_and_grad(const IndexerInputs& inputs, const IndexerKLLossAndGradOutputs& outputs,
                              const IndexerOptions& options, void* workspace, std::size_t workspace_bytes) {
  run_validated(inputs, outputs, options, validate_loss_and_grad(inputs, outputs, options), workspace,
                workspace_bytes);
}

void indexer_kl_loss_and_grad(const IndexerInputs& inputs, const IndexerKLLossAndGradOutputs& outputs,
                              const IndexerOptions& options, const WorkspaceAllocator& allocator) {
  run_validated(inputs, outputs, options, validate_loss_and_grad(inputs, outputs, options), nullptr, 0, &allocator);
}

}  // namespace dsaib
