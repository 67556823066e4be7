"""The autograd function of dsaib.distributed.context_parallel_indexer_kl_loss
(the module's docstring says how the split, the all-gather of the keys and
the reduce-scatter of their gradient work): in its two gradient forms, the
gradients formed by the forward's one library call and scaled in the
backward, or the loss forward and the P-free backward."""

import torch
import torch.distributed as dist

from . import reference
from .convert import (fp64 as _fp64, grad_code, grad_loss_tensor, held_gradient_scale, library_inputs, logits_operand,
                      refuse_graph_of_gradient)
from .ops import scaled_gradient  # (and registers torch.ops.dsaib.*)
from .cp_plan import finish, normalization, start_gather, start_reduce_scatter


def resolved_a_operand(a_operand_precision, q_code, k_code):
    """'auto' as the single-GPU op resolves it for these leaves (the CP backward
    always writes d_index_k in float32 (or float64) for the reduction, which
    would otherwise turn 'auto' into two terms for bf16 leaves)."""
    if a_operand_precision != "auto":
        return a_operand_precision
    return "bf16x2" if ("f32" in (q_code, k_code) or "f64" in (q_code, k_code)) else "bf16"


class ContextParallelKLLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, index_q, weights, index_k, topk_indices, attn_score, plan, sm_scale, loss_coeff,
                normalization_count, id_mode, a_operand_precision, in_forward, topk_logits=None):
        fp64 = any(t.dtype == torch.float64 for t in (index_q, weights, index_k))
        # CPU float64: through the library in float64 too (its fp64 CPU backend).
        library_fp64 = _fp64(index_q.device, index_q, weights, index_k)
        k_send = index_k if fp64 else index_k.to(torch.bfloat16)
        gathered, work = start_gather(plan, k_send)
        try:
            # While the keys travel: the local conversions (the library's checks
            # of the arguments ran before the exchange, in plan).
            n = normalization(plan, normalization_count)
            # (index_k itself is converted whole after the gather; an empty slice stands in here)
            q16, w_op, _, ids32, T32 = library_inputs(index_q, weights, index_k[:0], topk_indices, attn_score,
                                                      library_fp64)
        finally:
            finish(work)
        k_whole = plan.to_sequence_order(gathered)
        k16 = k_whole.to(torch.bfloat16).contiguous()
        ctx.plan = plan
        ctx.in_dtypes = (index_q.dtype, weights.dtype, index_k.dtype)
        ctx.in_forward = in_forward
        if in_forward:
            # The loss and this rank's gradients at grad_loss 1 in one call: d_index_k's
            # share of the whole sequence is held in float32 and reduce-scattered in
            # the backward, after each rank scales its own share (as the other form).
            q_code, w_code, k_code = (grad_code(dt, False) for dt in ctx.in_dtypes)
            loss, dq, dw, dk_whole = torch.ops.dsaib.indexer_kl_loss_and_grad(
                q16, w_op, k16, ids32, T32, grad_loss_tensor((1.0, None), index_q.device), plan.cu_q_local,
                plan.cu_k, float(sm_scale), float(loss_coeff), n, plan.layout, id_mode, q_code, w_code, "f32",
                resolved_a_operand(a_operand_precision, q_code, k_code), "f32", False, "auto", "auto", False, 0,
                None, "auto", logits_operand(topk_logits))
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=plan.group)
            need = ctx.needs_input_grad
            ctx.save_for_backward(dq if need[0] else None, dw if need[1] else None, dk_whole if need[2] else None)
            return loss
        if fp64:
            loss, row_lse, row_target_mass = reference.float64_forward(
                index_q, weights, k_whole, topk_indices, attn_score, sm_scale, loss_coeff, n, plan.layout,
                id_mode, plan.cu_q_local, plan.cu_k, topk_logits)
        else:
            loss, row_lse, row_target_mass, _ = torch.ops.dsaib.indexer_kl_forward(
                q16, w_op, k16, ids32, T32, plan.cu_q_local, plan.cu_k, float(sm_scale), float(loss_coeff), n,
                plan.layout, id_mode, False, 0, None, False, logits_operand(topk_logits, library_fp64))
        # Every rank returns the global loss; backward() on a rank carries its own share.
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=plan.group)
        stats = torch.float64 if library_fp64 else torch.float32
        ctx.save_for_backward(q16, w_op, k16, ids32, T32, row_lse.to(stats), row_target_mass.to(stats))
        ctx.fp64 = library_fp64
        ctx.options = (float(sm_scale), float(loss_coeff), n, id_mode, a_operand_precision)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.in_forward:
            return ContextParallelKLLoss.scale_held(ctx, grad_loss)
        refuse_graph_of_gradient("dsaib.distributed.context_parallel_indexer_kl_loss")
        q16, w_op, k16, ids32, T32, row_lse, row_target_mass = ctx.saved_tensors
        plan = ctx.plan
        sm_scale, loss_coeff, n, id_mode, a_operand_precision = ctx.options
        q_dt, w_dt, k_dt = ctx.in_dtypes
        q_code, w_code, k_code = (grad_code(dt, ctx.fp64) for dt in (q_dt, w_dt, k_dt))
        g = grad_loss.detach().reshape(()).to(torch.float32)
        # d_index_k's shares: float32 (float64 in the fp64 mode) for the sum over the ranks.
        dk_code = "f64" if ctx.fp64 else "f32"
        dq, dw, dk_whole = torch.ops.dsaib.indexer_backward(
            q16, w_op, k16, ids32, T32, None, g, plan.cu_q_local, plan.cu_k, sm_scale, loss_coeff, n,
            plan.layout, id_mode, q_code, w_code, dk_code, resolved_a_operand(a_operand_precision, q_code, k_code),
            row_lse, row_target_mass)
        dk, work = start_reduce_scatter(plan, dk_whole)
        need = ctx.needs_input_grad
        dq = dq.to(q_dt) if need[0] else None
        dw = dw.to(w_dt) if need[1] else None
        finish(work)
        return dq, dw, dk.to(k_dt) if need[2] else None, None, None, None, None, None, None, None, None, None, None

    @staticmethod
    def scale_held(ctx, grad_loss):
        """The backward of the gradients formed in the forward: each held one times
        this rank's upstream gradient, in float32, rounded once; d_index_k's share
        then reduce-scattered."""
        g = held_gradient_scale(grad_loss, "dsaib.distributed.context_parallel_indexer_kl_loss")
        dq, dw, dk_whole = ctx.saved_tensors
        q_dt, w_dt, k_dt = ctx.in_dtypes
        dk = work = None
        if dk_whole is not None:
            dk, work = start_reduce_scatter(ctx.plan, dk_whole * g)
        dq, dw = scaled_gradient(dq, g, q_dt), scaled_gradient(dw, g, w_dt)
        if work is not None:
            finish(work)
            dk = dk.to(k_dt)
        return dq, dw, dk, None, None, None, None, None, None, None, None, None, None
