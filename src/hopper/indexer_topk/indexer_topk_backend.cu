// indexer_topk() on cuda (api/cuda_backend.hpp): the selection kernel
// (indexer_topk_kernel.cuh) over the query rows, then the ordering kernel
// (topk_order_kernel.cuh). No host synchronisation.
#include <cuda_runtime.h>

#include <string>

#include "api/cuda_backend.hpp"
#include "hopper/common/cuda_check.hpp"
#include "hopper/common/device_cu_seqlens.hpp"
#include "hopper/indexer_topk/indexer_topk_kernel.cuh"
#include "hopper/indexer_topk/topk_order_kernel.cuh"
#include "hopper/launch/device.hpp"

namespace dsaib::hopper {
namespace {

/// Calls f(TopkTileConfig<D, head tile[, e4m3]>{}) for the plan's kernel
/// (float8 inputs: D 128).
template <class F>
void with_topk_config(const TopkPlan& plan, F&& f) {
  if (plan.e4m3) {
    using E4m3 = cutlass::float_e4m3_t;
    if (plan.head_tile == 32) f(TopkTileConfig<128, 32, E4m3>{});
    else if (plan.head_tile == 64) f(TopkTileConfig<128, 64, E4m3>{});
    else f(TopkTileConfig<128, 128, E4m3>{});
    return;
  }
  if (plan.head_dim == 64) {
    if (plan.head_tile == 32) f(TopkTileConfig<64, 32>{});
    else if (plan.head_tile == 64) f(TopkTileConfig<64, 64>{});
    else f(TopkTileConfig<64, 128>{});
  } else {
    if (plan.head_tile == 32) f(TopkTileConfig<128, 32>{});
    else if (plan.head_tile == 64) f(TopkTileConfig<128, 64>{});
    else f(TopkTileConfig<128, 128>{});
  }
}

template <int kThreads, int kItems>
void launch_order(const IndexerTopkParams& params, int64_t grid, cudaStream_t stream) {
  auto kernel = topk_order_kernel<kThreads, kItems>;
  const int smem = static_cast<int>(sizeof(typename cub::BlockRadixSort<unsigned long long, kThreads, kItems>::TempStorage));
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(topk_order_kernel)");
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(params);
  cuda_check_launch("topk_order_kernel");
}

/// The ordering kernel whose kThreads x kItems is the smallest that holds topk.
void launch_order_for(const IndexerTopkParams& params, int64_t grid, cudaStream_t stream) {
  const int topk = params.topk;
  if (topk <= 128) launch_order<128, 1>(params, grid, stream);
  else if (topk <= 256) launch_order<128, 2>(params, grid, stream);
  else if (topk <= 512) launch_order<128, 4>(params, grid, stream);
  else if (topk <= 1024) launch_order<256, 4>(params, grid, stream);
  else if (topk <= 2048) launch_order<256, 8>(params, grid, stream);
  else if (topk <= 4096) launch_order<512, 8>(params, grid, stream);
  else launch_order<512, 16>(params, grid, stream);
}

int topk_ctas_per_sm(const TopkPlan& plan) {
  int ctas = 0;
  with_topk_config(plan, [&](auto c) {
    using Config = decltype(c);
    ctas = resident_ctas_per_sm(indexer_topk_kernel<Config>, Config::kThreads, topk_shared_storage_bytes<Config>(),
                                "indexer_topk_kernel");
  });
  return ctas;
}

/// Leading strides of a (B, S, ...) BSHD or (T, ...) THD view: (batch, row).
void row_strides(const TensorView& v, bool thd, int64_t* batch_stride, int64_t* row_stride) {
  *batch_stride = thd ? 0 : v.strides[0];
  *row_stride = thd ? v.strides[0] : v.strides[1];
}

IndexerTopkParams topk_params(const TopkPlan& plan, const IndexerTopkInputs& in, const IndexerTopkOutputs& out,
                              const IndexerTopkOptions& opt, const detail::ProblemGeometry& g, char* workspace,
                              const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k) {
  const bool thd = opt.layout == Layout::thd;
  IndexerTopkParams p{};
  p.index_q = in.index_q.data;
  row_strides(in.index_q, thd, &p.q_batch_stride, &p.q_row_stride);
  p.q_head_stride = in.index_q.strides[thd ? 1 : 2];
  p.weights = in.weights.data;
  p.weights_f32 = in.weights.dtype == DType::f32;
  row_strides(in.weights, thd, &p.w_batch_stride, &p.w_row_stride);
  p.index_k = in.index_k.data;
  row_strides(in.index_k, thd, &p.k_batch_stride, &p.k_row_stride);
  if (in.index_q_scale.present()) {
    p.index_q_scale = static_cast<const float*>(in.index_q_scale.data);
    row_strides(in.index_q_scale, thd, &p.qs_batch_stride, &p.qs_row_stride);
  }
  if (in.index_k_scale.present()) {
    p.index_k_scale = static_cast<const float*>(in.index_k_scale.data);
    row_strides(in.index_k_scale, thd, &p.ks_batch_stride, &p.ks_row_stride);  // a key row's scale: one element
  }
  if (in.starts.present()) {
    p.starts = static_cast<const int32_t*>(in.starts.data);
    p.ends = static_cast<const int32_t*>(in.ends.data);
    row_strides(in.starts, thd, &p.starts_batch_stride, &p.starts_row_stride);
    row_strides(in.ends, thd, &p.ends_batch_stride, &p.ends_row_stride);
  }
  p.cu_seqlens_q = cu_seqlens_q;
  p.cu_seqlens_k = cu_seqlens_k;
  p.num_q_rows = g.num_q_rows;
  p.q_rows_per_batch = std::max<int64_t>(1, thd ? g.num_q_rows : g.s_q);
  p.num_k_rows = g.num_k_rows;
  p.k_rows_per_batch = std::max<int64_t>(1, thd ? g.num_k_rows : g.s_kv);
  p.batch = static_cast<int32_t>(g.batch);
  p.heads = static_cast<int32_t>(g.heads);
  p.topk = static_cast<int32_t>(g.topk);
  p.thd = thd;
  p.global_ids = opt.id_mode == IdMode::global;
  p.id_ascending = opt.order == TopkOrder::id_ascending;
  p.causal_offset_auto = opt.causal_offset == kCausalOffsetAuto;
  p.causal_offset = opt.causal_offset;
  p.rows_per_task = plan.rows_per_task;
  p.num_tasks = plan.num_tasks;
  p.candidates = reinterpret_cast<unsigned long long*>(workspace + plan.candidates_at);
  p.candidate_capacity = plan.candidate_capacity;
  p.key_lo = static_cast<uint32_t*>(out.topk_indices.data);
  p.key_hi = plan.key_hi_in_workspace ? reinterpret_cast<uint32_t*>(workspace + plan.key_hi_at)
                                      : static_cast<uint32_t*>(out.topk_logits.data);
  p.row_count = plan.row_count_in_workspace ? reinterpret_cast<int32_t*>(workspace + plan.row_count_at)
                                            : static_cast<int32_t*>(out.topk_lengths.data);
  p.write_logits = !plan.key_hi_in_workspace;
  return p;
}

}  // namespace
}  // namespace dsaib::hopper

