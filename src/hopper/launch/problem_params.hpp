// The one parameter-and-geometry fill: the problem's tensors, sizes and tasks
// as every family's kernel parameters hold them (IndexerParams, also the
// attention target's and the loss forward's `in`).
#pragma once

#include "core/problem.hpp"
#include "hopper/common/kernel_params.hpp"

namespace dsaib::hopper {

/// The tensors a kernel reads by flat row, and their cu_seqlens: query rows
/// (index_q, or the target's query), their weights (absent for the target),
/// key rows (index_k, or the target's kv) and the topk ids.
struct ProblemTensors {
  const TensorView& query;
  const TensorView& weights;
  const TensorView& keys;
  const TensorView& topk_indices;
  const TensorView& cu_seqlens_q;
  const TensorView& cu_seqlens_k;
};

/// Flat-row addressing (BSHD: (row / S) * stride0 + (row % S) * stride1; THD:
/// row * stride0, batch strides 0), the sizes, and the tasks: head_groups per
/// query row (1: a task is a whole row), num_q_rows * head_groups in all.
IndexerParams problem_params(const ProblemTensors& t, const detail::ProblemGeometry& g, int64_t head_groups);

/// The indexer's parameters: problem_params of index_q, weights, index_k and
/// topk_indices, then T and P as given (the P-free kernels read packed row
/// statistics there instead, set by their caller), the scalars (sm_scale,
/// c = grad_loss * loss_coeff / N with grad_loss read in the kernel when it is a
/// device scalar) and the gradients (dk_accum: the fp32 dK accumulator, or null).
IndexerParams indexer_params(const IndexerInputs& in, const IndexerBackwardOutputs& out, const IndexerOptions& opt,
                             const detail::ProblemGeometry& g, int64_t head_groups, float* dk_accum);

/// An f32 tensor of one value per query row ((B, S_q) or (T_q)), or of
/// `per_row` values ((B, S_q, per_row) or (T_q, per_row)), contiguous at
/// `data` on cuda device `device`: the row statistics and P that one kernel
/// writes into a workspace for the next.
TensorView rows_view(void* data, const detail::ProblemGeometry& g, int device, int64_t per_row = 0);

/// The row strides of a (B, S, ...) or (T, ...) tensor as the kernels read it.
int64_t flat_batch_stride(const TensorView& v, const detail::ProblemGeometry& g);
int64_t flat_row_stride(const TensorView& v, const detail::ProblemGeometry& g);

}  // namespace dsaib::hopper
