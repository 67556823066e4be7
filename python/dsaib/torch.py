"""dsaib's operations on torch tensors (needs torch; ``import dsaib`` alone never imports it).

The same functions as :mod:`dsaib`, with the same arguments and options
(:data:`dsaib.OPTIONS`), as ``torch.library`` custom ops with fake kernels
(``torch.compile(fullgraph=True)`` traces them, CUDA graphs capture them):
CUDA tensors run the sm_90a kernels on the current stream (or the ``stream``
option), CPU tensors the fp64 CPU backend. Each makes one library call.

* :func:`indexer_backward`, :func:`indexer_kl_forward`,
  :func:`indexer_kl_loss_and_grad`, :func:`attention_target`: the ops
  ``torch.ops.dsaib.*`` with keyword options.
* :func:`indexer_kl_loss`: the indexer KL loss, differentiable w.r.t.
  ``index_q``, ``weights`` and ``index_k``. By default (``gradients="forward"``)
  its forward is the library's loss and gradients in one call at grad_loss 1
  and its backward scales them by autograd's upstream gradient; with
  ``gradients="backward"`` its forward is the library's loss forward (the loss
  and each query row's log-sum-exp and target mass, no ``P``) and its backward
  the P-free ``indexer_backward`` with the upstream gradient as a device
  scalar. :class:`IndexerKLLoss` is the same as an ``nn.Module``.
* :func:`indexer_kl_loss_and_grad_from_attention`: :func:`attention_target`,
  then :func:`indexer_kl_loss_and_grad`, from the tensors a DSA layer has.
* :func:`indexer_topk`: the indexer's forward, each query row's exact top-k
  keys by logit (``torch.ops.dsaib.indexer_topk``), whose ids the loss takes.
  Not differentiable.
* :func:`index_scores`: P alone, computed in torch.
* :func:`context_parallel_indexer_kl_loss`,
  :func:`context_parallel_indexer_backward` and
  :func:`context_parallel_indexer_topk` from :mod:`dsaib.distributed`.

The loss (docs/math.md), per query row over its valid slots ``i``::

    z_i  = sm_scale * sum_h w_h * relu(q_h . k_{id_i})
    P    = softmax(z)                      (valid slots only)
    Loss = -(loss_coeff / N) * sum_rows sum_i max(T_i, eps) * log(max(P_i, eps)),  eps = exp(-100)

The loss functions round float ``index_q``/``index_k`` to bf16 (the library's
input precision; the rounding counts as the identity for the gradients), take
any integer ``topk_indices`` (ids beyond int32 are invalid slots) and return
each gradient in its leaf's dtype. Float64 leaves run the loss's forward in
torch in float64 on the unrounded values (for finite-difference checks); on
CPU tensors the library then reads and writes float64 unrounded.

Determinism: ``deterministic=True``, or ``torch.use_deterministic_algorithms(True)``,
runs the cuda backend's fixed-point ``d_index_k`` (bitwise reproducible);
``d_index_q``, ``d_weights`` and the CPU backend always are.
"""
from typing import Tuple

import torch

from . import _options
from ._args import _finite_f32
from ._options import OPTIONS
from ._torch import ops as _ops  # noqa: F401  (registers torch.ops.dsaib.*)
from ._torch import reference as _reference
from ._torch.autograd import IndexerKLLossFunction as _IndexerKLLossFunction
from ._torch.autograd import IndexerKLLossGradientsInForward as _IndexerKLLossGradientsInForward
from ._torch.convert import (check_same_device, check_tensor_types, check_torch_arguments, fp64, grad_code,
                             grad_loss_tensor, gradients_in_forward, ids_int32, library_inputs, logits_operand,
                             on_stream, range_int32, topk_operand)
from .distributed import (context_parallel_indexer_backward, context_parallel_indexer_kl_loss,
                          context_parallel_indexer_topk)

__all__ = ["indexer_backward", "indexer_kl_forward", "indexer_kl_loss", "indexer_kl_loss_and_grad",
           "attention_target", "indexer_topk", "indexer_kl_loss_and_grad_from_attention", "IndexerKLLoss", "index_scores", "EPS",
           "OPTIONS", "context_parallel_indexer_kl_loss", "context_parallel_indexer_backward",
           "context_parallel_indexer_topk"]

#: The clip of ``T`` and ``P`` in the loss: exp(-100).
EPS = _reference.EPS


