// The public entry points: validate, then dispatch to a backend.
#include "dsaib/indexer_backward.hpp"

#include <string>

#include "api/cuda_backend.hpp"
#include "api/workspace_allocator.hpp"
#include "core/problem.hpp"
#include "reference/cpu_reference.hpp"

namespace dsaib {
namespace detail {

namespace {

ProblemGeometry validate_for_backend(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                     const IndexerOptions& opt) {
  check_options_and_backend(opt);
  const bool cuda = opt.backend == Backend::cuda;
  // THD inside a CUDA-graph capture: cu_seqlens are checked on the device (common/device_cu_seqlens.hpp).
  const bool capturing = cuda && opt.layout == Layout::thd && cuda_stream_capturing(opt.stream);
  return validate_problem(in, out, opt, cuda ? &cuda_copy_to_host : nullptr, true, capturing);
}

}  // namespace

hopper::BackwardPlan plan_indexer_backward(const IndexerInputs& inputs, const IndexerBackwardOutputs& outputs,
                                         const IndexerOptions& options) {
  check_options(options);
  if (options.backend != Backend::cuda) {
    throw Error(ErrorCode::invalid_argument, "backend",
                "backend: expected cuda (the launch plan is the cuda backend's), got " + std::string(backend_name(options.backend)));
  }
  const ProblemGeometry g = validate_for_backend(inputs, outputs, options);
  return plan_cuda_backward(inputs, outputs, options, g).kernel;
}

}  // namespace detail
using detail::validate_for_backend;

bool cuda_backend_available() { return detail::cuda_backend_compiled() && detail::cuda_device_present(); }

std::size_t indexer_backward_workspace_size(const IndexerInputs& inputs, const IndexerBackwardOutputs& outputs,
                                            const IndexerOptions& options) {
  const detail::ProblemGeometry g = validate_for_backend(inputs, outputs, options);
  return options.backend == Backend::cuda ? detail::plan_cuda_backward(inputs, outputs, options, g).workspace_bytes : 0;
}

namespace {

/// The call after validation (`g`): the cpu backend, or the cuda backend's plan,
/// its workspace (the caller's, from `allocator`, or, with neither, the
/// backend's own) checked against it, and the run.
void run_validated(const IndexerInputs& inputs, const IndexerBackwardOutputs& outputs,
                   const IndexerOptions& options, const detail::ProblemGeometry& g, void* workspace,
                   std::size_t workspace_bytes,
                   const WorkspaceAllocator* allocator = nullptr) {
  if (options.backend == Backend::cpu) {
    detail::run_cpu_backend(inputs, outputs, options, g);
    return;
  }
  const hopper::BackwardCallPlan plan = detail::plan_cuda_backward(inputs, outputs, options, g);
  if (allocator != nullptr && allocator->allocate != nullptr && plan.workspace_bytes > 0) {
    workspace = detail::allocate_workspace(*allocator, plan.workspace_bytes);
    workspace_bytes = plan.workspace_bytes;
  }
  detail::check_caller_workspace(workspace, workspace_bytes, plan.workspace_bytes, "indexer_backward_workspace_size");
  detail::run_cuda_backward(plan, inputs, outputs, options, g, workspace, workspace_bytes);
}

}  // namespace

void indexer_backward(const IndexerInputs& inputs, const IndexerBackwardOutputs& outputs,
                      const IndexerOptions& options, void* workspace, std::size_t workspace_bytes) {
  run_validated(inputs, outputs, options, validate_for_backend(inputs, outputs, options), workspace, workspace_bytes);
}

void indexer_backward(const IndexerInputs& inputs, const IndexerBackwardOutputs& outputs,
                      const IndexerOptions& options, const WorkspaceAllocator& allocator) {
  run_validated(inputs, outputs, options, validate_for_backend(inputs, outputs, options), nullptr, 0, &allocator);
}

}  // namespace dsaib
