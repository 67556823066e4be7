// The indexer KL loss and its gradients in one call, for an indexer trained only
// by this loss (detached from the main model's graph): the loss forward
// (indexer_kl_forward) writes each row's LSE and target mass into the
// workspace, then the P-free backward (indexer_backward with row_lse and
// row_target_mass) rebuilds P from them; the mass is divided by the sum of that
// rebuilt P, so the f32 LSE's rounding cancels (indexer_kl_forward.hpp) and the
// gradients do not degrade with |LSE|. No (S_q, topk) tensor of P exists
// anywhere; grad_loss may be read from device memory at run time, so one CUDA
// graph captured around the call serves every step. On cuda, where it applies
// (H <= 64, one A term, not deterministic, options.forward_fusion automatic),
// one kernel runs both: the backward's CTA runs the forward's pass over its
// next row (docs/hopper-kernel.md, "The loss-and-gradient kernel").
#pragma once

#include <cstddef>

#include "dsaib/indexer_backward.hpp"

namespace dsaib {

/// Outputs of indexer_kl_loss_and_grad(), on the backend's device, disjoint
/// from each other and from every input:
///   loss (f32, cpu: or f64; shape ()) as indexer_kl_forward() writes it (grad_loss does not
///   scale it), and d_index_q, d_weights, d_index_k as indexer_backward() writes
///   them (bf16 or f32 each, cpu: or f64; contiguous).
struct IndexerKLLossAndGradOutputs {
  TensorView loss;
  TensorView d_index_q;
  TensorView d_weights;
  TensorView d_index_k;
};

/// Bytes of scratch memory indexer_kl_loss_and_grad() needs on the backend's
/// device. cpu: 0. cuda, one kernel: the row statistics (2 * 4 bytes per query
/// row), the row loss terms (8 bytes per row), the logits (4 * topk rounded up
/// to 64, per CTA of the grid) and, for a bf16 d_index_k, the fp32 dK
/// accumulator, each part rounded up to 256 bytes. cuda, two kernels: the row
/// statistics, then indexer_kl_forward_workspace_size's and
/// indexer_backward_workspace_size's scratch (the larger of the two: they are
/// used one after the other); with H > 64 or deterministic also P (4 * topk
/// bytes per query row, rounded up to 256), which the forward then writes for
/// the backward of the P form. Validates like indexer_kl_loss_and_grad().
std::size_t indexer_kl_loss_and_grad_workspace_size(const IndexerInputs& inputs,
                                                    const IndexerKLLossAndGradOutputs& outputs,
                                                    const IndexerOptions& options);

/// Computes the loss and the three gradients in one host call.
///
/// `inputs` are the backward's without P: index_score, row_lse and
/// row_target_mass absent. Options as for indexer_backward() (grad_loss or
/// grad_loss_device scales the gradients; loss_coeff, normalization_count and
/// sm_scale enter both). All validation (the forward's and the backward's rules)
/// happens before anything is written. cuda: on options.stream, the one kernel
/// (then the loss terms' sum and, for a bf16 d_index_k, its cast), or two
/// launches (the forward, then the backward), no host synchronisation, nothing allocated when
/// a workspace is given, so the call can be captured in a CUDA graph (THD
/// included: see docs/api.md on cu_seqlens while capturing). The loss is bitwise
/// reproducible; the gradients as indexer_backward()'s. cpu: the fp64 forward
/// and the fp64 P-free backward, from the fp64 row statistics.
void indexer_kl_loss_and_grad(const IndexerInputs& inputs, const IndexerKLLossAndGradOutputs& outputs,
                              const IndexerOptions& options, void* workspace = nullptr,
                              std::size_t workspace_bytes = 0);

}  // namespace dsaib
