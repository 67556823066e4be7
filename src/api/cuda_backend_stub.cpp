// Used when the library is built without CUDA: the cuda backend reports itself unavailable.
#include "api/cuda_backend.hpp"

namespace dsaib::detail {

bool cuda_backend_compiled() { return false; }
bool cuda_device_present() { return false; }
bool cuda_stream_capturing(void*) { return false; }
std::size_t cuda_backward_workspace_bytes(const IndexerInputs&, const IndexerBackwardOutputs&,
                                          const IndexerOptions&, const ProblemGeometry&) {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
}
void cuda_copy_to_host(void*, const void*, std::size_t, std::size_t, std::size_t, void*) {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: this build has no CUDA support");
}
hopper::LaunchPlan cuda_launch_plan(const IndexerInputs&, const IndexerBackwardOutputs&,
                                    const IndexerOptions&, const ProblemGeometry&) {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
}
void run_cuda_backend(const IndexerInputs&, const IndexerBackwardOutputs&, const IndexerOptions&,
                      const ProblemGeometry&, void*, std::size_t) {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
}

std::size_t cuda_kl_loss_and_grad_workspace_bytes(const IndexerInputs&, const IndexerKLLossAndGradOutputs&,
                                                  const IndexerOptions&, const ProblemGeometry&) {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
}
void run_cuda_kl_loss_and_grad(const IndexerInputs&, const IndexerKLLossAndGradOutputs&,
                               const IndexerOptions&, const ProblemGeometry&, void*, std::size_t) {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
}

}  // namespace dsaib::detail
