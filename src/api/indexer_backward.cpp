// The public entry points: validate, then dispatch to a backend.
#include "dsaib/indexer_backward.hpp"

#include <cstdint>
#include <string>

#include "api/cuda_backend.hpp"
#include "core/problem.hpp"
#include "reference/cpu_reference.hpp"

namespace dsaib {
namespace detail {

void check_options_and_backend(const IndexerOptions& opt) {
  check_options(opt);  // errors.md: the options first, then the backend's availability
  if (opt.backend != Backend::cuda) return;
  if (!cuda_backend_compiled()) {
    throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
  }
  if (!cuda_device_present()) {
    throw Error(ErrorCode::backend_unavailable, "backend",
                "backend: expected cpu (no CUDA device of compute capability 9.0 is visible), got cuda");
  }
}

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

void check_caller_workspace(const void* workspace, std::size_t workspace_bytes, std::size_t need,
                            const char* size_function) {
  if (workspace == nullptr && workspace_bytes == 0) return;  // the backend's own memory
  if (workspace_bytes < need) {
    throw Error(ErrorCode::invalid_argument, "workspace_bytes",
                "workspace_bytes: expected >= " + std::to_string(need) + " (" + size_function + "), got " +
                    std::to_string(workspace_bytes));
  }
  if (need > 0 && (workspace == nullptr || reinterpret_cast<std::uintptr_t>(workspace) % 256 != 0)) {
    throw Error(ErrorCode::invalid_argument, "workspace",
                "workspace: expected a non-null 256-byte aligned device pointer, got " +
                    std::string(workspace ? "a misaligned pointer" : "null"));
  }
}

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

void indexer_backward(const IndexerInputs& inputs, const IndexerBackwardOutputs& outputs,
                      const IndexerOptions& options, void* workspace, std::size_t workspace_bytes) {
  const detail::ProblemGeometry g = validate_for_backend(inputs, outputs, options);
  if (options.backend == Backend::cpu) {
    detail::run_cpu_backend(inputs, outputs, options, g);
    return;
  }
  const hopper::BackwardCallPlan plan = detail::plan_cuda_backward(inputs, outputs, options, g);
  detail::check_caller_workspace(workspace, workspace_bytes, plan.workspace_bytes, "indexer_backward_workspace_size");
  detail::run_cuda_backward(plan, inputs, outputs, options, g, workspace, workspace_bytes);
}

}  // namespace dsaib
