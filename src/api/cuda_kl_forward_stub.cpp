// Used when the library is built without CUDA: the cuda forward is unavailable
// (check_options_and_backend reports it before these are reached).
#include "api/cuda_kl_forward.hpp"

namespace dsaib::detail {

std::size_t cuda_kl_forward_workspace_size(const ProblemGeometry&, int) { return 0; }
void run_cuda_kl_forward(const IndexerInputs&, const IndexerKLForwardOutputs&, const IndexerOptions&,
                         const ProblemGeometry&, void*, std::size_t) {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
}

}  // namespace dsaib::detail
