// The one parameter-and-geometry fill (problem_params.hpp).
#include "hopper/launch/problem_params.hpp"

#include <algorithm>
#include <vector>

namespace dsaib::hopper {

int64_t flat_batch_stride(const TensorView& v, const detail::ProblemGeometry& g) {
  return g.layout == Layout::thd ? int64_t{0} : v.strides[0];
}

int64_t flat_row_stride(const TensorView& v, const detail::ProblemGeometry& g) {
  return g.layout == Layout::thd ? v.strides[0] : v.strides[1];
}

TensorView rows_view(void* data, const detail::ProblemGeometry& g, int device, int64_t per_row) {
  std::vector<int64_t> shape;
  if (g.layout == Layout::thd) shape = {g.num_q_rows};
  else shape = {g.batch, g.s_q};
  if (per_row > 0) shape.push_back(per_row);
  return contiguous_view(data, DType::f32, shape.data(), static_cast<int32_t>(shape.size()), DeviceType::cuda, device);
}

IndexerParams problem_params(const ProblemTensors& t, const detail::ProblemGeometry& g, int64_t head_groups) {
  const bool thd = g.layout == Layout::thd;
  IndexerParams p{};
  p.index_q = static_cast<const uint16_t*>(t.query.data);
  p.q_batch_stride = flat_batch_stride(t.query, g);
  p.q_row_stride = flat_row_stride(t.query, g);
  p.q_head_stride = t.query.strides[thd ? 1 : 2];
  if (t.weights.present()) {
    p.weights = t.weights.data;
    p.weights_f32 = t.weights.dtype == DType::f32;
    p.w_batch_stride = flat_batch_stride(t.weights, g);
    p.w_row_stride = flat_row_stride(t.weights, g);
  }
  p.index_k = static_cast<const uint16_t*>(t.keys.data);
  p.k_batch_stride = flat_batch_stride(t.keys, g);
  p.k_row_stride = flat_row_stride(t.keys, g);
  p.topk_indices = static_cast<const int32_t*>(t.topk_indices.data);
  p.ids_batch_stride = flat_batch_stride(t.topk_indices, g);
  p.ids_row_stride = flat_row_stride(t.topk_indices, g);
  p.cu_seqlens_q = thd ? static_cast<const int32_t*>(t.cu_seqlens_q.data) : nullptr;
  p.cu_seqlens_k = thd ? static_cast<const int32_t*>(t.cu_seqlens_k.data) : nullptr;
  p.num_q_rows = g.num_q_rows;
  p.q_rows_per_batch = std::max<int64_t>(thd ? g.num_q_rows : g.s_q, 1);
  p.num_k_rows = g.num_k_rows;
  p.k_rows_per_batch = std::max<int64_t>(thd ? g.num_k_rows : g.s_kv, 1);
  p.batch = static_cast<int32_t>(g.batch);
  p.heads = static_cast<int32_t>(g.heads);
  p.head_dim = static_cast<int32_t>(g.head_dim);
  p.topk = static_cast<int32_t>(g.topk);
  p.head_groups = static_cast<int32_t>(head_groups);
  p.num_tasks = g.num_q_rows * head_groups;
  p.thd = thd;
  p.global_ids = g.id_mode == IdMode::global;
  return p;
}

IndexerParams indexer_params(const IndexerInputs& in, const IndexerBackwardOutputs& out, const IndexerOptions& opt,
                             const detail::ProblemGeometry& g, int64_t head_groups, float* dk_accum) {
  IndexerParams p = problem_params({in.index_q, in.weights, in.index_k, in.topk_indices, in.cu_seqlens_q, in.cu_seqlens_k},
                                   g, head_groups);
  p.attn_score = static_cast<const float*>(in.attn_score.data);
  p.attn_score_batch_stride = flat_batch_stride(in.attn_score, g);
  p.attn_score_row_stride = flat_row_stride(in.attn_score, g);
  p.index_score = static_cast<const float*>(in.index_score.data);
  p.index_score_batch_stride = flat_batch_stride(in.index_score, g);
  p.index_score_row_stride = flat_row_stride(in.index_score, g);
  p.sm_scale = opt.sm_scale;
  p.loss_coeff_over_n = static_cast<float>(static_cast<double>(opt.loss_coeff) / static_cast<double>(g.normalization_count));
  p.grad_loss_ptr = opt.grad_loss_device;
  p.grad_loss_value = opt.grad_loss;
  p.d_index_q = out.d_index_q.data;
  p.d_weights = out.d_weights.data;
  p.dq_f32 = out.d_index_q.dtype == DType::f32;
  p.dw_f32 = out.d_weights.dtype == DType::f32;
  p.dk_accum = dk_accum;
  return p;
}

}  // namespace dsaib::hopper
