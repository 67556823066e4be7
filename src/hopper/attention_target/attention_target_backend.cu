// attention_target() on cuda (api/cuda_backend.hpp): one persistent launch of
// attention_target_kernel (attention_target_kernel.cuh) over the query rows,
// with the kernel for Hq rounded up to 64 or 128 heads and Dqk up to 192 or 576
// (target_kernel_for), in its two-sweep form when no lse is given. No host
// synchronisation; THD while capturing checks cu_seqlens on the device.
#include <cuda_runtime.h>

#include "api/cuda_backend.hpp"
#include "hopper/attention_target/attention_target_kernel.cuh"
#include "hopper/common/cuda_check.hpp"
#include "hopper/common/device_cu_seqlens.hpp"
#include "hopper/launch/device.hpp"
#include "hopper/launch/problem_params.hpp"

namespace dsaib::hopper {
namespace {

/// Calls f(AttentionTargetConfig<N, slices, selected_lse>{}) for the plan's kernel.
template <bool kSelectedLse, class F>
void with_target_config_lse(const TargetKernel& k, F&& f) {
  if (k.max_slices == 3) {
    if (k.heads_padded == 64) f(AttentionTargetConfig<64, 3, kSelectedLse>{});
    else f(AttentionTargetConfig<128, 3, kSelectedLse>{});
  } else {
    if (k.heads_padded == 64) f(AttentionTargetConfig<64, 9, kSelectedLse>{});
    else f(AttentionTargetConfig<128, 9, kSelectedLse>{});
  }
}
template <class F>
void with_target_config(const TargetKernel& k, F&& f) {
  if (k.selected_lse) with_target_config_lse<true>(k, f);
  else with_target_config_lse<false>(k, f);
}

int target_ctas_per_sm(const TargetKernel& k) {
  int ctas = 0;
  with_target_config(k, [&](auto c) {
    using Config = decltype(c);
    ctas = resident_ctas_per_sm(attention_target_kernel<Config>, Config::kThreads, attention_target_smem_bytes<Config>(),
                                "attention_target_kernel");
  });
  return ctas;
}

AttentionTargetParams target_params(const AttentionTargetInputs& in, const AttentionTargetOutputs& out,
                                    const AttentionTargetOptions& opt, const detail::ProblemGeometry& g) {
  const TensorView no_weights;
  AttentionTargetParams t{};
  t.in = problem_params({in.query, no_weights, in.kv, in.topk_indices, in.cu_seqlens_q, in.cu_seqlens_k}, g, 1);
  t.in.sm_scale = opt.sm_scale;
  t.lse = static_cast<const float*>(in.lse.data);  // null without an lse (the kernel then computes it)
  if (in.lse.present()) {
    t.lse_batch_stride = flat_batch_stride(in.lse, g);
    t.lse_row_stride = flat_row_stride(in.lse, g);
    t.lse_head_stride = in.lse.strides[g.layout == Layout::thd ? 1 : 2];
  }
  constexpr double kLog2e = 1.4426950408889634073599246810019;
  t.scale2 = static_cast<float>(static_cast<double>(opt.sm_scale) * kLog2e);
  t.lse_to_log2 = opt.lse_base == LseBase::natural ? static_cast<float>(kLog2e) : 1.0f;
  t.normalize = opt.normalize;
  t.num_slices = static_cast<int32_t>(g.head_dim / 64);
  t.attn_score = static_cast<float*>(out.attn_score.data);
  return t;
}

}  // namespace
}  // namespace dsaib::hopper

namespace dsaib::detail {

hopper::TargetPlan plan_cuda_attention_target(const AttentionTargetInputs& in, const ProblemGeometry& g) {
  hopper::DeviceGuard guard(in.query.device_index);
  hopper::check_attention_target_limits(g);  // before any device query
  const hopper::DeviceProperties device = hopper::query_device_properties();
  hopper::TargetKernel kernel = hopper::target_kernel_for(g);
  kernel.selected_lse = !in.lse.present();
  const int ctas = hopper::target_ctas_per_sm(kernel);
  hopper::TargetPlan plan = hopper::plan_attention_target(g, hopper::with_ctas_per_sm(device, ctas));
  plan.kernel.selected_lse = kernel.selected_lse;
  return plan;
}

void run_cuda_attention_target(const hopper::TargetPlan& plan, const AttentionTargetInputs& in,
                               const AttentionTargetOutputs& out, const AttentionTargetOptions& opt,
                               const ProblemGeometry& g, void*, std::size_t) {
  if (plan.grid == 0) return;  // no query row: an empty output
  hopper::DeviceGuard guard(in.query.device_index);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  hopper::AttentionTargetParams params = hopper::target_params(in, out, opt, g);
  DeviceCuSeqlens seqs;
  if (g.cu_seqlens_on_device_only) {
    seqs = check_device_cu_seqlens(in.cu_seqlens_q, in.cu_seqlens_k, g, stream);
    params.in.cu_seqlens_q = seqs.cu_seqlens_q;
    params.in.cu_seqlens_k = seqs.cu_seqlens_k;
  }
  hopper::with_target_config(plan.kernel, [&](auto c) {
    using Config = decltype(c);
    params.u_in_smem = opt.normalize && g.topk <= Config::kSmemTopk;
    hopper::attention_target_kernel<Config><<<static_cast<unsigned>(plan.grid), Config::kThreads,
                                              hopper::attention_target_smem_bytes<Config>(), stream>>>(params);
  });
  hopper::cuda_check_launch("attention_target_kernel");
  finish_device_cu_seqlens(seqs, {&out.attn_score}, stream);
}

}  // namespace dsaib::detail
