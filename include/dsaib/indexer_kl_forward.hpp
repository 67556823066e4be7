// The forward of the indexer KL loss (docs/kl-forward.md, docs/math.md §2): the
// scalar loss whose gradient indexer_backward() computes, and the per-row
// statistics from which a backward can rebuild P without storing it.
//
// Per query row, over its VALID selected slots i (id in range for the row's
// sequence; invalid slots are ignored and never dereferenced):
//
//   z_i   = sm_scale * sum_h w_h relu(q_h . k_{id_i})
//   LSE   = log sum_i exp(z_i)          (no valid slot: -infinity)
//   P_i   = exp(z_i - LSE)              (0 at invalid slots and in rows without a valid slot)
//   T~_i  = max(T_i, eps),  eps = exp(-100)
//   Loss  = -(loss_coeff / N) * sum_rows sum_i T~_i log(max(P_i, eps))
//
// with N = options.normalization_count (0: the number of query rows). A row
// without a valid slot contributes no loss term.
//
// The row statistics are what the P-free backward (indexer_backward with
// row_lse and row_target_mass) needs. row_lse is the LSE rounded to f32 (up to
// |LSE| 2^-24, the same error for every slot of the row). That backward
// rebuilds Pb_i = exp(z_i - row_lse) = c P_i with c = sum_i Pb_i, so the
// forward writes
//
//   row_target_mass = sum_i T~_i [Pb_i >= eps] / sum_i Pb_i    (over the valid slots)
//
// i.e. the target mass, with the backward's mask, divided by the sum of
// exp(z_i - LSE) as rounded; its score gradient then equals the exact one to
// rounding however large |LSE| is. c is 1 up to that rounding (1 to its fp64
// rounding, |LSE| 1e-16, in the fp64 reference_kl_forward). P (index_score) is
// exp((z_i - max z) - log sum exp(z - max z)): it carries no LSE rounding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dsaib/indexer_backward.hpp"

namespace dsaib {

/// Outputs of indexer_kl_forward(): loss (the scalar Loss), row_lse (per query
/// row; -inf: no valid slot), row_target_mass (per query row, above) and the
/// optional index_score (P; absent: not written). All f32 (cpu: each f32 or
/// f64, the fp64 result unrounded), contiguous, on the backend's device,
/// disjoint from each other and from every input; shapes: docs/api.md, "The
/// loss forward". Every element is overwritten; incoming contents never matter.
struct IndexerKLForwardOutputs {
  TensorView loss;
  TensorView row_lse;
  TensorView row_target_mass;
  TensorView index_score;
};

/// Bytes of scratch memory indexer_kl_forward() needs on the backend's device.
/// cpu: 0. cuda: 8 bytes per query row (the per-row loss terms, summed in a
/// fixed order afterwards) and 4 * topk bytes per resident CTA of the kernel
/// (a row's logits), each part rounded up to 256 bytes.
/// Validates like indexer_kl_forward() and raises the same errors.
std::size_t indexer_kl_forward_workspace_size(const IndexerInputs& inputs,
                                              const IndexerKLForwardOutputs& outputs,
                                              const IndexerOptions& options);

/// Computes the loss, the per-row statistics and optionally P.
///
/// `inputs` are the backward's, with index_score absent (the forward produces
/// it: outputs.index_score). Used options: layout, id_mode, backend, sm_scale,
/// loss_coeff, normalization_count, strict_indices, stream, num_threads. The
/// others (grad_loss, grad_loss_device, deterministic, a_operand_precision,
/// l2_hints, start_stagger) do not change the result but are checked as for
/// indexer_backward(), so one options struct serves both calls and a bad value
/// is refused here too. The loss is bitwise reproducible on every backend.
///
/// All validation happens before any output is written; on any error nothing
/// is written. Errors as indexer_backward(), with the outputs' rules above
/// (dtype f32, shapes, contiguity, no overlap) naming the output. `workspace`
/// as for indexer_backward(): null with workspace_bytes 0 lets the cuda backend
/// allocate it (stream-ordered), else at least
/// indexer_kl_forward_workspace_size() bytes, 256-byte aligned.
void indexer_kl_forward(const IndexerInputs& inputs, const IndexerKLForwardOutputs& outputs,
                        const IndexerOptions& options, void* workspace = nullptr,
                        std::size_t workspace_bytes = 0);

/// The forward in fp64 on the host (cpu tensors; index_score absent), row-major:
/// row_lse and row_target_mass (num_q_rows), index_score (num_q_rows, topk).
/// row_lse is not rounded, so its row_target_mass is the target mass divided by
/// sum_i exp(z_i - LSE) = 1 to rounding.
struct ReferenceKLForward {
  int64_t num_q_rows = 0, topk = 0;
  double loss = 0;
  std::vector<double> row_lse, row_target_mass, index_score;
};
/// Raises the input and option errors of indexer_kl_forward(); options.backend is
/// ignored (always cpu), options.num_threads is honoured (the result does not depend on it).
ReferenceKLForward reference_kl_forward(const IndexerInputs& inputs, const IndexerOptions& options);

}  // namespace dsaib
