// indexer_backward() on cuda (api/cuda_backend.hpp): the plan of the call, then
// the dK accumulator zeroed, one of the backward kernels and, for a bf16
// d_index_k, the final cast. The P-free form packs the row statistics for its
// kernels first, or (H > 64, deterministic) runs the loss forward's kernel to
// write P into the workspace and then the P form. No host synchronisation.
#include <cuda_runtime.h>

#include <algorithm>

#include "api/cuda_backend.hpp"
#include "hopper/common/cuda_check.hpp"
#include "hopper/common/device_cu_seqlens.hpp"
#include "hopper/common/support_kernels.hpp"
#include "hopper/common/tile_config.cuh"
#include "hopper/indexer_backward/fixed_point_dk.hpp"
#include "hopper/indexer_backward/indexer_backward_backend.hpp"
#include "hopper/indexer_backward/l2_policy.cuh"
#include "hopper/indexer_backward/launch.hpp"
#include "hopper/kl_forward/kl_forward_backend.hpp"
#include "hopper/launch/device.hpp"
#include "hopper/launch/problem_params.hpp"

namespace dsaib::hopper {
namespace {

/// applypriority evict_normal on each of the `lines` 128-byte L2 lines from the
/// 128-byte aligned `first_line` (the lines of the dK accumulator after an
/// L2-hinted kernel; l2_policy.cuh).
__global__ void reset_l2_priority_to_normal(const char* first_line, int64_t lines) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < lines) l2_priority_to_normal(first_line + i * 128);
}

/// The P-free kernels' row statistics: (row_lse, row_target_mass) of flat row i
/// as out[i] (kernel_params.hpp), read through the tensors' strides.
__global__ void pack_row_statistics(const float* lse, int64_t lse_batch_stride, int64_t lse_row_stride,
                                    const float* mass, int64_t mass_batch_stride, int64_t mass_row_stride,
                                    int64_t rows_per_batch, int64_t n, float2* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / rows_per_batch, t = i % rows_per_batch;
    out[i] = make_float2(lse[b * lse_batch_stride + t * lse_row_stride], mass[b * mass_batch_stride + t * mass_row_stride]);
  }
}

static_assert(TileConfig<64, false>::kHeadTile == kHeadsPerTask && TileConfig<128, true>::kHeadTile == kHeadsPerTask,
              "the launch plan's tasks are the kernels' head tiles");

/// One of the ten backward kernels, as a type.
template <int kD, bool kSplit, bool kL2, bool kFixed = false>
struct KernelChoice {
  static constexpr int kHeadDim = kD;
  static constexpr bool kSplitA = kSplit, kL2KeepDk = kL2, kFixedPointDk = kFixed;
};

/// Launches the backward kernel `k` names (l2_keep_dk is never set with split_a
/// or fixed_point_dk: plan_backward), or its P-free variant.
void launch_backward_kernel(const BackwardKernel& k, const IndexerParams& params, int64_t grid, cudaStream_t stream,
                            bool p_free) {
  if (p_free) {  // the P-free kernels (no L2 hint, no fixed-point dK)
    if (k.head_dim == 64) {
      k.split_a ? launch_indexer_backward_p_free<64, true>(params, grid, stream)
                : launch_indexer_backward_p_free<64, false>(params, grid, stream);
    } else {
      k.split_a ? launch_indexer_backward_p_free<128, true>(params, grid, stream)
                : launch_indexer_backward_p_free<128, false>(params, grid, stream);
    }
    return;
  }
  const auto launch = [&](auto choice) {
    using K = decltype(choice);
    launch_indexer_backward<K::kHeadDim, K::kSplitA, K::kL2KeepDk, K::kFixedPointDk>(params, grid, stream);
  };
  if (k.head_dim == 64) {
    if (k.fixed_point_dk) k.split_a ? launch(KernelChoice<64, true, false, true>{}) : launch(KernelChoice<64, false, false, true>{});
    else if (k.split_a) launch(KernelChoice<64, true, false>{});
    else if (k.l2_keep_dk) launch(KernelChoice<64, false, true>{});
    else launch(KernelChoice<64, false, false>{});
  } else {
    if (k.fixed_point_dk) k.split_a ? launch(KernelChoice<128, true, false, true>{}) : launch(KernelChoice<128, false, false, true>{});
    else if (k.split_a) launch(KernelChoice<128, true, false>{});
    else if (k.l2_keep_dk) launch(KernelChoice<128, false, true>{});
    else launch(KernelChoice<128, false, false>{});
  }
}

