// Used when the library is built without CUDA: the cuda target is unavailable
// (validation reports it before these are reached).
#include "api/cuda_attention_target.hpp"

namespace dsaib::detail {

std::size_t cuda_attention_target_workspace_size(const ProblemGeometry&, const AttentionTargetOptions&, int) {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
}
void run_cuda_attention_target(const AttentionTargetInputs&, const AttentionTargetOutputs&,
                               const AttentionTargetOptions&, const ProblemGeometry&, void*, std::size_t) {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
}

}  // namespace dsaib::detail
