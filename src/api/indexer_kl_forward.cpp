// indexer_kl_forward(): validate, then dispatch to a backend.
#include "dsaib/indexer_kl_forward.hpp"

#include <cstdint>
#include <string>

#include "api/cuda_backend.hpp"
#include "api/workspace_allocator.hpp"
#include "core/problem.hpp"
#include "reference/cpu_reference.hpp"

namespace dsaib {
namespace {

detail::ProblemGeometry validate_forward_for_backend(const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                                                     const IndexerOptions& opt) {
  detail::check_options_and_backend(opt);
  return detail::validate_kl_forward_problem(in, out, opt,
                                             opt.backend == Backend::cuda ? &detail::cuda_copy_to_host : nullptr);
}

}  // namespace

std::size_t indexer_kl_forward_workspace_size(const IndexerInputs& inputs, const IndexerKLForwardOutputs& outputs,
                                              const IndexerOptions& options) {
  const detail::ProblemGeometry g = validate_forward_for_backend(inputs, outputs, options);
  return options.backend == Backend::cuda ? detail::plan_cuda_kl_forward(inputs, g).workspace_bytes : 0;
}

namespace {

/// The call after validation (`g`): the cpu backend, or the cuda backend's plan,
/// its workspace (the caller's, from `allocator`, or, with neither, the
/// backend's own) checked against it, and the run.
void run_validated(const IndexerInputs& inputs, const IndexerKLForwardOutputs& outputs,
                   const IndexerOptions& options, const detail::ProblemGeometry& g, void* workspace,
                   std::size_t workspace_bytes,
                   const WorkspaceAllocator* allocator = nullptr) {
  if (options.backend == Backend::cpu) {
    detail::run_cpu_kl_forward(inputs, outputs, options, g);
    return;
  }
  const hopper::ForwardPlan plan = detail::plan_cuda_kl_forward(inputs, g);
  if (allocator != nullptr && allocator->allocate != nullptr && plan.workspace_bytes > 0) {
    workspace = detail::allocate_workspace(*allocator, plan.workspace_bytes);
    workspace_bytes = plan.workspace_bytes;
  }
  detail::check_caller_workspace(workspace, workspace_bytes, plan.workspace_bytes, "indexer_kl_forward_workspace_size");
  detail::run_cuda_kl_forward(plan, inputs, outputs, options, g, workspace, workspace_bytes);
}

}  // namespace

void indexer_kl_forward(const IndexerInputs& inputs, const IndexerKLForwardOutputs& outputs,
                        const IndexerOptions& options, void* workspace, std::size_t workspace_bytes) {
  run_validated(inputs, outputs, options, validate_forward_for_backend(inputs, outputs, options), workspace,
                workspace_bytes);
}

void indexer_kl_forward(const IndexerInputs& inputs, const IndexerKLForwardOutputs& outputs,
                        const IndexerOptions& options, const WorkspaceAllocator& allocator) {
  run_validated(inputs, outputs, options, validate_forward_for_backend(inputs, outputs, options), nullptr, 0, &allocator);
}

}  // namespace dsaib
