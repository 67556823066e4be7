// The cuda backend's seam in a build without CUDA: every call reports that the
// backend is unavailable (check_options_and_backend raises it first).
#include "api/cuda_backend.hpp"

namespace dsaib::detail {
namespace {

[[noreturn]] void unavailable() {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: expected cpu (this build has no CUDA support), got cuda");
}

}  // namespace

bool cuda_backend_compiled() { return false; }
bool cuda_device_present() { return false; }
bool cuda_stream_capturing(void*) { return false; }
void cuda_copy_to_host(void*, const void*, std::size_t, std::size_t, std::size_t, void*) {
  throw Error(ErrorCode::backend_unavailable, "backend", "backend: this build has no CUDA support");
}

hopper::BackwardCallPlan plan_cuda_backward(const IndexerInputs&, const IndexerBackwardOutputs&, const IndexerOptions&,
                                            const ProblemGeometry&) {
  unavailable();
}
void run_cuda_backward(const hopper::BackwardCallPlan&, const IndexerInputs&, const IndexerBackwardOutputs&,
                       const IndexerOptions&, const ProblemGeometry&, void*, std::size_t) {
  unavailable();
}
hopper::ForwardPlan plan_cuda_kl_forward(const IndexerInputs&, const ProblemGeometry&) { unavailable(); }
void run_cuda_kl_forward(const hopper::ForwardPlan&, const IndexerInputs&, const IndexerKLForwardOutputs&,
                         const IndexerOptions&, const ProblemGeometry&, void*, std::size_t) {
  unavailable();
}
hopper::LossAndGradPlan plan_cuda_loss_and_grad(const IndexerInputs&, const IndexerKLLossAndGradOutputs&,
                                                const IndexerOptions&, const ProblemGeometry&) {
  unavailable();
}
void run_cuda_loss_and_grad(const hopper::LossAndGradPlan&, const IndexerInputs&, const IndexerKLLossAndGradOutputs&,
                            const IndexerOptions&, const ProblemGeometry&, void*, std::size_t) {
  unavailable();
}
hopper::TargetPlan plan_cuda_attention_target(const AttentionTargetInputs&, const ProblemGeometry&) { unavailable(); }
void run_cuda_attention_target(const hopper::TargetPlan&, const AttentionTargetInputs&, const AttentionTargetOutputs&,
                               const AttentionTargetOptions&, const ProblemGeometry&, void*, std::size_t) {
  unavailable();
}
hopper::TopkPlan plan_cuda_indexer_topk(const IndexerTopkInputs&, const IndexerTopkOutputs&, const ProblemGeometry&) {
  unavailable();
}
void run_cuda_indexer_topk(const hopper::TopkPlan&, const IndexerTopkInputs&, const IndexerTopkOutputs&,
                           const IndexerTopkOptions&, const ProblemGeometry&, void*, std::size_t) {
  unavailable();
}

}  // namespace dsaib::detail
