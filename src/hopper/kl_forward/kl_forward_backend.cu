// indexer_kl_forward() on cuda (api/cuda_backend.hpp): the forward kernel
// (kl_forward_kernel.cuh, or kl_forward_from_logits_kernel.cuh given the
// top-k's logits) over the query rows, then one CTA that sums the per-row loss
// terms in a fixed order. No host synchronisation.
#include <cuda_runtime.h>

#include "api/cuda_backend.hpp"
#include "hopper/common/cuda_check.hpp"
#include "hopper/common/device_cu_seqlens.hpp"
#include "hopper/common/support_kernels.hpp"
#include "hopper/kl_forward/kl_forward_backend.hpp"
#include "hopper/kl_forward/kl_forward_from_logits_kernel.cuh"
#include "hopper/kl_forward/kl_forward_kernel.cuh"
#include "hopper/launch/device.hpp"
#include "hopper/launch/problem_params.hpp"

namespace dsaib::hopper {
namespace {

/// Calls f(ForwardTileConfig<kD, head tile>{}) for the plan's head tile.
template <int kD, class F>
void with_forward_head_tile(const ForwardKernel& k, F&& f) {
  if (k.head_tile == 32) f(ForwardTileConfig<kD, 32>{});
  else if (k.head_tile == 64) f(ForwardTileConfig<kD, 64>{});
  else f(ForwardTileConfig<kD, 128>{});
}

/// Calls f(ForwardTileConfig<D, head tile>{}) for the plan's kernel.
template <class F>
void with_forward_config(const ForwardKernel& k, F&& f) {
  if (k.head_dim == 64) with_forward_head_tile<64>(k, f);
  else with_forward_head_tile<128>(k, f);
}

}  // namespace

int kl_forward_ctas_per_sm(const detail::ProblemGeometry& g, bool from_logits) {
  if (from_logits) {
    return resident_ctas_per_sm(indexer_kl_forward_from_logits_kernel, LogitsForwardConfig::kThreads, 0,
                                "indexer_kl_forward_from_logits_kernel");
  }
  int ctas = 0;
  with_forward_config(forward_kernel_for(g), [&](auto c) {
    using Config = decltype(c);
    ctas = resident_ctas_per_sm(indexer_kl_forward_kernel<Config>, Config::kThreads,
                                forward_shared_storage_bytes<Config>(), "indexer_kl_forward_kernel");
  });
  return ctas;
}

void run_kl_forward_kernel(const ForwardPlan& plan, const IndexerInputs& in, const IndexerKLForwardOutputs& out,
                           const IndexerOptions& opt, const detail::ProblemGeometry& g, char* workspace,
                           cudaStream_t stream) {
  IndexerKLForwardParams params{};
  params.in = indexer_params(in, IndexerBackwardOutputs{}, opt, g, 1, nullptr);  // a task is a whole row (every head)
  params.row_lse = static_cast<float*>(out.row_lse.data);
  params.row_target_mass = static_cast<float*>(out.row_target_mass.data);
  params.index_score = out.index_score.present() ? static_cast<float*>(out.index_score.data) : nullptr;
  params.loss_terms = reinterpret_cast<double*>(workspace + plan.loss_terms_at);
  params.z_scratch = reinterpret_cast<float*>(workspace + plan.z_scratch_at);
  params.z_stride = plan.z_stride;
  if (plan.kernel.from_logits) {
    const TensorView& logits = in.topk_logits;
    params.topk_logits = static_cast<const float*>(logits.data);
    params.topk_logits_batch_stride = g.layout == Layout::bshd ? logits.strides[0] : 0;
    params.topk_logits_row_stride = logits.strides[g.layout == Layout::bshd ? 1 : 0];
    if (plan.grid > 0) {
      indexer_kl_forward_from_logits_kernel<<<static_cast<unsigned>(plan.grid), LogitsForwardConfig::kThreads, 0,
                                              stream>>>(params);
      cuda_check_launch("indexer_kl_forward_from_logits_kernel");
    }
  } else if (plan.grid > 0) {
    with_forward_config(plan.kernel, [&](auto c) {
      using Config = decltype(c);
      indexer_kl_forward_kernel<Config><<<static_cast<unsigned>(plan.grid), Config::kThreads,
                                          forward_shared_storage_bytes<Config>(), stream>>>(params);
    });
    cuda_check_launch("indexer_kl_forward_kernel");
  }
  const double coeff_over_n = static_cast<double>(opt.loss_coeff) / static_cast<double>(g.normalization_count);
  launch_sum_loss_terms(params.loss_terms, g.num_q_rows, coeff_over_n, static_cast<float*>(out.loss.data), stream);
}

}  // namespace dsaib::hopper

namespace dsaib::detail {

hopper::ForwardPlan plan_cuda_kl_forward(const IndexerInputs& in, const ProblemGeometry& g) {
  hopper::DeviceGuard guard(in.index_q.device_index);
  check_cuda_key_rows(g);  // validation raised it already
  const hopper::DeviceProperties device = hopper::query_device_properties();
  const bool from_logits = in.topk_logits.present();
  return hopper::plan_kl_forward(
      g, hopper::with_ctas_per_sm(device, hopper::kl_forward_ctas_per_sm(g, from_logits)), from_logits);
}

void run_cuda_kl_forward(const hopper::ForwardPlan& plan, const IndexerInputs& inputs,
                         const IndexerKLForwardOutputs& out, const IndexerOptions& opt, const ProblemGeometry& g,
                         void* workspace, std::size_t workspace_bytes) {
  hopper::DeviceGuard guard(inputs.index_q.device_index);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  hopper::CallWorkspace ws(workspace, workspace_bytes, plan.workspace_bytes, stream, "forward workspace");
  hopper::run_kl_forward_kernel(plan, inputs, out, opt, g, ws.data(), stream);
  ws.release();
}

}  // namespace dsaib::detail