namespace dsaib::detail {

hopper::TopkPlan plan_cuda_indexer_topk(const IndexerTopkInputs& in, const IndexerTopkOutputs& out,
                                        const ProblemGeometry& g) {
  hopper::DeviceGuard guard(in.index_q.device_index);
  check_cuda_key_rows(g);  // validation raised it already
  const bool with_logits = out.topk_logits.present(), with_lengths = out.topk_lengths.present();
  const bool e4m3 = in.index_q.dtype == DType::e4m3;
  hopper::TopkPlan plan =
      hopper::plan_indexer_topk(g, with_logits, with_lengths, hopper::query_device_properties(), e4m3);
  return hopper::plan_indexer_topk(g, with_logits, with_lengths,
                                   hopper::with_ctas_per_sm(plan.device, hopper::topk_ctas_per_sm(plan)), e4m3);
}

void run_cuda_indexer_topk(const hopper::TopkPlan& plan, const IndexerTopkInputs& in, const IndexerTopkOutputs& out,
                           const IndexerTopkOptions& opt, const ProblemGeometry& g, void* workspace,
                           std::size_t workspace_bytes) {
  if (g.num_q_rows == 0) return;
  hopper::DeviceGuard guard(in.index_q.device_index);
  cudaStream_t stream = static_cast<cudaStream_t>(opt.stream);
  DeviceCuSeqlens checked;
  if (g.cu_seqlens_on_device_only) checked = check_device_cu_seqlens(in.cu_seqlens_q, in.cu_seqlens_k, g, stream);
  const int32_t* cu_q = checked.buffer ? checked.cu_seqlens_q : static_cast<const int32_t*>(in.cu_seqlens_q.data);
  const int32_t* cu_k = checked.buffer ? checked.cu_seqlens_k : static_cast<const int32_t*>(in.cu_seqlens_k.data);
  hopper::CallWorkspace ws(workspace, workspace_bytes, plan.workspace_bytes, stream, "top-k workspace");
  const hopper::IndexerTopkParams params = hopper::topk_params(plan, in, out, opt, g, ws.data(), cu_q, cu_k);
  if (plan.grid > 0) {
    hopper::with_topk_config(plan, [&](auto c) {
      using Config = decltype(c);
      hopper::indexer_topk_kernel<Config><<<static_cast<unsigned>(plan.grid), Config::kThreads,
                                            hopper::topk_shared_storage_bytes<Config>(), stream>>>(params);
      hopper::cuda_check_launch("indexer_topk_kernel");
    });
    hopper::launch_order_for(params, plan.order_grid, stream);
  }
  finish_device_cu_seqlens(checked, {&out.topk_indices, &out.topk_logits, &out.topk_lengths}, stream);
  ws.release();
}

}  // namespace dsaib::detail