void pack_row_statistics_of(const IndexerInputs& in, const detail::ProblemGeometry& g, float2* out,
                            cudaStream_t stream) {
  const int64_t n = g.num_q_rows;
  if (n == 0) return;
  const int64_t rows_per_batch = std::max<int64_t>(g.layout == Layout::thd ? n : g.s_q, 1);
  pack_row_statistics<<<static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 1024)), 256, 0, stream>>>(
      static_cast<const float*>(in.row_lse.data), flat_batch_stride(in.row_lse, g), flat_row_stride(in.row_lse, g),
      static_cast<const float*>(in.row_target_mass.data), flat_batch_stride(in.row_target_mass, g),
      flat_row_stride(in.row_target_mass, g), rows_per_batch, n, out);
  cuda_check_launch("pack_row_statistics");
}

}  // namespace

int backward_ctas_per_sm(int64_t head_dim, bool split_a) {
  if (head_dim == 64) return split_a ? indexer_backward_ctas_per_sm<64, true>() : indexer_backward_ctas_per_sm<64, false>();
  return split_a ? indexer_backward_ctas_per_sm<128, true>() : indexer_backward_ctas_per_sm<128, false>();
}

void run_backward_kernel(const BackwardCallPlan& call, const IndexerInputs& in, const IndexerBackwardOutputs& out,
                         const IndexerOptions& opt, const detail::ProblemGeometry& g, char* workspace,
                         cudaStream_t stream) {
  const BackwardPlan& plan = call.kernel;
  char* ws = workspace + call.kernel_at;
  float2* packed_stats = nullptr;
  if (call.p_free_kernels) {
    packed_stats = reinterpret_cast<float2*>(workspace + call.packed_stats_at);
    pack_row_statistics_of(in, g, packed_stats, stream);
  }
  const std::size_t dk_bytes = static_cast<std::size_t>(g.num_k_rows * g.head_dim) * sizeof(float);
  const bool dk_bf16 = out.d_index_k.dtype == DType::bf16;
  float* dk_accum = plan.kernel.fixed_point_dk ? nullptr
                    : dk_bf16                   ? reinterpret_cast<float*>(ws)
                                                : static_cast<float*>(out.d_index_k.data);
  IndexerParams params = indexer_params(in, out, opt, g, plan.head_groups, dk_accum);
  if (call.p_free_kernels) {  // the packed statistics in index_score's place (kernel_params.hpp)
    params.index_score = reinterpret_cast<const float*>(packed_stats);
    params.index_score_batch_stride = params.index_score_row_stride = 0;
  }
  params.start_stagger_max_ns = plan.start_delays.max_ns;
  params.start_stagger_first_delayed_cta = plan.start_delays.first_delayed_cta;
  params.l2_keep_fraction = static_cast<int32_t>(plan.l2_keep_fraction);

  if (plan.kernel.fixed_point_dk) {  // fixed_point_dk.cuh: the bound pass, the kernel, the finish kernel
    auto* dk_fixed = reinterpret_cast<unsigned long long*>(ws);
    auto* bound = reinterpret_cast<DkFixedBound*>(ws + dk_fixed_bound_offset(g.num_k_rows, g.head_dim));
    const int64_t n = g.num_k_rows * g.head_dim;
    params.dk_fixed = dk_fixed;
    params.dk_bound = bound;
    launch_dk_fixed_bound(params, dk_fixed, n, bound, stream);
    launch_backward_kernel(plan.kernel, params, plan.grid, stream, false);
    launch_dk_fixed_finish(dk_fixed, bound, g.num_q_rows, out.d_index_k.data, dk_bf16, n, stream);
    return;
  }
  if (dk_bytes > 0) cuda_check(cudaMemsetAsync(dk_accum, 0, dk_bytes, stream), "cudaMemsetAsync (dK accumulator)");
  launch_backward_kernel(plan.kernel, params, plan.grid, stream, call.p_free_kernels);
  if (plan.kernel.l2_keep_dk && dk_bytes > 0) {
    // No evict_last line of the accumulator outlives the call (l2_policy.cuh). Every
    // 128-byte line that holds a byte of it (an fp32 d_index_k need not be 128-byte aligned).
    const uintptr_t begin = reinterpret_cast<uintptr_t>(dk_accum) & ~uintptr_t{127};
    const uintptr_t end = reinterpret_cast<uintptr_t>(dk_accum) + dk_bytes;
    const int64_t lines = static_cast<int64_t>((end - begin + 127) / 128), threads = 256;
    reset_l2_priority_to_normal<<<static_cast<unsigned>((lines + threads - 1) / threads), threads, 0, stream>>>(
        reinterpret_cast<const char*>(begin), lines);
    cuda_check_launch("reset_l2_priority_to_normal");
  }
  if (dk_bf16) launch_cast_dk_to_bf16(dk_accum, out.d_index_k.data, g.num_k_rows * g.head_dim, stream);
}

}  // namespace dsaib::hopper

