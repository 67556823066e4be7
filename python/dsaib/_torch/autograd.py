"""The autograd functions of dsaib.torch.indexer_kl_loss, by where its
gradients are formed (its option ``gradients``):

* IndexerKLLossFunction ("backward", and float64 leaves): the library's forward
  (the loss and each query row's log-sum-exp and target mass; no P) and, as its
  backward, the P-free backward fed those row statistics and autograd's
  upstream gradient as a device scalar.
* IndexerKLLossGradientsInForward ("forward"): the loss and its gradients at
  grad_loss 1 in the forward's one library call (indexer_kl_loss_and_grad),
  the gradients held until the backward, which scales them by the upstream
  gradient (in float32, rounded once). The gradient is linear in grad_loss,
  so this is the loss's gradient for any upstream value. On the cpu backend,
  where that value is 1 or a power of two, the bf16 gradients are bitwise the
  other form's and the float32 ones agree to float32 rounding (the two library
  calls sum in other orders); at other values, within one more rounding.
"""

import torch

from . import reference
from .convert import (fp64, grad_code, grad_loss_tensor, held_gradient_scale, library_inputs, logits_operand,
                      refuse_graph_of_gradient)
from .ops import scaled_gradient


class IndexerKLLossFunction(torch.autograd.Function):
    """forward(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q,
    cu_seqlens_k, sm_scale, loss_coeff, normalization_count, layout, id_mode,
    backend, strict_indices, num_threads, deterministic, a_operand_precision,
    l2_hints, start_stagger, topk_logits) -> the loss (0-dim).

    One library call in the forward (dsaib::indexer_kl_forward, which validates
    the arguments; float64 leaves: the validation alone, then the forward in
    torch) and one in the backward (the P-free indexer_backward). strict_indices
    is checked by the forward's call: the backward reads the same saved ids
    (autograd refuses ids changed in place since), so it does not read them again.
    """

    @staticmethod
    def forward(ctx, index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k, sm_scale,
                loss_coeff, normalization_count, layout, id_mode, backend, strict_indices, num_threads, deterministic,
                a_operand_precision, l2_hints, start_stagger, topk_logits=None):
        # CPU float64: the backward reads the forward's float64 row statistics, float64
        # weights and attn_score, and writes float64 gradients, all unrounded.
        library_fp64 = fp64(index_q.device, index_q, weights, index_k)
        q16, w_op, k16, ids32, T32 = library_inputs(index_q, weights, index_k, topk_indices, attn_score,
                                                    library_fp64, strict_indices)
        if any(t.dtype == torch.float64 for t in (index_q, weights, index_k)):
            loss, row_lse, row_target_mass = reference.float64_forward(
                index_q, weights, index_k, topk_indices, attn_score, sm_scale, loss_coeff, normalization_count,
                layout, id_mode, cu_seqlens_q, cu_seqlens_k, topk_logits)
        else:
            # The library's forward: the loss and each row's LSE and target
            # mass; no P (S_q x topk) is made, saved or passed on.
            loss, row_lse, row_target_mass, _ = torch.ops.dsaib.indexer_kl_forward(
                q16, w_op, k16, ids32, T32, cu_seqlens_q, cu_seqlens_k, sm_scale, loss_coeff, normalization_count,
                layout, id_mode, strict_indices, num_threads, backend, False,
                logits_operand(topk_logits, library_fp64))
        stats = torch.float64 if library_fp64 else torch.float32
        ctx.save_for_backward(q16, w_op, k16, ids32, T32, row_lse.to(stats), row_target_mass.to(stats),
                              cu_seqlens_q, cu_seqlens_k)
        ctx.in_dtypes = (index_q.dtype, weights.dtype, index_k.dtype)
        ctx.fp64 = library_fp64
        ctx.options = (sm_scale, loss_coeff, normalization_count, layout, id_mode, a_operand_precision, l2_hints,
                       start_stagger, deterministic, num_threads, backend)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_graph_of_gradient("dsaib.torch.indexer_kl_loss")
        q16, w_op, k16, ids32, T32, row_lse, row_target_mass, cu_q, cu_k = ctx.saved_tensors
        (sm_scale, loss_coeff, normalization_count, layout, id_mode, a_operand_precision, l2_hints, start_stagger,
         deterministic, num_threads, backend) = ctx.options
        q_dt, w_dt, k_dt = ctx.in_dtypes
        # Outputs straight in the input dtype when the library can write it.
        codes = tuple(grad_code(dt, ctx.fp64) for dt in (q_dt, w_dt, k_dt))
        g = grad_loss.detach().reshape(()).to(torch.float32)
        # The P-free backward: P rebuilt from the row statistics.
        dq, dw, dk = torch.ops.dsaib.indexer_backward(
            q16, w_op, k16, ids32, T32, None, g, cu_q, cu_k, sm_scale, loss_coeff, normalization_count,
            layout, id_mode, *codes, a_operand_precision, row_lse, row_target_mass, l2_hints, start_stagger, False,
            deterministic, num_threads, backend)
        need = ctx.needs_input_grad
        return (dq.to(q_dt) if need[0] else None, dw.to(w_dt) if need[1] else None,
                dk.to(k_dt) if need[2] else None) + (None,) * 17


class IndexerKLLossGradientsInForward(torch.autograd.Function):
    """forward(the arguments of IndexerKLLossFunction) -> the loss (0-dim).

    One library call, in the forward: dsaib::indexer_kl_loss_and_grad at
    grad_loss 1, which validates the arguments and writes the loss and the
    gradients in the leaves' dtypes (as the backward's call would). The
    backward multiplies each held gradient by autograd's upstream gradient (a
    device scalar, no host synchronisation) in float32 and rounds once to the
    gradient's dtype: exact when the upstream gradient is 1 or a power of two
    (short of overflow), else one more rounding. Holds those of d_index_q,
    d_weights and d_index_k whose leaves need a gradient (the size of those
    leaves) from the forward to the backward, and none of the inputs. A
    backward with create_graph=True raises when it starts, as the other
    form's does; not for float64 leaves.
    """

    @staticmethod
    def forward(ctx, index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k, sm_scale,
                loss_coeff, normalization_count, layout, id_mode, backend, strict_indices, num_threads, deterministic,
                a_operand_precision, l2_hints, start_stagger, topk_logits=None):
        q16, w_op, k16, ids32, T32 = library_inputs(index_q, weights, index_k, topk_indices, attn_score, False,
                                                    strict_indices)
        codes = tuple(grad_code(t.dtype, False) for t in (index_q, weights, index_k))
        one = grad_loss_tensor((1.0, None), index_q.device)
        loss, dq, dw, dk = torch.ops.dsaib.indexer_kl_loss_and_grad(
            q16, w_op, k16, ids32, T32, one, cu_seqlens_q, cu_seqlens_k, sm_scale, loss_coeff, normalization_count,
            layout, id_mode, *codes, a_operand_precision, "f32", strict_indices, l2_hints, start_stagger,
            deterministic, num_threads, backend, "auto", logits_operand(topk_logits))
        need = ctx.needs_input_grad
        ctx.save_for_backward(*(d if need[i] else None for i, d in enumerate((dq, dw, dk))))
        ctx.in_dtypes = (index_q.dtype, weights.dtype, index_k.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        g = held_gradient_scale(grad_loss, "dsaib.torch.indexer_kl_loss")
        grads = tuple(scaled_gradient(d, g, dt) for d, dt in zip(ctx.saved_tensors, ctx.in_dtypes))
        return grads + (None,) * 17