def _codes(out_dtype):
    return out_dtype if out_dtype is not None else ("f32",) * 3


@_options.documented("indexer_backward")
def indexer_backward(index_q, weights, index_k, topk_indices, attn_score, index_score, *, sm_scale, loss_coeff=1.0,
                     grad_loss=1.0, normalization_count=0, layout="bshd", id_mode="local", cu_seqlens_q=None,
                     cu_seqlens_k=None, out_dtype=None, backend=None, strict_indices=False, deterministic=False,
                     num_threads=0, stream=None, a_operand_precision="auto", l2_hints="auto", start_stagger="auto",
                     row_lse=None, row_target_mass=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_index_q, d_weights, d_index_k)`` through ``torch.ops.dsaib.indexer_backward``.

    The tensors, shapes and dtypes of :func:`dsaib.indexer_backward`, taken as
    they are (index_q and index_k ``torch.bfloat16``, int32 ids, float32
    scores), all on one device; the P-free form with ``index_score=None``,
    ``row_lse`` and ``row_target_mass``. Returns contiguous tensors allocated on
    index_q's device.
    """
    o = _options.check("indexer_backward", dict(
        sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count, layout=layout,
        id_mode=id_mode, backend=backend, strict_indices=strict_indices, num_threads=num_threads, stream=stream,
        grad_loss=grad_loss, out_dtype=out_dtype, deterministic=deterministic,
        a_operand_precision=a_operand_precision, l2_hints=l2_hints, start_stagger=start_stagger))
    check_tensor_types(("index_score", "row_lse", "row_target_mass", "cu_seqlens_q", "cu_seqlens_k"),
                       index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                       attn_score=attn_score, index_score=index_score, row_lse=row_lse,
                       row_target_mass=row_target_mass, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    g = grad_loss_tensor(o["grad_loss"], index_q.device)
    with on_stream(o["stream"], index_q.device):
        return torch.ops.dsaib.indexer_backward(
            index_q, weights, index_k, topk_indices, attn_score, index_score, g, cu_seqlens_q, cu_seqlens_k,
            o["sm_scale"], o["loss_coeff"], o["normalization_count"], o["layout"], o["id_mode"],
            *_codes(o["out_dtype"]),
            o["a_operand_precision"], row_lse, row_target_mass, o["l2_hints"], o["start_stagger"],
            o["strict_indices"], o["deterministic"], o["num_threads"], o["backend"])


@_options.documented("indexer_kl_forward")
def indexer_kl_forward(index_q, weights, index_k, topk_indices, attn_score, *, sm_scale, loss_coeff=1.0,
                       normalization_count=0, layout="bshd", id_mode="local", cu_seqlens_q=None, cu_seqlens_k=None,
                       backend=None, strict_indices=False, num_threads=0, stream=None, return_index_score=False,
                       topk_logits=None):
    """``(loss, row_lse, row_target_mass)`` (and P with ``return_index_score=True``)
    through ``torch.ops.dsaib.indexer_kl_forward``, as :func:`dsaib.indexer_kl_forward`
    returns them; tensors taken as they are, as :func:`indexer_backward` takes them.
    ``topk_logits``: the selected keys' logits as :func:`indexer_topk` returns
    them (``return_logits=True``), taken instead of recomputing them (no key
    gathered, no GEMM). Not differentiable (:func:`indexer_kl_loss` is)."""
    o = _options.check("indexer_kl_forward", dict(
        sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count, layout=layout,
        id_mode=id_mode, backend=backend, strict_indices=strict_indices, num_threads=num_threads, stream=stream,
        return_index_score=return_index_score))
    check_tensor_types(("cu_seqlens_q", "cu_seqlens_k", "topk_logits"), index_q=index_q, weights=weights,
                       index_k=index_k, topk_indices=topk_indices, attn_score=attn_score, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, topk_logits=topk_logits)
    with on_stream(o["stream"], index_q.device):
        out = torch.ops.dsaib.indexer_kl_forward(
            index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k, o["sm_scale"],
            o["loss_coeff"], o["normalization_count"], o["layout"], o["id_mode"], o["strict_indices"],
            o["num_threads"], o["backend"], o["return_index_score"], topk_logits)
    return tuple(out) if o["return_index_score"] else tuple(out[:3])


@_options.documented("indexer_kl_loss")
def indexer_kl_loss(index_q, weights, index_k, topk_indices, attn_score, *, sm_scale, loss_coeff=1.0,
                    normalization_count=0, layout="bshd", id_mode="local", cu_seqlens_q=None, cu_seqlens_k=None,
                    backend=None, strict_indices=False, num_threads=0, stream=None, deterministic=False,
                    a_operand_precision="auto", l2_hints="auto", start_stagger="auto",
                    gradients="forward", topk_logits=None) -> torch.Tensor:
    """The indexer KL loss, a 0-dim tensor, differentiable w.r.t. index_q, weights and index_k.

    ============  ======================  ===========================================
    argument      BSHD shape (THD)        dtype
    ============  ======================  ===========================================
    index_q       (B, S_q, H, D)          bf16 (float32/float64 are rounded to bf16)
                  ((T_q, H, D))
    weights       (B, S_q, H) ((T_q, H))  bf16 or float32 (float64: see below)
    index_k       (B, S_kv, D) ((T_k, D)) bf16 (float32/float64 are rounded to bf16)
    topk_indices  (B, S_q, topk)          integer; -1 or out of range: invalid slot
    attn_score    (B, S_q, topk)          float; the target distribution T
    ============  ======================  ===========================================

    H a multiple of 8 in [8, 128], D 64 or 128. Where a gradient is wanted
    (grad mode on, index_q, weights or index_k requiring grad) and
    ``gradients="forward"`` (the default), the forward is one library call,
    dsaib::indexer_kl_loss_and_grad at grad_loss 1 (the loss and gradients in
    one call: the same library work as the training step needs, no more),
    which validates the converted tensors before anything is computed; the
    gradients of the leaves that need one are held (memory: their size) until the
    backward multiplies them by autograd's upstream gradient, a device scalar
    (in float32, rounded once).
    Otherwise (``gradients="backward"``, no gradient wanted, or float64 leaves)
    the forward is one library call (dsaib::indexer_kl_forward, which validates
    likewise): the loss (float32; float64 for float64 leaves, computed in torch
    on the unrounded values) and each query row's log-sum-exp and target mass,
    saved with the converted inputs; no P. The backward is then one library
    call: the P-free ``indexer_backward`` with autograd's upstream gradient as a
    device tensor (a replayed CUDA graph reads the value it holds then). Either
    way the backward's options (``deterministic``, ``a_operand_precision``,
    ``l2_hints``, ``start_stagger``) apply, and gradients come back in the
    dtypes of the leaves.

    ``topk_logits`` (optional, float, shaped like topk_indices): the selected
    keys' logits as :func:`indexer_topk` returns them (``return_logits=True``),
    for the same index_q, weights and index_k. The forward then takes
    sm_scale times them instead of gathering the keys and recomputing the
    logits; they are a constant (detached): the gradient flows through the
    logits the backward recomputes, which agree with them within the top-k's
    bound (docs/kl-forward.md, "From the top-k's logits").

    Errors, before anything is computed: TypeError for a non-tensor argument,
    non-integer ``topk_indices`` or non-float ``attn_score``, ValueError for
    tensors on different devices, then the option table's and the library's
    (its messages). Under torch.compile the library's checks run when its ops
    run (in the forward; float64 leaves: in the backward).
    """
    o = _options.check("indexer_kl_loss", dict(
        sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count, layout=layout,
        id_mode=id_mode, backend=backend, strict_indices=strict_indices, num_threads=num_threads, stream=stream,
        deterministic=deterministic, a_operand_precision=a_operand_precision, l2_hints=l2_hints,
        start_stagger=start_stagger, gradients=gradients))
    check_torch_arguments(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k)
    logits_operand(topk_logits)  # its TypeError before anything runs
    function = (_IndexerKLLossGradientsInForward if gradients_in_forward(o["gradients"], (index_q, weights, index_k))
                else _IndexerKLLossFunction)
    with on_stream(o["stream"], index_q.device):
        if any(t.dtype == torch.float64 for t in (index_q, weights, index_k)):
            # The forward is computed in torch: the library's validation of what the backward will get.
            _reference.validate(index_q, weights, index_k, topk_indices, attn_score, sm_scale=o["sm_scale"],
                                layout=o["layout"], id_mode=o["id_mode"], cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, loss_coeff=o["loss_coeff"],
                                normalization_count=o["normalization_count"], backend=o["backend"],
                                num_threads=o["num_threads"], strict_indices=o["strict_indices"],
                                topk_logits=topk_logits)
        return function.apply(
            index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k, o["sm_scale"],
            o["loss_coeff"], o["normalization_count"], o["layout"], o["id_mode"], o["backend"], o["strict_indices"],
            o["num_threads"], o["deterministic"], o["a_operand_precision"], o["l2_hints"], o["start_stagger"],
            topk_logits)


@_options.documented("indexer_kl_loss_and_grad")
def indexer_kl_loss_and_grad(index_q, weights, index_k, topk_indices, attn_score, *, sm_scale, loss_coeff=1.0,
                             grad_loss=1.0, normalization_count=0, layout="bshd", id_mode="local",
                             cu_seqlens_q=None, cu_seqlens_k=None, out_dtype=None, backend=None,
                             strict_indices=False, deterministic=False, num_threads=0, stream=None,
                             a_operand_precision="auto", l2_hints="auto", start_stagger="auto",
                             forward_fusion="auto",
                             topk_logits=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, d_index_q, d_weights, d_index_k)`` in one library call, for an
    indexer trained only by this loss (detached from the model's graph).

    Through ``torch.ops.dsaib.indexer_kl_loss_and_grad``: the loss forward and
    the P-free backward in one host call; no P exists anywhere. Arguments and
    their conversions as :func:`indexer_kl_loss`; the gradients are those of
    ``indexer_kl_loss(...).backward(grad_loss)`` (its default form runs this
    call at grad_loss 1 and scales: bitwise the same where grad_loss is 1 or a
    power of two, else one more rounding), in the dtypes of
    index_q, weights and index_k (``out_dtype=None``), and the loss is not
    scaled by ``grad_loss``. Float64 CPU tensors: the library's fp64 forward
    (on index_q/index_k rounded to bf16), a float64 loss and float64 gradients,
    all unrounded. ``topk_logits`` as for :func:`indexer_kl_loss`: the forward
    reads them, the backward recomputes its logits. Not differentiable: the
    outputs are plain tensors.
    """
    o = _options.check("indexer_kl_loss_and_grad", dict(
        sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count, layout=layout,
        id_mode=id_mode, backend=backend, strict_indices=strict_indices, num_threads=num_threads, stream=stream,
        grad_loss=grad_loss, out_dtype=out_dtype, deterministic=deterministic,
        a_operand_precision=a_operand_precision, l2_hints=l2_hints, start_stagger=start_stagger,
        forward_fusion=forward_fusion))
    check_torch_arguments(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k)
    g = grad_loss_tensor(o["grad_loss"], index_q.device)
    in_fp64 = fp64(index_q.device, index_q, weights, index_k)
    codes = o["out_dtype"] or tuple(grad_code(t.dtype, in_fp64) for t in (index_q, weights, index_k))
    with torch.no_grad(), on_stream(o["stream"], index_q.device):
        q16, w_op, k16, ids32, T32 = library_inputs(index_q, weights, index_k, topk_indices, attn_score, in_fp64,
                                                    o["strict_indices"])
        loss, dq, dw, dk = torch.ops.dsaib.indexer_kl_loss_and_grad(
            q16, w_op, k16, ids32, T32, g, cu_seqlens_q, cu_seqlens_k, o["sm_scale"], o["loss_coeff"],
            o["normalization_count"], o["layout"], o["id_mode"], *codes, o["a_operand_precision"],
            "f64" if in_fp64 or tuple(codes) == ("f64",) * 3 else "f32",  # as dsaib.indexer_kl_loss_and_grad
            o["strict_indices"], o["l2_hints"], o["start_stagger"], o["deterministic"],
            o["num_threads"], o["backend"], o["forward_fusion"], logits_operand(topk_logits, in_fp64))
    if o["out_dtype"] is not None:
        return loss, dq, dw, dk
    return loss, dq.to(index_q.dtype), dw.to(weights.dtype), dk.to(index_k.dtype)