namespace dsaib::detail {

hopper::BackwardCallPlan plan_cuda_backward(const IndexerInputs& in, const IndexerBackwardOutputs& out,
                                            const IndexerOptions& opt, const ProblemGeometry& g) {
  hopper::DeviceGuard guard(in.index_q.device_index);
  const hopper::DeviceProperties device = hopper::query_device_properties();
  const bool p_free = !in.index_score.present();
  const bool split_a = hopper::a_operand_split(opt.a_operand_precision, out.d_index_q.dtype, out.d_index_k.dtype);
  const hopper::DeviceProperties backward =
      hopper::with_ctas_per_sm(device, hopper::backward_ctas_per_sm(g.head_dim, split_a));
  const hopper::DeviceProperties forward = hopper::p_free_needs_prepass(p_free, g, opt)
                                               ? hopper::with_ctas_per_sm(device, hopper::kl_forward_ctas_per_sm(g))
                                               : device;
  return hopper::plan_backward_call(g, out.d_index_q.dtype, out.d_index_k.dtype, opt, p_free, backward, forward);
}

void run_cuda_backward(const hopper::BackwardCallPlan& plan, const IndexerInputs& inputs,
                       const IndexerBackwardOutputs& out, const IndexerOptions& opt, const ProblemGeometry& g,
                       void* workspace, std::size_t workspace_bytes) {
  hopper::DeviceGuard guard(inputs.index_q.device_index);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  hopper::CallWorkspace ws(workspace, workspace_bytes, plan.workspace_bytes, stream, "backward workspace");
  const DeviceCuSeqlens seqs = g.cu_seqlens_on_device_only
                                   ? check_device_cu_seqlens(inputs.cu_seqlens_q, inputs.cu_seqlens_k, g, stream)
                                   : DeviceCuSeqlens{};
  IndexerInputs in = with_checked_cu_seqlens(inputs, seqs);
  if (plan.prepass) {
    // P-free with H > 64 or deterministic: the loss forward's kernel writes P (and
    // its own row statistics, unused) into the workspace, then the P form runs.
    const int device = inputs.index_q.device_index;
    IndexerKLForwardOutputs fwd;
    fwd.index_score = hopper::rows_view(ws.at<void>(plan.p_at), g, device, g.topk);
    fwd.row_lse = hopper::rows_view(ws.at<void>(plan.lse_at), g, device);
    fwd.row_target_mass = hopper::rows_view(ws.at<void>(plan.mass_at), g, device);
    fwd.loss = contiguous_view(ws.at<void>(plan.loss_at), DType::f32, {}, DeviceType::cuda, device);
    in.row_lse = {};
    in.row_target_mass = {};
    hopper::run_kl_forward_kernel(plan.forward, in, fwd, opt, g, ws.at<char>(plan.forward_at), stream);
    in.index_score = fwd.index_score;
  }
  hopper::run_backward_kernel(plan, in, out, opt, g, ws.data(), stream);
  finish_device_cu_seqlens(seqs, {&out.d_index_q, &out.d_weights, &out.d_index_k}, stream);
  ws.release();
}

}  // namespace dsaib::detail
