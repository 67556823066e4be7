"""The hooks Megatron-Core's DSA layer looks up by name in a kernel backend
(module ``megatron.core.transformer.experimental_attention_variant.dsa_kernels``): the indexer's top-k and
its sparse KL loss on dsaib, the main attention handed to the backend named
at registration (or to Megatron's own torch code).

Megatron's tensors are sequence-first: ``q [sq, b, H, D]``, ``k [skv, b, D]``,
``weights [sq, b, H]`` (already scaled by H^-0.5 D^-0.5), ``query
[sq, b, np, Dqk]`` and ``key [skv, b, 1, Dqk]`` (the absorbed MLA, detached),
``starts``/``ends [sq]``: each query row's key range ``[start, end)`` in
``k``'s own rows. Packed sequences arrive with ``b = 1`` and ranges that keep
each row inside its sequence; under context parallelism ``k`` and ``key``
arrive all-gathered in sequence order and the ranges in those coordinates.
dsaib reads all of them as one BSHD batch of ``b`` sequences of ``skv`` keys
whose ranges are given, so the ids it returns are rows of ``k``, which is
what Megatron's main attention takes.
"""

from __future__ import annotations

import importlib

import torch

from .. import torch as _dt
from .._args import _INT32_MAX, _finite_f32, _int_value
from .._torch.convert import check_same_device, check_tensor_types, held_gradient_scale, range_int32
from .._torch.ops import scaled_gradient

#: What register() set: the main attention's backend and the order of the ids.
SETTINGS = {"attention": None, "order": "logit_descending"}

#: Megatron's floor for a target row's sum and for T inside log(T)
#: (dsa_indexer_loss.INDEXER_LOSS_EPS), so that the loss reported is its KL.
_TARGET_FLOOR = 1e-10

_ATTENTION_MODULES = {
    "cudnn": "megatron.core.transformer.experimental_attention_variant.dsa_cudnn_kernels",
    "tilelang": "megatron.core.transformer.experimental_attention_variant.dsa_tilelang_kernels",
}


def _check_relu(use_relu):
    if not use_relu:
        raise ValueError("dsa_indexer_scoring_relu: expected True with dsa_kernel_backend=\"dsaib\" (dsaib's "
                         "indexer logits are sum_h w_h * ReLU(q_h . k)), got False")


def _check_arguments(q, k, weights, index_topk, starts, ends):
    """The hook's own arguments in Megatron's names and sequence-first shapes,
    before dsaib sees its transposed views: tensors of real floating dtypes
    (``starts``/``ends`` of an integer one) on ``q``'s device, ``q
    [sq, b, H, D]``, ``k [skv, b, D]``, ``weights [sq, b, H]``, ``starts``/``ends
    [sq]``, ``index_topk`` an int >= 1 (dsaib's rules for ``topk``); returns
    index_topk."""
    check_tensor_types(q=q, k=k, weights=weights, starts=starts, ends=ends)
    for name, t in dict(q=q, k=k, weights=weights).items():
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point dtype, got {t.dtype}")
    check_same_device(q, k=k, weights=weights, starts=starts, ends=ends)
    ranks = dict(q=(q, 4, "[sq, b, H, D]"), k=(k, 3, "[skv, b, D]"), weights=(weights, 3, "[sq, b, H]"),
                 starts=(starts, 1, "[sq]"), ends=(ends, 1, "[sq]"))
    for name, (t, rank, what) in ranks.items():
        if t.dim() != rank:
            raise ValueError(f"{name}: expected a rank-{rank} tensor {what}, got shape {tuple(t.shape)}")
    sq, b, H, D = q.shape
    if k.shape[1:] != (b, D):
        raise ValueError(f"k: expected shape (skv, {b}, {D}) ([skv, b, D], b and D of q), got shape "
                         f"{tuple(k.shape)}")
    for name, t, want, what in (("weights", weights, (sq, b, H), "[sq, b, H]"), ("starts", starts, (sq,), "[sq]"),
                                ("ends", ends, (sq,), "[sq]")):
        if t.shape != want:
            raise ValueError(f"{name}: expected shape {want} ({what}, of q's sizes), got shape {tuple(t.shape)}")
    return _int_value("index_topk", index_topk, 1, _INT32_MAX, "[1, 2^31-1]")