@_options.documented("attention_target")
def attention_target(query, kv, lse, topk_indices, *, sm_scale, lse_base="natural", normalize=True, layout="bshd",
                     id_mode="local", cu_seqlens_q=None, cu_seqlens_k=None, backend=None, strict_indices=False,
                     num_threads=0, stream=None) -> torch.Tensor:
    """The indexer loss's target ``T`` (attn_score) from the main attention's
    tensors, through ``torch.ops.dsaib.attention_target``, as
    :func:`dsaib.attention_target` computes it.

    query and kv are taken as bf16 (other float dtypes are rounded to bf16),
    lse as float32 (any strides; a float64 lse on CPU as it is, unrounded)
    or None (each head's lse over the row's valid selected keys, computed by
    the library, as Megatron-Core's sparse indexer loss takes each head's
    softmax over them; lse_base is then not used), topk_indices as int32 (ids
    beyond int32: invalid slots). Returns a float32 tensor shaped like
    topk_indices; not differentiable (a target).
    """
    o = _options.check("attention_target", dict(
        sm_scale=sm_scale, lse_base=lse_base, normalize=normalize, layout=layout, id_mode=id_mode, backend=backend,
        strict_indices=strict_indices, num_threads=num_threads, stream=stream))
    for name, t in dict(query=query, kv=kv, lse=lse, topk_indices=topk_indices).items():
        if not isinstance(t, torch.Tensor) and not (name == "lse" and t is None):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if topk_indices.is_floating_point() or topk_indices.is_complex() or topk_indices.dtype == torch.bool:
        raise TypeError(f"topk_indices: expected an integer dtype, got {topk_indices.dtype}")
    with torch.no_grad(), on_stream(o["stream"], query.device):
        q16 = query.to(torch.bfloat16).contiguous() if query.is_floating_point() else query
        kv16 = kv.to(torch.bfloat16).contiguous() if kv.is_floating_point() else kv
        # float32, strides kept when already so; a float64 lse on CPU stays float64 (the
        # cpu backend takes it unrounded: at |lse| ~ 1000 float32 would move T by ~6e-5)
        keep = lse is None or (lse.dtype == torch.float64 and lse.device.type == "cpu")
        lse32 = lse if keep or not lse.is_floating_point() else lse.to(torch.float32)
        return torch.ops.dsaib.attention_target(
            q16, kv16, lse32, ids_int32(topk_indices, o["strict_indices"]), cu_seqlens_q, cu_seqlens_k,
            o["sm_scale"], o["lse_base"], o["normalize"], o["layout"], o["id_mode"], o["strict_indices"],
            o["num_threads"], o["backend"])


