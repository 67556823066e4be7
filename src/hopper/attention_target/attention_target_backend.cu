// The cuda attention target behind src/api/cuda_attention_target.hpp: one
// persistent launch of attention_target_kernel (attention_target_kernel.cuh)
// over the query rows, with the kernel for Hq rounded up to 64 or 128 heads and
// Dqk up to 192 or 576.
// No host synchronisation; THD while capturing checks cu_seqlens on the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <string>

#include "api/cuda_attention_target.hpp"
#include "hopper/attention_target/attention_target_kernel.cuh"
#include "hopper/common/cuda_check.hpp"
#include "hopper/common/device_cu_seqlens.hpp"

namespace dsaib::hopper {
namespace {

/// Calls f(AttentionTargetConfig<N, slices>{}) with N = Hq rounded up to 64 or 128
/// and slices = Dqk / 64 rounded up to 3 or 9.
template <class F>
void with_target_config(int64_t heads, int64_t head_dim, F&& f) {
  if (head_dim <= 192) {
    if (heads <= 64) f(AttentionTargetConfig<64, 3>{});
    else f(AttentionTargetConfig<128, 3>{});
  } else {
    if (heads <= 64) f(AttentionTargetConfig<64, 9>{});
    else f(AttentionTargetConfig<128, 9>{});
  }
}

/// The persistent grid: min(rows, SMs x resident CTAs per SM).
template <class Config>
int64_t target_grid(int64_t rows, int device) {
  if (rows <= 0) return 0;
  const int blocks_per_sm = resident_ctas_per_sm(attention_target_kernel<Config>, Config::kThreads,
                                                 attention_target_smem_bytes<Config>(), "attention_target_kernel");
  int sms = 0;
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return std::min<int64_t>(rows, static_cast<int64_t>(sms) * blocks_per_sm);
}

AttentionTargetParams make_target_params(const AttentionTargetInputs& in, const AttentionTargetOutputs& out,
                                         const AttentionTargetOptions& opt, const detail::ProblemGeometry& g) {
  const bool thd = g.layout == Layout::thd;
  // Flat-row addressing: BSHD (row / S) * stride0 + (row % S) * stride1; THD row * stride0.
  auto batch_stride = [&](const TensorView& v) { return thd ? int64_t{0} : v.strides[0]; };
  auto row_stride = [&](const TensorView& v) { return thd ? v.strides[0] : v.strides[1]; };
  AttentionTargetParams t{};
  IndexerParams& p = t.in;
  p.index_q = static_cast<const uint16_t*>(in.query.data);
  p.q_batch_stride = batch_stride(in.query);
  p.q_row_stride = row_stride(in.query);
  p.q_head_stride = in.query.strides[thd ? 1 : 2];
  p.index_k = static_cast<const uint16_t*>(in.kv.data);
  p.k_batch_stride = batch_stride(in.kv);
  p.k_row_stride = row_stride(in.kv);
  p.topk_indices = static_cast<const int32_t*>(in.topk_indices.data);
  p.ids_batch_stride = batch_stride(in.topk_indices);
  p.ids_row_stride = row_stride(in.topk_indices);
  p.cu_seqlens_q = thd ? static_cast<const int32_t*>(in.cu_seqlens_q.data) : nullptr;
  p.cu_seqlens_k = thd ? static_cast<const int32_t*>(in.cu_seqlens_k.data) : nullptr;
  p.num_q_rows = g.num_q_rows;
  p.q_rows_per_batch = std::max<int64_t>(thd ? g.num_q_rows : g.s_q, 1);
  p.num_k_rows = g.num_k_rows;
  p.k_rows_per_batch = std::max<int64_t>(thd ? g.num_k_rows : g.s_kv, 1);
  p.batch = static_cast<int32_t>(g.batch);
  p.heads = static_cast<int32_t>(g.heads);
  p.head_dim = static_cast<int32_t>(g.head_dim);
  p.topk = static_cast<int32_t>(g.topk);
  p.head_groups = 1;  // a task is a whole row (every head)
  p.num_tasks = g.num_q_rows;
  p.thd = thd;
  p.global_ids = g.id_mode == IdMode::global;
  p.sm_scale = opt.sm_scale;
  t.lse = static_cast<const float*>(in.lse.data);
  t.lse_batch_stride = batch_stride(in.lse);
  t.lse_row_stride = row_stride(in.lse);
  t.lse_head_stride = in.lse.strides[thd ? 1 : 2];
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
using hopper::cuda_check;

std::size_t cuda_attention_target_workspace_size(const ProblemGeometry&, const AttentionTargetOptions&, int) {
  return 0;  // the kernel keeps everything in shared memory and the output
}

void run_cuda_attention_target(const AttentionTargetInputs& in, const AttentionTargetOutputs& out,
                               const AttentionTargetOptions& opt, const ProblemGeometry& g, void*, std::size_t) {
  if (g.num_k_rows > std::numeric_limits<int32_t>::max()) {
    throw Error(ErrorCode::invalid_argument, "kv",
                "kv: expected fewer than 2^31 key rows on the cuda backend, got " + std::to_string(g.num_k_rows));
  }
  if (g.topk > std::numeric_limits<int32_t>::max() / 2) {
    throw Error(ErrorCode::invalid_argument, "topk_indices",
                "topk_indices: expected topk below 2^30 on the cuda backend, got " + std::to_string(g.topk));
  }
  const int device = in.query.device_index;
  hopper::DeviceGuard guard(device);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  int64_t grid = 0;
  hopper::with_target_config(g.heads, g.head_dim, [&](auto c) { grid = hopper::target_grid<decltype(c)>(g.num_q_rows, device); });
  if (grid == 0) return;  // no query row: an empty output
  hopper::AttentionTargetParams params = hopper::make_target_params(in, out, opt, g);
  int32_t* buffer = nullptr;
  if (g.cu_seqlens_on_device_only) {
    IndexerInputs seqs;
    seqs.cu_seqlens_q = in.cu_seqlens_q;
    seqs.cu_seqlens_k = in.cu_seqlens_k;
    const IndexerInputs checked = check_device_cu_seqlens(seqs, g, stream, &buffer);
    params.in.cu_seqlens_q = static_cast<const int32_t*>(checked.cu_seqlens_q.data);
    params.in.cu_seqlens_k = static_cast<const int32_t*>(checked.cu_seqlens_k.data);
  }
  hopper::with_target_config(g.heads, g.head_dim, [&](auto c) {
    using Config = decltype(c);
    params.u_in_smem = opt.normalize && g.topk <= Config::kSmemTopk;
    hopper::attention_target_kernel<Config><<<static_cast<unsigned>(grid), Config::kThreads,
                                              hopper::attention_target_smem_bytes<Config>(), stream>>>(params);
  });
  hopper::cuda_check_launch("attention_target_kernel");
  if (buffer) finish_device_cu_seqlens(buffer, in.cu_seqlens_q.shape[0], {&out.attn_score}, stream);
}

}  // namespace dsaib::detail