def _check_loss_arguments(q, k, query, key, softmax_scale, loss_coeff, query_valid_rows):
    """The loss hook's main-attention tensors against the indexer's, in
    Megatron's names, before anything runs: ``query [sq, b, np, Dqk]`` with
    q's sq and b, ``key [skv, b, 1, Dqk]`` with k's skv (its rows are the keys
    the ids select) and query's Dqk, ``query_valid_rows`` None, ``[sq]``,
    ``[1, sq]`` or ``[b, sq]`` (Megatron's rule), ``softmax_scale`` and
    ``loss_coeff`` finite real numbers; returns loss_coeff as float32."""
    check_tensor_types(query=query, key=key)
    check_same_device(q, query=query, key=key)
    sq, b = q.shape[0], q.shape[1]
    skv = k.shape[0]
    if query.dim() != 4 or query.shape[:2] != (sq, b):
        raise ValueError(f"query: expected shape ({sq}, {b}, np, Dqk) ([sq, b, np, Dqk], sq and b of q), got shape "
                         f"{tuple(query.shape)}")
    if key.dim() != 4 or key.shape[:3] != (skv, b, 1) or key.shape[3] != query.shape[3]:
        raise ValueError(f"key: expected shape ({skv}, {b}, 1, {query.shape[3]}) ([skv, b, 1, Dqk] of the absorbed "
                         f"MLA: skv of k, b of q, Dqk of query), got shape {tuple(key.shape)}")
    if query_valid_rows is not None:
        check_tensor_types(query_valid_rows=query_valid_rows)
        shapes = list(dict.fromkeys(((sq,), (1, sq), (b, sq))))
        if query_valid_rows.shape not in shapes:
            raise ValueError(f"query_valid_rows: expected shape {' or '.join(map(str, shapes))} ([sq] or [b, sq] "
                             f"of q's sizes), got shape {tuple(query_valid_rows.shape)}")
    _finite_f32("softmax_scale", softmax_scale)
    return _finite_f32("loss_coeff", loss_coeff)


def _bshd(q, k, weights, starts, ends):
    """Megatron's sequence-first indexer tensors (checked) as dsaib's BSHD views
    (no copy where the strides allow) and its [sq] ranges as (b, sq) int32 by
    dsaib.torch's rules (other integer dtypes converted, values beyond int32
    clamped; floats refused)."""
    sq, b = q.shape[0], q.shape[1]
    rows = lambda name, r: range_int32(name, r).unsqueeze(0).expand(b, sq).contiguous()  # noqa: E731
    return q.transpose(0, 1), k.transpose(0, 1), weights.transpose(0, 1), rows("starts", starts), rows("ends", ends)


def _topk(q, k, weights, index_topk, starts, ends, with_logits=False):
    """(ids [b, sq, min(index_topk, skv)] int32 with -1 past each row's count,
    lengths [b, sq] int32): the exact top-k of dsaib's logits in each row's
    range; with_logits: (ids, logits [b, sq, K] float32, lengths). The
    arguments are those _check_arguments passed, index_topk the int it
    returned."""
    q_b, k_b, w_b, starts_b, ends_b = _bshd(q, k, weights, starts, ends)
    # Megatron's torch path returns min(index_topk, skv) slots; the same width
    # keeps every consumer of the ids (the main attention, index sharing) alike.
    width = min(index_topk, k.shape[0])
    if width == 0:  # no keys (skv = 0): every row is empty
        sq, b = q.shape[0], q.shape[1]
        empty = torch.empty((b, sq, 0), dtype=torch.int32, device=q.device)
        lengths = torch.zeros((b, sq), dtype=torch.int32, device=q.device)
        return (empty, empty.float(), lengths) if with_logits else (empty, lengths)
    return _dt.indexer_topk(q_b, w_b, k_b, width, starts=starts_b, ends=ends_b, order=SETTINGS["order"],
                            return_logits=with_logits, return_lengths=True)