@_options.documented("indexer_topk")
def indexer_topk(index_q, weights, index_k, topk, *, starts=None, ends=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 layout="bshd", id_mode="local", order="logit_descending", causal_offset=None, strict_ranges=False,
                 return_logits=False, return_lengths=False, backend=None, stream=None, num_threads=0,
                 index_q_scale=None, index_k_scale=None):
    """Each query row's ``topk`` keys with the largest indexer logits, through
    ``torch.ops.dsaib.indexer_topk``, as :func:`dsaib.indexer_topk` computes
    them: ``topk_indices`` (int32, -1 past a row's count), or with
    ``return_logits`` / ``return_lengths`` the tuple ``(topk_indices,
    topk_logits, topk_lengths)`` of those asked for.

    index_q and index_k are taken as bf16 (other float dtypes rounded to bf16),
    weights as bf16 or float32 (on the cpu backend float64 too, unrounded;
    other float dtypes converted to float32), starts/ends as int32 (other
    integer dtypes converted, values beyond int32 clamped; with strict_ranges
    a ValueError naming the value). A tensor of the right dtype is passed
    without a copy when its last dimension is contiguous and, on CUDA
    (index_q, index_k), its other strides and storage offset are multiples of
    16 bytes (8 bf16 or 16 float8 elements): a
    sequence-first ``x.transpose(0, 1)`` of an ``[sq, b, H, D]`` tensor is read
    in place; other layouts are copied contiguous first.

    ``torch.float8_e4m3fn`` index_q and index_k (both; cuda: D 128) are
    taken as they are, with their optional float32 ``index_q_scale`` and
    ``index_k_scale`` (float64 unrounded on the cpu backend; other floats to
    float32; :func:`dsaib.indexer_topk` says how they scale the logits).

    Not differentiable: the ids are integers, and the logits come back
    detached (``requires_grad=False``) whatever the inputs; the indexer is
    trained through :func:`indexer_kl_loss` on these ids. BSHD on CUDA makes no
    host synchronisation (CUDA graphs capture it; THD reads cu_seqlens as the
    other entry points do, strict_ranges reads the ranges).
    """
    o = _options.check("indexer_topk", dict(
        topk=topk, layout=layout, id_mode=id_mode, order=order, causal_offset=causal_offset,
        strict_ranges=strict_ranges, return_logits=return_logits, return_lengths=return_lengths, backend=backend,
        num_threads=num_threads, stream=stream))
    check_tensor_types(("starts", "ends", "cu_seqlens_q", "cu_seqlens_k", "index_q_scale", "index_k_scale"),
                       index_q=index_q, weights=weights, index_k=index_k, starts=starts, ends=ends,
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, index_q_scale=index_q_scale,
                       index_k_scale=index_k_scale)
    for name in ("index_q", "weights", "index_k"):
        t = dict(index_q=index_q, weights=weights, index_k=index_k)[name]
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point dtype, got {t.dtype}")
    check_same_device(index_q, weights=weights, index_k=index_k, starts=starts, ends=ends,
                      index_q_scale=index_q_scale, index_k_scale=index_k_scale)
    cuda = index_q.device.type == "cuda"
    # float8 inputs stay float8, both of them; other floats go to bf16
    f8 = torch.float8_e4m3fn
    for name, t in (("index_q", index_q), ("index_k", index_k)):
        if t.element_size() == 1 and t.dtype != f8:  # other float8 (and packed float4) codes carry scales of their own
            raise TypeError(f"{name}: expected bf16 (or a float dtype rounded to it) or torch.float8_e4m3fn, got "
                            f"{t.dtype} (dequantise other narrow formats first)")
    if (index_q.dtype == f8) != (index_k.dtype == f8):  # named before a conversion hides the dtype passed
        want = "dtype torch.float8_e4m3fn" if index_q.dtype == f8 else "a dtype other than torch.float8_e4m3fn"
        raise TypeError(f"index_k: expected {want} (as index_q, {index_q.dtype}), got {index_k.dtype}")
    for name, t in (("index_q_scale", index_q_scale), ("index_k_scale", index_k_scale)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point dtype (float32), got {t.dtype}")
    qk = lambda t: topk_operand(t, (f8,) if t.dtype == f8 else (torch.bfloat16,), cuda)  # noqa: E731
    # float64 weights and scales reach the cpu backend unrounded (as through dsaib.indexer_topk); cuda takes
    # bf16 or float32 weights, float32 scales
    weight_dtypes = (torch.float32, torch.bfloat16) + (() if cuda else (torch.float64,))
    scale_dtypes = (torch.float32,) + (() if cuda else (torch.float64,))
    scale = lambda t: None if t is None else topk_operand(t, scale_dtypes, False)  # noqa: E731
    with torch.no_grad(), on_stream(o["stream"], index_q.device):
        ids, logits, lengths = torch.ops.dsaib.indexer_topk(
            qk(index_q), topk_operand(weights, weight_dtypes, False), qk(index_k), o["topk"], range_int32("starts", starts, o["strict_ranges"]),
            range_int32("ends", ends, o["strict_ranges"]), cu_seqlens_q, cu_seqlens_k, o["layout"], o["id_mode"], o["order"],
            o["causal_offset"], o["strict_ranges"], o["return_logits"], o["return_lengths"], o["num_threads"],
            o["backend"], scale(index_q_scale), scale(index_k_scale))
    out = (ids,) + ((logits,) if o["return_logits"] else ()) + ((lengths,) if o["return_lengths"] else ())
    return out if len(out) > 1 else ids


def indexer_kl_loss_and_grad_from_attention(
        index_q, weights, index_k, query, kv, lse, topk_indices, *, sm_scale, softmax_scale, lse_base="natural",
        loss_coeff=1.0, grad_loss=1.0, normalization_count=0, layout="bshd", id_mode="local", cu_seqlens_q=None,
        cu_seqlens_k=None, out_dtype=None, backend=None, strict_indices=False, deterministic=False, num_threads=0,
        stream=None, a_operand_precision="auto", l2_hints="auto", start_stagger="auto", forward_fusion="auto",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, d_index_q, d_weights, d_index_k)`` of the indexer KL loss from the
    tensors a DSA layer has: the indexer's ``index_q``, ``weights``,
    ``index_k``, the main attention's ``query``, latent ``kv`` and ``lse`` (or
    None: each head's softmax over the selected keys), and the selected
    ``topk_indices``.

    :func:`attention_target` (normalised, with the main attention's
    ``softmax_scale`` and ``lse_base``), then :func:`indexer_kl_loss_and_grad`
    with the indexer's ``sm_scale`` and the other options on that target: two
    library calls. With tensor parallelism over the main attention's heads,
    call the two with the all-reduce between them (``normalize=False``). A bad
    main-attention scale is named ``softmax_scale``. ``strict_indices=True``
    checks the ids once, in :func:`attention_target`.
    """
    # Checked here so that an error names softmax_scale, not attention_target's sm_scale.
    softmax_scale = _finite_f32("softmax_scale", softmax_scale)
    shared = dict(layout=layout, id_mode=id_mode, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  backend=backend, num_threads=num_threads, stream=stream)
    # strict_indices: the ids are read once, by the target's call (the same ids go to the second).
    attn_score = attention_target(query, kv, lse, topk_indices, sm_scale=softmax_scale, lse_base=lse_base,
                                  normalize=True, strict_indices=strict_indices, **shared)
    return indexer_kl_loss_and_grad(
        index_q, weights, index_k, topk_indices, attn_score, sm_scale=sm_scale, loss_coeff=loss_coeff,
        grad_loss=grad_loss, normalization_count=normalization_count, out_dtype=out_dtype,
        strict_indices=False, deterministic=deterministic,
        a_operand_precision=a_operand_precision, l2_hints=l2_hints, start_stagger=start_stagger,
        forward_fusion=forward_fusion, **shared)


def index_scores(index_q, weights, index_k, topk_indices, *, sm_scale, layout="bshd", id_mode="local",
                 cu_seqlens_q=None, cu_seqlens_k=None, dtype=torch.float32) -> torch.Tensor:
    """The indexer's softmax ``P`` over the selected slots, shaped like topk_indices.

    0 at invalid slots (and in rows with no valid slot). Computed in torch in
    ``dtype`` from the given values (round index_q/index_k to bf16 first to get
    what the library's backward sees). Not differentiable (use
    :func:`indexer_kl_loss`). Arguments are validated by the library as
    :func:`indexer_kl_loss` validates them (one call; without attn_score),
    except that cu_seqlens may be of any integer dtype, on any device.
    """
    check_torch_arguments(index_q, weights, index_k, topk_indices, None, cu_seqlens_q, cu_seqlens_k,
                          cu_seqlens_on_any_device=True, attn_score_required=False)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype}")
    layout, id_mode = OPTIONS["layout"].check(layout), OPTIONS["id_mode"].check(id_mode)
    _reference.validate(index_q, weights, index_k, topk_indices, None, sm_scale=OPTIONS["sm_scale"].check(sm_scale),
                        layout=layout, id_mode=id_mode, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        any_integer_cu_seqlens=True)
    with torch.no_grad():
        rows, valid = _reference.key_rows(index_k, topk_indices, layout, id_mode, cu_seqlens_q, cu_seqlens_k)
        z = _reference.logits(index_q, weights, index_k, rows, valid, sm_scale, dtype)
        return _reference.softmax_valid(z).reshape(topk_indices.shape)


class IndexerKLLoss(torch.nn.Module):
    """:func:`indexer_kl_loss` as a module: ``IndexerKLLoss(sm_scale=D**-0.5)(q, w, k, ids, T)``.

    Takes every option of :func:`indexer_kl_loss` (checked here, by the option
    table); ``forward(index_q, weights, index_k, topk_indices, attn_score,
    cu_seqlens_q=None, cu_seqlens_k=None, topk_logits=None)``.
    """

    def __init__(self, sm_scale, loss_coeff=1.0, normalization_count=0, layout="bshd", id_mode="local",
                 a_operand_precision="auto", strict_indices=False, *, backend=None, num_threads=0, stream=None,
                 deterministic=False, l2_hints="auto", start_stagger="auto", gradients="forward"):
        super().__init__()
        given = dict(sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count,
                     layout=layout, id_mode=id_mode, backend=backend, strict_indices=strict_indices,
                     num_threads=num_threads, stream=stream, deterministic=deterministic,
                     a_operand_precision=a_operand_precision, l2_hints=l2_hints, start_stagger=start_stagger,
                     gradients=gradients)
        _options.check("indexer_kl_loss", given)
        self.options = given
        for name, value in given.items():
            setattr(self, name, value)

    def forward(self, index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q=None, cu_seqlens_k=None,
                topk_logits=None):
        return indexer_kl_loss(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, topk_logits=topk_logits, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={v}" for n, v in self.options.items())