def run_fused_qk_topk(q, k, weights, index_topk, starts, ends, block_size, use_relu=True,
                      use_local_indexer_varlen=False, single_packed_thd_sequence=False, local_packed_cp_rank=0,
                      local_packed_cp_query_start=0, local_packed_cp_query_len=None, packed_seq_params=None,
                      cp_size=1):
    """Megatron's ``run_fused_qk_topk`` hook: ``(topk_indices [b, sq, K] int32,
    topk_length [b, sq] int32)`` from ``dsaib.torch.indexer_topk``.

    ``block_size`` and the packed/context-parallel arguments are not needed:
    the ranges already say which keys each row sees, in ``k``'s rows."""
    _check_relu(use_relu)
    index_topk = _check_arguments(q, k, weights, index_topk, starts, ends)
    with torch.no_grad():
        return _topk(q, k, weights, index_topk, starts, ends)


class _PrecomputedGradients(torch.autograd.Function):
    """The loss whose gradients were formed in the forward: the backward only
    scales them by the incoming gradient (Megatron's cuDNN backend does the
    same), so the indexer's backward costs no second pass over the keys."""

    @staticmethod
    def forward(ctx, q, k, weights, loss, dq, dk, dw):
        ctx.save_for_backward(dq, dk, dw)
        ctx.dtypes = (q.dtype, k.dtype, weights.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dq, dk, dw = ctx.saved_tensors
        g = held_gradient_scale(grad_loss, "dsaib.megatron.run_fused_qk_topk_with_loss")
        # The gradients are kept in float32 and rounded once, after the scale.
        return (scaled_gradient(dq, g, ctx.dtypes[0]), scaled_gradient(dk, g, ctx.dtypes[1]),
                scaled_gradient(dw, g, ctx.dtypes[2]), None, None, None, None)


def _normalization(b, sq, query_valid_rows, calculate_per_token_loss, device):
    """(normalization_count for dsaib, a float32 one-element scale or None, the
    row mask or None): Megatron's loss is a sum over rows (per-token loss), a
    mean over the valid rows (query_valid_rows), or a mean over all b*sq rows."""
    valid = None
    if query_valid_rows is not None:
        valid = query_valid_rows.to(device=device, dtype=torch.bool)
        valid = valid.unsqueeze(0).expand(b, sq) if valid.dim() == 1 else valid.expand(b, sq)
    if calculate_per_token_loss:
        return 1, None, valid
    if valid is not None:
        # a device value, so that no host synchronisation is needed for the count
        return 1, (1.0 / valid.sum().to(torch.float32).clamp_min(1.0)).reshape(1), valid
    return b * sq, None, valid


def _target(query, key, ids, softmax_scale, tp_group):
    """T over the selected slots: each head's softmax over the row's selected
    keys (dsaib computes the log-sum-exp itself), summed over this rank's heads
    unnormalised, all-reduced over the tensor-parallel group, then normalised
    as Megatron does (the row sum floored at 1e-10)."""
    q_b = query.transpose(0, 1)
    kv_b = key.squeeze(2).transpose(0, 1)
    u = _dt.attention_target(q_b, kv_b, None, ids, sm_scale=softmax_scale, normalize=False)
    if tp_group is not None and torch.distributed.is_initialized() and tp_group.size() > 1:
        torch.distributed.all_reduce(u, group=tp_group)
    return u / u.sum(dim=-1, keepdim=True).clamp_min(_TARGET_FLOOR)


def run_fused_qk_topk_with_loss(q, k, weights, index_topk, starts, ends, block_size, query, key, softmax_scale,
                                loss_coeff, pg_collection, query_valid_rows=None, calculate_per_token_loss=False,
                                use_relu=True, config=None, use_local_indexer_varlen=False,
                                single_packed_thd_sequence=False, local_packed_cp_rank=0,
                                local_packed_cp_query_start=0, local_packed_cp_query_len=None,
                                packed_seq_params=None, cp_size=1):
    """Megatron's ``run_fused_qk_topk_with_loss`` hook: ``(topk_indices,
    topk_length, loss)``, the loss a 0-d float32 tensor differentiable with
    respect to q, k and weights.

    1. the top-k (:func:`run_fused_qk_topk`), with the selected keys' logits;
    2. the target from ``query`` and ``key`` with each head's log-sum-exp over
       the selected keys computed by dsaib, all-reduced unnormalised over
       ``pg_collection.tp``, then normalised;
    3. the loss and the three gradients in one library call
       (``dsaib.torch.indexer_kl_loss_and_grad``), its forward from the
       top-k's logits (no second gather or GEMM); the backward scales them.

    The loss returned is Megatron's ``KL(T || P)``: dsaib's cross-entropy plus
    ``loss_coeff / N * sum T log max(T, 1e-10)``, the term that does not
    depend on the indexer, so the logged value means what Megatron's other
    backends log. The gradient is the exact ``c (P - T)`` at every slot
    (docs/megatron.md)."""
    _check_relu(use_relu)
    index_topk = _check_arguments(q, k, weights, index_topk, starts, ends)
    loss_coeff = _check_loss_arguments(q, k, query, key, softmax_scale, loss_coeff, query_valid_rows)
    sq, b = q.shape[0], q.shape[1]
    tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    with torch.no_grad():
        ids, logits, lengths = _topk(q, k, weights, index_topk, starts, ends, with_logits=True)
    if ids.numel() == 0:  # no keys (skv = 0) or no query rows (sq or b 0): the loss and gradients are 0
        zero = torch.zeros((), dtype=torch.float32, device=q.device)
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, weights)]
        return ids, lengths, _PrecomputedGradients.apply(q, k, weights, zero, *grads)
    with torch.no_grad():
        count, scale, valid = _normalization(b, sq, query_valid_rows, calculate_per_token_loss, q.device)
        loss_ids = ids if valid is None else ids.masked_fill(~valid.unsqueeze(-1), -1)
        target = _target(query.detach(), key.detach(), loss_ids, softmax_scale, tp_group)
        q_b, k_b, w_b = q.detach().transpose(0, 1), k.detach().transpose(0, 1), weights.detach().transpose(0, 1)
        cross_entropy, dq, dw, dk = _dt.indexer_kl_loss_and_grad(
            q_b, w_b, k_b, loss_ids, target, sm_scale=1.0, loss_coeff=loss_coeff,
            normalization_count=count, grad_loss=1.0 if scale is None else scale, out_dtype="f32",
            topk_logits=logits)
        # The KL is the difference of two terms about log(topk) per row each:
        # the rows' T log T (float32 sums over a row's slots) are summed over
        # the rows, and added to the cross-entropy, in float64, so that the
        # difference keeps about one float32 rounding of the terms' size.
        entropy = (target * torch.log(target.clamp_min(_TARGET_FLOOR))).sum(-1).sum(dtype=torch.float64)
        loss = (cross_entropy.to(torch.float64) + entropy * (loss_coeff / count)).to(torch.float32)
        if scale is not None:
            loss = loss * scale[0]
        dq, dk, dw = dq.transpose(0, 1), dk.transpose(0, 1), dw.transpose(0, 1)
    loss = _PrecomputedGradients.apply(q, k, weights, loss.reshape(()), dq, dk, dw)
    return ids, lengths, loss


def _attention_backend():
    name = SETTINGS["attention"]
    return None if name is None else importlib.import_module(_ATTENTION_MODULES[name])


def run_fused_absorbed_sparse_attention(query, key, topk_indices, softmax_scale, v_channels, topk_length=None):
    """The main sparse attention: the hook of the backend named at
    registration (``attention="cudnn"`` or ``"tilelang"``), or ``None``
    (Megatron's torch code)."""
    backend = _attention_backend()
    if backend is None:
        return None
    return backend.run_fused_absorbed_sparse_attention(query, key, topk_indices, softmax_scale, v_channels,
                                                       topk_length)


def run_fused_dsa_attention(**kwargs):
    """Always ``None``: the hook that fuses the indexer into the attention
    would run the indexer on another backend; declining it makes Megatron take
    its split path, whose top-k and loss are this module's and whose
    attention is :func:`run_fused_absorbed_sparse_attention`."""
    return None
