"""PyTorch integration of dsaib (needs torch; ``import dsaib`` alone never imports it).

* ``torch.ops.dsaib.indexer_backward``: a ``torch.library`` custom op with a
  fake (meta) kernel, so ``torch.compile(fullgraph=True)`` traces it and CUDA
  graphs capture it. CUDA tensors run the sm_90a kernel on the *current* torch
  stream; CPU tensors run the fp64 CPU backend. :func:`indexer_backward` is
  its Python front end.
* :func:`indexer_kl_loss`: the indexer KL (cross-entropy) loss,
  differentiable w.r.t. ``index_q``, ``weights`` and ``index_k``. Its forward
  is the library's (``torch.ops.dsaib.indexer_kl_forward``: the loss and each
  query row's log-sum-exp and target mass, no ``P``); its backward is
  ``torch.ops.dsaib.indexer_backward`` in the P-free form, fed with those row
  statistics and with the upstream gradient from autograd as a device scalar.
* :func:`indexer_kl_loss_and_grad`: the loss and the three gradients in one
  library call (``torch.ops.dsaib.indexer_kl_loss_and_grad``), for an indexer
  trained only by this loss; CUDA-graph capturable.
* :class:`IndexerKLLoss`: the loss as an ``nn.Module``.
* :func:`attention_target`: the target ``T`` from the main attention's own
  tensors (``torch.ops.dsaib.attention_target``), and
  :func:`indexer_kl_loss_and_grad_from_attention`: that target, then
  :func:`indexer_kl_loss_and_grad`, from the tensors a DSA layer has.

Determinism: under ``torch.use_deterministic_algorithms(True)`` the op runs
the cuda backend's deterministic mode (``deterministic=True``: ``d_index_k``
accumulated in 64-bit fixed point, bitwise reproducible; otherwise its fp32
atomics vary in the last bits from run to run, while ``d_index_q`` and
``d_weights`` are always reproducible). The CPU backend always is.

The loss (``docs/math.md``), per query row over its valid slots ``i``::

    z_i  = sm_scale * sum_h w_h * relu(q_h . k_{id_i})
    P    = softmax(z)                      (valid slots only)
    Loss = -(loss_coeff / N) * sum_rows sum_i max(T_i, eps) * log(max(P_i, eps)),  eps = exp(-100)

``N`` is ``normalization_count``, by default the number of query tokens.

Precision: the library takes bf16 ``index_q``/``index_k`` and bf16 or float32
``weights``. :func:`indexer_kl_loss` rounds float ``index_q``/``index_k`` to
bf16 (the library's forward computes the logits from the same rounded values),
and returns each gradient in the dtype of its input (the rounding is treated
as the identity, like ``.to(torch.bfloat16)`` under autograd). Float64 inputs
make the forward run in torch in float64 on the unrounded values (for
finite-difference checks; it hands the backward the same row statistics), with
``sm_scale`` and ``loss_coeff`` rounded to float32 as the library applies
them, so that the gradient is that of the returned loss; the backward still
sees ``index_q``/``index_k`` rounded to bf16. On CPU tensors
float64 goes through the library unrounded (its fp64 CPU backend takes f64
``weights``, ``attn_score``, row statistics and gradients): the backward reads
the float64 row statistics, weights and ``attn_score`` and writes float64
gradients, and :func:`indexer_kl_loss_and_grad` returns a float64 loss and
gradients. On CUDA tensors (whose backend takes no f64) they go through
float32.
"""
import math
from typing import Optional, Tuple

import torch

from . import _dsaib
from ._args import (_INT32_MAX, _INT32_MIN, _a_operand, _bool_value, _f32_round, _f32_value, _finite_f32,
                    _float_or_inf, _normalization_count, _option_str)
from ._frameworks import _export, _exported

__all__ = ["indexer_backward", "indexer_kl_loss", "indexer_kl_loss_and_grad", "IndexerKLLoss", "index_scores",
           "attention_target", "indexer_kl_loss_and_grad_from_attention", "EPS",
           "context_parallel_indexer_kl_loss", "context_parallel_indexer_backward"]

#: The clip of ``T`` and ``P`` in the loss: exp(-100).
EPS = math.exp(-100.0)

_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f64": torch.float64}
_CODES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _out_dtype(name: str, code: str) -> torch.dtype:
    try:
        return _DTYPES[code]
    except KeyError:
        raise ValueError(f'{name}: expected "f32", "bf16" or "f64", got {code!r}') from None


def _fp64(device: torch.device, *tensors) -> bool:
    """Whether the library runs in float64 end to end for these tensors: on the
    CPU backend (the only one that takes f64) when any of them is float64."""
    return device.type == "cpu" and any(t.dtype == torch.float64 for t in tensors)


def _grad_code(dtype: torch.dtype, fp64: bool) -> str:
    """The library's output code for a gradient of a leaf of `dtype`: the leaf's
    own dtype where the library writes it (float64 only in the fp64 mode,
    unrounded), else float32."""
    if fp64 and dtype == torch.float64:
        return "f64"
    return _CODES.get(dtype, "f32")


def _check_a_operand(word: str) -> str:
    """The library's check of the word (its ValueError), for the fake kernel, so
    that tracing rejects what running would, and for IndexerKLLoss."""
    _dsaib.check_a_operand_precision(word)
    return word


def _check_launch_words(l2_hints: str, start_stagger: str) -> None:
    """The library's checks of the launch options' words (its ValueError), for
    the fake kernel, so that tracing rejects what running would."""
    _dsaib.check_l2_hints(l2_hints)
    _dsaib.check_start_stagger(start_stagger)


# ---- the custom op ----------------------------------------------------------


@torch.library.custom_op("dsaib::indexer_backward", mutates_args=())
def _indexer_backward_op(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    attn_score: torch.Tensor,
    index_score: Optional[torch.Tensor],
    grad_loss: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    sm_scale: float,
    loss_coeff: float,
    normalization_count: int,
    layout: str,
    id_mode: str,
    dq_dtype: str,
    dw_dtype: str,
    dk_dtype: str,
    a_operand_precision: str = "auto",
    row_lse: Optional[torch.Tensor] = None,
    row_target_mass: Optional[torch.Tensor] = None,
    l2_hints: str = "auto",
    start_stagger: str = "auto",
    strict_indices: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = index_q.device
    dq, dw, dk = _gradients_like(index_q, weights, index_k, dq_dtype, dw_dtype, dk_dtype)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, index_score=index_score, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, d_index_q=dq, d_weights=dw, d_index_k=dk, grad_loss_device=grad_loss,
                   row_lse=row_lse, row_target_mass=row_target_mass)
    options = _op_options(dev, sm_scale, loss_coeff, normalization_count, layout, id_mode, a_operand_precision,
                          l2_hints, start_stagger, strict_indices)
    _run_library(_dsaib.indexer_backward, _dsaib.indexer_backward_workspace_size, dev, tensors, options)
    return dq, dw, dk


def _gradients_like(index_q, weights, index_k, dq_dtype, dw_dtype, dk_dtype):
    """New contiguous d_index_q, d_weights, d_index_k on index_q's device, of the codes' dtypes."""
    return (index_q.new_empty(index_q.shape, dtype=_out_dtype("dq_dtype", dq_dtype)),
            index_q.new_empty(weights.shape, dtype=_out_dtype("dw_dtype", dw_dtype)),
            index_q.new_empty(index_k.shape, dtype=_out_dtype("dk_dtype", dk_dtype)))


def _op_options(dev, sm_scale, loss_coeff, normalization_count, layout, id_mode, a_operand_precision="auto",
                l2_hints="auto", start_stagger="auto", strict_indices=False):
    """The library's options (dsaib::IndexerOptions) as the extension's
    keyword arguments, for every op; a new option is one more entry here and an
    argument of the ops. cuda: the current stream, and
    torch.use_deterministic_algorithms selects the fixed-point d_index_k (read
    when the op runs); grad_loss always comes as a device tensor. The option
    words (a_operand_precision, l2_hints, start_stagger) go to the library as
    given: it parses them and names a bad one."""
    cuda = dev.type == "cuda"
    return dict(layout=layout, id_mode=id_mode, backend="cuda" if cuda else "cpu", sm_scale=float(sm_scale),
                loss_coeff=float(loss_coeff), grad_loss=1.0, normalization_count=int(normalization_count),
                strict_indices=bool(strict_indices), deterministic=cuda and torch.are_deterministic_algorithms_enabled(),
                stream=int(torch.cuda.current_stream(dev).cuda_stream) if cuda else 0, num_threads=0,
                a_operand_precision=a_operand_precision, l2_hints=l2_hints, start_stagger=start_stagger)


def _run_library(entry, workspace_size, dev, tensors, options):
    """entry(**tensors, **options); on CUDA with the workspace the library asks
    for (workspace_size with the same arguments) from torch's allocator:
    stream-ordered, and from the graph pool under capture."""
    workspace = None
    if dev.type == "cuda":
        nbytes = workspace_size(**_exported(tensors), **options)
        if nbytes:
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    entry(**_exported(tensors), **options, workspace=_export(workspace))


def _check_same_device(index_q, **tensors):
    """ValueError naming the first tensor (None skipped) not on index_q's device."""
    for name, t in tensors.items():
        if t is not None and t.device != index_q.device:
            raise ValueError(f"{name}: expected memory on device '{index_q.device}' (that of index_q), "
                             f"got device '{t.device}'")


@_indexer_backward_op.register_fake
def _indexer_backward_fake(index_q, weights, index_k, topk_indices, attn_score, index_score, grad_loss,
                           cu_seqlens_q, cu_seqlens_k, sm_scale, loss_coeff, normalization_count, layout,
                           id_mode, dq_dtype, dw_dtype, dk_dtype, a_operand_precision="auto", row_lse=None,
                           row_target_mass=None, l2_hints="auto", start_stagger="auto", strict_indices=False):
    # Contiguous outputs on index_q's device, like the real kernel's. This is
    # also the Meta kernel: a call that mixes meta tensors with real ones lands
    # here and must fail like the real kernels would, not return empty tensors.
    _check_a_operand(a_operand_precision)
    _check_launch_words(l2_hints, start_stagger)
    _check_same_device(index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                       attn_score=attn_score, index_score=index_score, grad_loss=grad_loss,
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, row_lse=row_lse,
                       row_target_mass=row_target_mass)
    return _gradients_like(index_q, weights, index_k, dq_dtype, dw_dtype, dk_dtype)


@torch.library.custom_op("dsaib::indexer_kl_forward", mutates_args=())
def _indexer_kl_forward_op(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    attn_score: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    sm_scale: float,
    loss_coeff: float,
    normalization_count: int,
    layout: str,
    id_mode: str,
    strict_indices: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, row_lse, row_target_mass), float32, through dsaib::indexer_kl_forward
    (no P: the backward rebuilds it from the row statistics)."""
    dev = index_q.device
    loss, row_lse, row_target_mass = _forward_outputs(index_q, topk_indices)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, loss=loss,
                   row_lse=row_lse, row_target_mass=row_target_mass)
    options = _op_options(dev, sm_scale, loss_coeff, normalization_count, layout, id_mode,
                          strict_indices=strict_indices)
    _run_library(_dsaib.indexer_kl_forward, _dsaib.indexer_kl_forward_workspace_size, dev, tensors, options)
    return loss, row_lse, row_target_mass


def _forward_outputs(index_q, topk_indices):
    """loss (), row_lse and row_target_mass (topk_indices' shape without topk), float32."""
    rows = topk_indices.shape[:-1]
    return (index_q.new_empty((), dtype=torch.float32), index_q.new_empty(rows, dtype=torch.float32),
            index_q.new_empty(rows, dtype=torch.float32))


@_indexer_kl_forward_op.register_fake
def _indexer_kl_forward_fake(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k,
                             sm_scale, loss_coeff, normalization_count, layout, id_mode, strict_indices=False):
    _check_same_device(index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                       attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return _forward_outputs(index_q, topk_indices)


@torch.library.custom_op("dsaib::indexer_kl_loss_and_grad", mutates_args=())
def _indexer_kl_loss_and_grad_op(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    attn_score: torch.Tensor,
    grad_loss: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    sm_scale: float,
    loss_coeff: float,
    normalization_count: int,
    layout: str,
    id_mode: str,
    dq_dtype: str,
    dw_dtype: str,
    dk_dtype: str,
    a_operand_precision: str = "auto",
    loss_dtype: str = "f32",
    strict_indices: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d_index_q, d_weights, d_index_k) through dsaib::indexer_kl_loss_and_grad."""
    dev = index_q.device
    loss = index_q.new_empty((), dtype=_out_dtype("loss_dtype", loss_dtype))
    dq, dw, dk = _gradients_like(index_q, weights, index_k, dq_dtype, dw_dtype, dk_dtype)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, loss=loss,
                   d_index_q=dq, d_weights=dw, d_index_k=dk, grad_loss_device=grad_loss)
    options = _op_options(dev, sm_scale, loss_coeff, normalization_count, layout, id_mode, a_operand_precision,
                          strict_indices=strict_indices)
    _run_library(_dsaib.indexer_kl_loss_and_grad, _dsaib.indexer_kl_loss_and_grad_workspace_size, dev, tensors,
                 options)
    return loss, dq, dw, dk


@_indexer_kl_loss_and_grad_op.register_fake
def _indexer_kl_loss_and_grad_fake(index_q, weights, index_k, topk_indices, attn_score, grad_loss, cu_seqlens_q,
                                   cu_seqlens_k, sm_scale, loss_coeff, normalization_count, layout, id_mode,
                                   dq_dtype, dw_dtype, dk_dtype, a_operand_precision="auto", loss_dtype="f32",
                                   strict_indices=False):
    _check_a_operand(a_operand_precision)
    _check_same_device(index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                       attn_score=attn_score, grad_loss=grad_loss, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k)
    return (index_q.new_empty((), dtype=_out_dtype("loss_dtype", loss_dtype)),
            *_gradients_like(index_q, weights, index_k, dq_dtype, dw_dtype, dk_dtype))


def indexer_backward(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    attn_score: torch.Tensor,
    index_score: Optional[torch.Tensor],
    *,
    sm_scale: float,
    grad_loss=1.0,
    loss_coeff: float = 1.0,
    normalization_count: int = 0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    out_dtype="f32",
    a_operand_precision: str = "auto",
    row_lse: Optional[torch.Tensor] = None,
    row_target_mass: Optional[torch.Tensor] = None,
    l2_hints: str = "auto",
    start_stagger: str = "auto",
    strict_indices: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_index_q, d_weights, d_index_k)`` through ``torch.ops.dsaib.indexer_backward``.

    Same tensors, shapes and dtypes as :func:`dsaib.indexer_backward` (index_q
    and index_k ``torch.bfloat16``; weights bf16 or float32; topk_indices
    int32; attn_score and index_score float32), all on one device: CUDA tensors
    run the cuda backend on the current stream, CPU tensors the CPU backend.

    P-free form: ``index_score=None`` with ``row_lse`` and ``row_target_mass``
    (float32, ``(B, S_q)`` / ``(T_q,)``, as :func:`dsaib.indexer_kl_forward`
    or ``torch.ops.dsaib.indexer_kl_forward`` return them); the backward
    rebuilds P from its own logits.

    Args:
      grad_loss: a number, or a one-element float32 tensor on the tensors'
        device, read when the kernel runs (a captured CUDA graph sees the value
        it holds at replay).
      out_dtype: ``"f32"`` or ``"bf16"`` for all three outputs, or a tuple of
        three such codes (d_index_q, d_weights, d_index_k).
      a_operand_precision: CUDA only: ``"auto"`` (default), ``"bf16x2"`` or
        ``"bf16"``, the precision of the a operand of the dK/dQ GEMMs. One
        bf16 term (``"bf16"``) is faster (two terms take ~1.15x the time of
        one at DeepSeek shapes) and adds ~1.3-1.6e-3 relative RMS error to
        d_index_q/d_index_k; two terms (``"bf16x2"``) keep float32 outputs
        within 1e-3. ``"auto"`` takes two terms when d_index_q or d_index_k
        is float32. The CPU backend ignores it. See
        :func:`dsaib.indexer_backward`.
      l2_hints: CUDA only: ``"auto"`` (default), ``"on"`` or ``"off"``, and
      start_stagger: CUDA only: ``"auto"`` (default) or ``"off"``: launch
        choices that never change the result, as for
        :func:`dsaib.indexer_backward` (which documents them). The CPU backend
        ignores them; a bad word raises ValueError on any device.
      strict_indices: ``True`` raises ValueError naming the first invalid id
        (outside its sequence, or beyond int32) instead of ignoring its slot;
        it reads the ids to the host (on a GPU: a synchronisation, and not
        allowed while a CUDA graph is being captured).

    The outputs are new contiguous tensors on index_q's device. No host
    synchronisation (BSHD); THD reads cu_seqlens to the host for validation.
    Errors: TypeError/ValueError/RuntimeError with the C++ library's message.
    """
    if isinstance(out_dtype, str):
        out_dtype = (out_dtype,) * 3
    dq_dtype, dw_dtype, dk_dtype = out_dtype
    if not isinstance(grad_loss, torch.Tensor):
        grad_loss = torch.full((), float(grad_loss), dtype=torch.float32, device=index_q.device)
    return torch.ops.dsaib.indexer_backward(
        index_q, weights, index_k, topk_indices, attn_score, index_score, grad_loss, cu_seqlens_q, cu_seqlens_k,
        float(sm_scale), float(loss_coeff), int(normalization_count), layout, id_mode, dq_dtype, dw_dtype, dk_dtype,
        _a_operand(a_operand_precision), row_lse, row_target_mass,
        _option_str("l2_hints", l2_hints, '"auto", "on" or "off"'),
        _option_str("start_stagger", start_stagger, '"auto" or "off"'),
        _bool_value("strict_indices", strict_indices),
    )


# ---- the forward: logits, index scores, loss (plain torch) ------------------


def _check_torch_arguments(index_q, weights, index_k, topk_indices, attn_score=None, cu_seqlens_q=None,
                           cu_seqlens_k=None, cu_seqlens_on_any_device=False):
    """The torch layer's own rules, before the library's: every tensor argument a
    torch.Tensor, all on index_q's device (torch would compute with a meta tensor
    beside cpu ones, from uninitialised memory; the library cannot see meta
    tensors), topk_indices of an integer dtype and attn_score of a floating one
    (the forward converts them to int32 and float32)."""
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) and (t is not None or name in ("index_q", "weights", "index_k",
                                                                            "topk_indices")):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    same_device = {n: t for n, t in tensors.items() if n != "index_q"}
    if cu_seqlens_on_any_device:
        del same_device["cu_seqlens_q"], same_device["cu_seqlens_k"]
    _check_same_device(index_q, **same_device)
    if topk_indices.is_floating_point() or topk_indices.is_complex() or topk_indices.dtype == torch.bool:
        raise TypeError(f"topk_indices: expected an integer dtype, got {topk_indices.dtype}")
    if attn_score is not None and not attn_score.is_floating_point():
        raise TypeError(f"attn_score: expected a floating-point dtype, got {attn_score.dtype}")


def _library_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the library's validation is shown of a tensor that the forward hands
    to the backward as ``t.to(dtype).contiguous()``: t itself when that is t,
    else a stand-in of that dtype and t's shape, one row broadcast over the
    others (no copy of t; its values are never read by the validation)."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return torch.empty(t.shape[-1:], dtype=dtype, device=t.device).expand(t.shape)


def _validate_forward(index_q, weights, index_k, topk_indices, attn_score, *, sm_scale, layout, id_mode,
                      cu_seqlens_q, cu_seqlens_k, loss_coeff=1.0, normalization_count=0,
                      a_operand_precision="auto", any_integer_cu_seqlens=False, strict_indices=False):
    """The library's validation (dsaib::validate_indexer_kl_loss_inputs) of what
    the backward will get, before the forward computes anything, so that a bad
    argument raises its TypeError/ValueError naming the argument, as the
    backward would, instead of failing inside torch or at backward().

    The tensors are shown as the forward converts them (_library_view): bf16
    index_q/index_k, float32 (or bf16; CPU float64: float64) weights, int32
    topk_indices, float32 (CPU float64: float64) attn_score (absent: shaped
    like topk_indices); index_score is the P the
    forward computes. any_integer_cu_seqlens (index_scores, which has no
    backward): cu_seqlens of any integer dtype on any device are shown as
    int32 on index_q's device. Only metadata is read, and for THD cu_seqlens
    (on a GPU: a copy to the host on the current stream, waited for);
    strict_indices: the ids themselves too (as int32, an id beyond it raising
    here). Not run
    while torch.compile traces (the library is not traceable; the backward op
    checks the same when it runs) nor for meta tensors (no memory to check).
    """
    if torch.compiler.is_compiling() or index_q.device.type not in ("cpu", "cuda"):
        return
    cuda = index_q.device.type == "cuda"
    fp64 = _fp64(index_q.device, index_q, weights, index_k)
    w_dtype, T_dtype = _library_float_dtypes(weights, fp64)
    if any_integer_cu_seqlens:
        cu_seqlens_q, cu_seqlens_k = (
            cu if cu is None or cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool
            else cu.to(device=index_q.device, dtype=torch.int32) for cu in (cu_seqlens_q, cu_seqlens_k))
    if attn_score is None:
        attn_score = torch.empty(topk_indices.shape[-1:], dtype=torch.float32, device=index_q.device).expand(
            topk_indices.shape)
    tensors = dict(index_q=_library_view(index_q, torch.bfloat16), weights=_library_view(weights, w_dtype),
                   index_k=_library_view(index_k, torch.bfloat16),
                   topk_indices=(_ids_int32(topk_indices, strict=True) if strict_indices
                                 else _library_view(topk_indices, torch.int32)),
                   attn_score=_library_view(attn_score, T_dtype), cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k)
    _dsaib.validate_indexer_kl_loss_inputs(
        **_exported(tensors), layout=layout, id_mode=id_mode, backend="cuda" if cuda else "cpu",
        sm_scale=_float_or_inf(sm_scale), loss_coeff=_float_or_inf(loss_coeff),
        normalization_count=_normalization_count(int(normalization_count)),
        stream=int(torch.cuda.current_stream(index_q.device).cuda_stream) if cuda else 0,
        a_operand_precision=a_operand_precision, strict_indices=bool(strict_indices))


def _key_rows(index_k, topk_indices, layout, id_mode, cu_seqlens_q, cu_seqlens_k):
    """Flat key row of every slot ((R, topk) int64, 0 at invalid slots) and the valid mask."""
    ids = topk_indices.to(torch.int64)
    dev = ids.device
    if layout == "bshd":
        B, S_kv = ids.shape[0], index_k.shape[1]
        start = (torch.arange(B, device=dev, dtype=torch.int64) * S_kv).view(B, 1, 1)
        length = torch.full_like(start, S_kv)
    elif layout == "thd":
        cu_q = cu_seqlens_q.to(device=dev, dtype=torch.int64)
        cu_k = cu_seqlens_k.to(device=dev, dtype=torch.int64)
        n_seq = cu_q.numel() - 1
        rows_q = torch.arange(ids.shape[0], device=dev, dtype=torch.int64)
        seq = torch.searchsorted(cu_q[1:].contiguous(), rows_q, right=True).clamp(0, max(n_seq - 1, 0))
        seq_end = (seq + 1).clamp(max=cu_k.numel() - 1)  # in bounds for any cu_seqlens (checked elsewhere)
        start = cu_k[seq].unsqueeze(1)
        length = (cu_k[seq_end] - cu_k[seq]).unsqueeze(1)
    else:  # reached only under torch.compile, where the library's checks run in the backward op
        raise ValueError(f'layout: expected "bshd" or "thd", got "{layout}"')
    if id_mode == "local":
        valid = (ids >= 0) & (ids < length)
        rows = ids + start
    elif id_mode == "global":
        valid = (ids >= start) & (ids < start + length)
        rows = ids
    else:
        raise ValueError(f'id_mode: expected "local" or "global", got "{id_mode}"')
    # In bounds even for cu_seqlens the library has not seen (under
    # torch.compile it checks them in the backward op).
    n_key_rows = index_k.numel() // max(index_k.shape[-1], 1)  # flat rows (B*S_kv or T_k)
    valid = valid & (rows >= 0) & (rows < n_key_rows)
    rows = torch.where(valid, rows, torch.zeros_like(rows))
    topk = ids.shape[-1]
    return rows.reshape(-1, topk), valid.reshape(-1, topk)


# Elements of the largest (rows, topk, max(D, H)) intermediate the reference
# forward makes at once; rows beyond it are computed in chunks.
_LOGITS_CHUNK_ELEMENTS = 1 << 26


@torch.library.custom_op("dsaib::index_logits", mutates_args=())
def _index_logits_op(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                     rows: torch.Tensor, valid: torch.Tensor, sm_scale: float,
                     dtype: torch.dtype) -> torch.Tensor:
    """z (R, topk) in `dtype`, -inf at invalid slots; computed in row chunks to bound memory.

    An op of its own (not differentiable; the loss's forward and index_scores
    need no graph through it) so that torch.compile sees one call with
    symbolic shapes instead of tracing the Python loop over the chunks, which
    specialises R; torch 2.11's dynamo fails on that inside the loss's
    autograd.Function under ``dynamic=True``. Autocast is off inside: the
    result is in `dtype`, as the fake kernel says, also under an enclosing
    ``torch.autocast`` (whose bmm would otherwise run in bf16 in eager only,
    since compiled graphs call the op with autocast off).
    """
    R, topk = rows.shape
    H, D = index_q.shape[-2], index_q.shape[-1]
    if index_k.numel() == 0 or R == 0:
        return torch.full((R, topk), float("-inf"), dtype=dtype, device=index_q.device)
    q = index_q.reshape(R, H, D)
    w = weights.reshape(R, H)
    k = index_k.reshape(-1, D)
    chunk = max(1, _LOGITS_CHUNK_ELEMENTS // max(1, topk * max(D, H)))
    parts = []
    with torch.autocast(index_q.device.type, enabled=False):
        for r0 in range(0, R, chunk):
            r1 = min(R, r0 + chunk)
            kg = k[rows[r0:r1]].to(dtype)                            # (c, topk, D)
            x = torch.bmm(q[r0:r1].to(dtype), kg.transpose(1, 2))    # (c, H, topk)
            parts.append(torch.bmm(w[r0:r1].to(dtype).unsqueeze(1), torch.relu(x)).squeeze(1))
        z = torch.cat(parts) * sm_scale
        return z.masked_fill(~valid, float("-inf"))


@_index_logits_op.register_fake
def _index_logits_fake(index_q, weights, index_k, rows, valid, sm_scale, dtype):
    return index_q.new_empty(rows.shape, dtype=dtype)


def _logits(index_q, weights, index_k, rows, valid, sm_scale, dtype):
    """z (R, topk) in `dtype`, -inf at invalid slots (see _index_logits_op)."""
    return _index_logits_op(index_q, weights, index_k, rows, valid, float(sm_scale), dtype)


def _softmax_valid(z):
    """Softmax over the finite entries of each row; rows with none give 0."""
    zmax = z.amax(dim=-1, keepdim=True)
    zmax = torch.where(torch.isfinite(zmax), zmax, torch.zeros_like(zmax))
    e = torch.exp(z - zmax)
    s = e.sum(dim=-1, keepdim=True)
    return e / torch.where(s > 0, s, torch.ones_like(s))


def index_scores(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    sm_scale: float,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The indexer's softmax ``P`` over the selected slots, shaped like topk_indices.

    0 at invalid slots (and in rows with no valid slot). Computed in ``dtype``
    from the given values (round index_q/index_k to bf16 first to get what the
    library's backward sees). Not differentiable (use :func:`indexer_kl_loss`).

    Arguments are validated as :func:`indexer_kl_loss` validates them (without
    attn_score), except that cu_seqlens may be of any integer dtype, on any
    device.
    """
    _check_torch_arguments(index_q, weights, index_k, topk_indices, None, cu_seqlens_q, cu_seqlens_k,
                           cu_seqlens_on_any_device=True)
    _validate_forward(index_q, weights, index_k, topk_indices, None, sm_scale=sm_scale, layout=layout,
                      id_mode=id_mode, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      any_integer_cu_seqlens=True)
    with torch.no_grad():
        rows, valid = _key_rows(index_k, topk_indices, layout, id_mode, cu_seqlens_q, cu_seqlens_k)
        z = _logits(index_q, weights, index_k, rows, valid, sm_scale, dtype)
        return _softmax_valid(z).reshape(topk_indices.shape)


def _finite_grad_loss(x) -> float:
    """grad_loss given as a number: finite as float32, with the library's message
    (on CUDA the library does not read a device grad_loss before it runs)."""
    return _finite_f32("grad_loss", x)


def _ids_int32(topk_indices: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """topk_indices as the library takes them: int32, contiguous (itself when
    already so). An id that int32 cannot hold (int64, uint32 or uint64 ids) is
    out of range for every sequence, so an invalid slot: it becomes -1, where a
    plain cast would wrap it onto a valid id (2**32 + 1 would read as 1). Done
    on the device with torch.where: no host synchronisation, so CUDA graphs
    capture it and torch.compile traces it. strict (the library's
    strict_indices): ValueError naming the first such id instead, which reads
    the ids to the host."""
    ids = topk_indices
    if ids.dtype == torch.int32:
        return ids.contiguous()
    if ids.dtype in (torch.int8, torch.int16, torch.uint8, torch.uint16):
        return ids.to(torch.int32).contiguous()
    unsigned = ids.dtype in (torch.uint32, torch.uint64)
    # torch compares unsigned types wider than 8 bits on no device: compare in
    # int64, where a uint64 id of 2**63 or more turns negative (marked below).
    wide = ids.to(torch.int64)
    outside = (wide < _INT32_MIN) | (wide > _INT32_MAX)
    if unsigned:
        outside = outside | (wide < 0)
    if strict and bool(outside.any()):
        at = tuple(int(i) for i in outside.nonzero()[0])
        value = int(wide[at])
        value = value + 2**64 if value < 0 and unsigned else value
        raise ValueError(f"topk_indices: strict mode found an out-of-range id at {at}: expected -1 or an id in "
                         f"[-2^31, 2^31-1] (int32), got id {value}")
    return torch.where(outside, torch.full((), -1, dtype=torch.int32, device=ids.device),
                       wide.to(torch.int32)).contiguous()


def _library_float_dtypes(weights, fp64):
    """(weights, attn_score) dtypes the library is given: weights bf16 or float32
    as they are, others as float32; attn_score float32. In the fp64 mode
    (_fp64: the CPU backend) float64 weights and attn_score stay float64."""
    kept = (torch.bfloat16, torch.float32, torch.float64) if fp64 else (torch.bfloat16, torch.float32)
    return (weights.dtype if weights.dtype in kept else torch.float32), (torch.float64 if fp64 else torch.float32)


def _library_inputs(index_q, weights, index_k, topk_indices, attn_score, fp64=False, strict=False):
    """The tensors as the library takes them: bf16 index_q/index_k, float32 (or
    bf16) weights, int32 topk_indices, float32 attn_score, all contiguous; in
    the fp64 mode float64 weights and a float64 attn_score (unrounded). A
    tensor already so is passed as it is (no copy)."""
    w_dtype, T_dtype = _library_float_dtypes(weights, fp64)
    return (index_q.to(torch.bfloat16).contiguous(), weights.to(w_dtype).contiguous(),
            index_k.to(torch.bfloat16).contiguous(), _ids_int32(topk_indices, strict),
            attn_score.to(T_dtype).contiguous())


def _float64_forward(index_q, weights, index_k, topk_indices, attn_score, sm_scale, loss_coeff,
                     normalization_count, layout, id_mode, cu_seqlens_q, cu_seqlens_k):
    """(loss, row_lse, row_target_mass) in float64 in torch, from the unrounded
    values: the forward of float64 inputs, for finite-difference checks.
    sm_scale and loss_coeff as the library applies them, rounded to float32:
    its backward rebuilds P with that sm_scale from row_lse, so the gradient
    is that of the loss returned here."""
    sm_scale, loss_coeff = _f32_round(float(sm_scale)), _f32_round(float(loss_coeff))
    rows, valid = _key_rows(index_k, topk_indices, layout, id_mode, cu_seqlens_q, cu_seqlens_k)
    z = _logits(index_q, weights, index_k, rows, valid, sm_scale, torch.float64)
    P = _softmax_valid(z)
    T = attn_score.reshape(P.shape).to(torch.float64).clamp_min(EPS)
    zero = torch.zeros_like(P)
    terms = torch.where(valid, T * torch.log(P.clamp_min(EPS)), zero)
    n = int(normalization_count) if normalization_count else P.shape[0]
    loss = -(float(loss_coeff) / max(n, 1)) * terms.sum()
    row_shape = topk_indices.shape[:-1]
    row_lse = torch.logsumexp(z, dim=-1).reshape(row_shape)  # -inf for a row without a valid slot
    row_target_mass = torch.where(valid & (P >= EPS), T, zero).sum(-1).reshape(row_shape)
    return loss, row_lse, row_target_mass


class _IndexerKLLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, index_q, weights, index_k, topk_indices, attn_score, sm_scale, loss_coeff,
                normalization_count, layout, id_mode, cu_seqlens_q, cu_seqlens_k, a_operand_precision,
                strict_indices=False):
        # CPU float64: the backward reads the forward's float64 row statistics, float64
        # weights and attn_score, and writes float64 gradients, all unrounded.
        fp64 = _fp64(index_q.device, index_q, weights, index_k)
        q16, w_op, k16, ids32, T32 = _library_inputs(index_q, weights, index_k, topk_indices, attn_score, fp64,
                                                     strict_indices)
        if any(t.dtype == torch.float64 for t in (index_q, weights, index_k)):
            loss, row_lse, row_target_mass = _float64_forward(
                index_q, weights, index_k, topk_indices, attn_score, sm_scale, loss_coeff, normalization_count,
                layout, id_mode, cu_seqlens_q, cu_seqlens_k)
        else:
            # The library's forward: the loss and each row's LSE and target
            # mass; no P (S_q x topk) is made, saved or passed on.
            loss, row_lse, row_target_mass = torch.ops.dsaib.indexer_kl_forward(
                q16, w_op, k16, ids32, T32, cu_seqlens_q, cu_seqlens_k, float(sm_scale), float(loss_coeff),
                int(normalization_count), layout, id_mode, strict_indices)
        stats = torch.float64 if fp64 else torch.float32
        ctx.save_for_backward(q16, w_op, k16, ids32, T32, row_lse.to(stats), row_target_mass.to(stats),
                              cu_seqlens_q, cu_seqlens_k)
        ctx.in_dtypes = (index_q.dtype, weights.dtype, index_k.dtype)
        ctx.fp64 = fp64
        ctx.options = (float(sm_scale), float(loss_coeff), int(normalization_count), layout, id_mode,
                       a_operand_precision)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        q16, w_op, k16, ids32, T32, row_lse, row_target_mass, cu_q, cu_k = ctx.saved_tensors
        sm_scale, loss_coeff, normalization_count, layout, id_mode, a_operand_precision = ctx.options
        q_dt, w_dt, k_dt = ctx.in_dtypes
        # Outputs straight in the input dtype when the library can write it.
        codes = tuple(_grad_code(dt, ctx.fp64) for dt in (q_dt, w_dt, k_dt))
        g = grad_loss.detach().reshape(()).to(torch.float32)
        # The P-free backward: P rebuilt from the row statistics.
        dq, dw, dk = torch.ops.dsaib.indexer_backward(
            q16, w_op, k16, ids32, T32, None, g, cu_q, cu_k, sm_scale, loss_coeff, normalization_count,
            layout, id_mode, *codes, a_operand_precision, row_lse, row_target_mass,
        )
        need = ctx.needs_input_grad
        return (
            dq.to(q_dt) if need[0] else None,
            dw.to(w_dt) if need[1] else None,
            dk.to(k_dt) if need[2] else None,
            None, None, None, None, None, None, None, None, None, None, None,
        )


def indexer_kl_loss(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    attn_score: torch.Tensor,
    *,
    sm_scale: float,
    loss_coeff: float = 1.0,
    normalization_count: int = 0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    a_operand_precision: str = "auto",
    strict_indices: bool = False,
) -> torch.Tensor:
    """The indexer KL loss, a 0-dim tensor; its backward runs ``torch.ops.dsaib.indexer_backward``.

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

    H a multiple of 8 in [8, 128], D 64 or 128. Ids that int32 cannot hold
    are invalid slots (-1 for the library), never wrapped. The forward is the library's
    ``indexer_kl_forward`` (the fused kernel on CUDA tensors, the fp64 CPU
    backend on CPU tensors; float64 inputs: torch in float64): it returns the
    loss (float32; float64 for float64 inputs) and saves, besides the converted
    inputs, each query row's log-sum-exp and target mass (float32), not ``P``.
    Float64 inputs on CPU keep float64 through the library: float64
    ``weights`` and ``attn_score``, row statistics and gradients, unrounded
    (on CUDA they are converted to float32 for the library).
    The backward is the P-free ``indexer_backward``, which rebuilds ``P`` from
    them, with ``grad_loss`` from autograd as a device tensor (CUDA graphs can
    replay it with new values). Of size S_q x topk only ``topk_indices`` and
    ``attn_score`` are kept (themselves when already int32 / float32 and
    contiguous, else their converted copies). Gradients come back in the
    dtypes of index_q, weights and index_k.

    Raises, before computing anything: TypeError for a non-tensor argument,
    non-integer ``topk_indices`` or non-float ``attn_score``, and ValueError
    for tensors on different devices; then whatever the backward would raise
    for these arguments, with the C++ library's messages, from its own
    validation (dsaib::validate_indexer_kl_loss_inputs, given the tensors as
    the forward converts them): a rank, shape, H, D or topk it does not take,
    an ``sm_scale`` or ``loss_coeff`` not finite as float32, a
    ``normalization_count`` outside [0, 2^63-1], a bad ``layout``, ``id_mode``
    or ``a_operand_precision``, missing/extra cu_seqlens, cu_seqlens that are
    not int32, of the wrong length or with bad values (THD on a GPU reads them
    to the host: one synchronisation). Under torch.compile the library's
    checks run in the backward op instead (they are not traceable), where
    its errors surface when ``backward()`` runs.

    ``a_operand_precision`` (``"auto"``, ``"bf16x2"`` or ``"bf16"``) goes to
    the backward's op (see :func:`indexer_backward`): ``"auto"`` uses two bf16
    terms for float32 gradients of index_q/index_k (float32/float64 leaves)
    and one for bf16 leaves; ``"bf16"`` is faster (two terms take ~1.15x its time) and adds
    ~1.3-1.6e-3 relative RMS error to those gradients. A bad value is a
    ValueError here.

    ``strict_indices=True``: an invalid id (outside its sequence, or beyond
    int32) raises ValueError naming it, before anything is computed, instead
    of being an ignored slot; the ids are read to the host (on a GPU: a
    synchronisation; not allowed during a CUDA graph capture).
    """
    a_operand_precision = _a_operand(a_operand_precision)
    strict_indices = _bool_value("strict_indices", strict_indices)
    _check_torch_arguments(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k)
    _validate_forward(index_q, weights, index_k, topk_indices, attn_score, sm_scale=sm_scale, layout=layout,
                      id_mode=id_mode, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, loss_coeff=loss_coeff,
                      normalization_count=normalization_count, a_operand_precision=a_operand_precision,
                      strict_indices=strict_indices)
    return _IndexerKLLossFunction.apply(
        index_q, weights, index_k, topk_indices, attn_score, float(sm_scale), float(loss_coeff),
        int(normalization_count), layout, id_mode, cu_seqlens_q, cu_seqlens_k, a_operand_precision,
        strict_indices,
    )


def indexer_kl_loss_and_grad(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    attn_score: torch.Tensor,
    *,
    sm_scale: float,
    loss_coeff: float = 1.0,
    grad_loss=1.0,
    normalization_count: int = 0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    a_operand_precision: str = "auto",
    strict_indices: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, d_index_q, d_weights, d_index_k)`` in one library call, for an
    indexer trained only by this loss (detached from the model's graph).

    Through ``torch.ops.dsaib.indexer_kl_loss_and_grad``
    (dsaib::indexer_kl_loss_and_grad): the loss forward and the P-free backward
    in one host call; no P exists anywhere. Arguments, their conversions and the
    loss as :func:`indexer_kl_loss`; the gradients equal what
    ``indexer_kl_loss(...).backward(grad_loss)`` gives, in the dtypes of
    index_q, weights and index_k, and the loss is not scaled by ``grad_loss``.
    Float64 CPU tensors: the library's fp64 forward (on index_q/index_k rounded
    to bf16, where :func:`indexer_kl_loss` computes its float64 forward in
    torch on the unrounded values), a float64 loss and float64 gradients, all
    unrounded.

    ``grad_loss``: a number, or a one-element float32 tensor on the tensors'
    device read when the work runs. On CUDA the call does not synchronise the
    host (BSHD and THD: the library checks device cu_seqlens on the device
    while a capture is under way), so ``torch.cuda.graph`` captures it and each
    replay reads the ``grad_loss`` tensor anew. Not differentiable: the outputs
    are plain tensors.

    Errors: the torch layer's rules as :func:`indexer_kl_loss` (TypeError,
    ValueError), then the library's validation of the converted tensors, with
    its messages, before anything is written. ``strict_indices`` as
    :func:`indexer_kl_loss` (it reads the ids to the host, so a capture
    refuses it).
    """
    a_operand_precision = _a_operand(a_operand_precision)
    strict_indices = _bool_value("strict_indices", strict_indices)
    _check_torch_arguments(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k)
    if not isinstance(grad_loss, torch.Tensor):
        grad_loss = torch.full((), _finite_grad_loss(grad_loss), dtype=torch.float32, device=index_q.device)
    fp64 = _fp64(index_q.device, index_q, weights, index_k)
    codes = tuple(_grad_code(t.dtype, fp64) for t in (index_q, weights, index_k))
    with torch.no_grad():
        q16, w_op, k16, ids32, T32 = _library_inputs(index_q, weights, index_k, topk_indices, attn_score, fp64,
                                                     strict_indices)
        loss, dq, dw, dk = torch.ops.dsaib.indexer_kl_loss_and_grad(
            q16, w_op, k16, ids32, T32, grad_loss.detach(), cu_seqlens_q, cu_seqlens_k, float(sm_scale),
            float(loss_coeff), int(normalization_count), layout, id_mode, *codes, a_operand_precision,
            "f64" if fp64 else "f32", strict_indices)
    return loss, dq.to(index_q.dtype), dw.to(weights.dtype), dk.to(index_k.dtype)


class IndexerKLLoss(torch.nn.Module):
    """:func:`indexer_kl_loss` as a module: ``IndexerKLLoss(sm_scale=D**-0.5)(q, w, k, ids, T)``.

    ``a_operand_precision`` (``"auto"``, ``"bf16x2"``, ``"bf16"``) is passed to the backward.
    """

    def __init__(self, sm_scale: float, loss_coeff: float = 1.0, normalization_count: int = 0,
                 layout: str = "bshd", id_mode: str = "local", a_operand_precision: str = "auto",
                 strict_indices: bool = False):
        super().__init__()
        self.strict_indices = _bool_value("strict_indices", strict_indices)
        self.a_operand_precision = _check_a_operand(_a_operand(a_operand_precision))
        self.sm_scale = float(sm_scale)
        self.loss_coeff = float(loss_coeff)
        self.normalization_count = int(normalization_count)
        self.layout = layout
        self.id_mode = id_mode

    def forward(self, index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q=None, cu_seqlens_k=None):
        return indexer_kl_loss(
            index_q, weights, index_k, topk_indices, attn_score, sm_scale=self.sm_scale,
            loss_coeff=self.loss_coeff, normalization_count=self.normalization_count, layout=self.layout,
            id_mode=self.id_mode, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            a_operand_precision=self.a_operand_precision, strict_indices=self.strict_indices,
        )

    def extra_repr(self) -> str:
        return (f"sm_scale={self.sm_scale}, loss_coeff={self.loss_coeff}, "
                f"normalization_count={self.normalization_count}, layout={self.layout}, id_mode={self.id_mode}, "
                f"a_operand_precision={self.a_operand_precision}, strict_indices={self.strict_indices}")


# ---- the attention target ----------------------------------------------------


@torch.library.custom_op("dsaib::attention_target", mutates_args=())
def _attention_target_op(
    query: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    topk_indices: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    sm_scale: float,
    lse_base: str,
    normalize: bool,
    layout: str,
    id_mode: str,
    strict_indices: bool = False,
) -> torch.Tensor:
    """attn_score (float32, shaped like topk_indices) through dsaib::attention_target."""
    dev = query.device
    attn_score = query.new_empty(topk_indices.shape, dtype=torch.float32)
    tensors = dict(query=query, kv=kv, lse=lse, topk_indices=topk_indices, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, attn_score=attn_score)
    cuda = dev.type == "cuda"
    options = dict(layout=layout, id_mode=id_mode, backend="cuda" if cuda else "cpu", sm_scale=float(sm_scale),
                   lse_base=lse_base, normalize=bool(normalize), strict_indices=bool(strict_indices),
                   stream=int(torch.cuda.current_stream(dev).cuda_stream) if cuda else 0, num_threads=0)
    _run_library(_dsaib.attention_target, _dsaib.attention_target_workspace_size, dev, tensors, options)
    return attn_score


@_attention_target_op.register_fake
def _attention_target_fake(query, kv, lse, topk_indices, cu_seqlens_q, cu_seqlens_k, sm_scale, lse_base, normalize,
                           layout, id_mode, strict_indices=False):
    if lse_base not in ("natural", "base2"):
        raise ValueError(f'lse_base: expected "natural" or "base2", got "{lse_base}"')
    _check_same_device(query, kv=kv, lse=lse, topk_indices=topk_indices, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k)
    return query.new_empty(topk_indices.shape, dtype=torch.float32)


def attention_target(
    query: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    sm_scale: float,
    lse_base: str = "natural",
    normalize: bool = True,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    strict_indices: bool = False,
) -> torch.Tensor:
    """The indexer loss's target ``T`` (attn_score) from the main attention's
    tensors, through ``torch.ops.dsaib.attention_target`` (dsaib::attention_target).

    MLA in its absorbed form: ``query`` (B, S_q, Hq, Dqk) / (T_q, Hq, Dqk), one
    latent key row per token ``kv`` (B, S_kv, Dqk) / (T_k, Dqk), and the main
    attention's saved log-sum-exp ``lse`` (B, S_q, Hq) / (T_q, Hq), in natural
    log or base 2 (``lse_base="base2"``: FlashMLA's). Per query row and valid
    slot ``i`` with key row ``j``::

        U_i = sum_h exp(sm_scale * query[t, h] . kv[j] - lse[t, h])
        T_i = U_i / sum_i' U_i'        (normalize=True; 0 where the row's sum is 0)

    0 at invalid slots. ``normalize=False`` returns U, for tensor parallelism
    (heads split over ranks): all-reduce U over the ranks, then divide each row
    by its sum. ``sm_scale`` is the main attention's softmax scale.

    query and kv are taken as bf16 (other float dtypes are rounded to bf16),
    lse as float32 (any strides; a float64 lse on CPU as it is, unrounded),
    topk_indices as int32 (ids outside int32:
    invalid slots), sm_scale as float32. CUDA tensors run the
    sm_90a kernel on the current stream (Hq a multiple of 16 up to 128, Dqk a
    multiple of 64 up to 576; no host synchronisation, CUDA-graph capturable),
    CPU tensors the fp64 CPU backend. Returns a new float32 tensor shaped like
    topk_indices; not differentiable (a target). Errors: TypeError naming
    ``normalize`` (not a bool), ``layout``, ``id_mode`` or ``lse_base`` (not a
    str) or ``sm_scale`` (not a real number), as the numpy entry point;
    then TypeError/ValueError/RuntimeError with the C++ library's messages.
    ``strict_indices=True``: an invalid id (outside its sequence, or beyond
    int32) raises ValueError naming it instead of being a 0 slot; the ids are
    read to the host (on a GPU: a synchronisation; refused during a capture).
    """
    for name, t in dict(query=query, kv=kv, lse=lse, topk_indices=topk_indices).items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if topk_indices.is_floating_point() or topk_indices.is_complex() or topk_indices.dtype == torch.bool:
        raise TypeError(f"topk_indices: expected an integer dtype, got {topk_indices.dtype}")
    # The op's schema would refuse a non-str word with torch's own message, and
    # bool() would take the str "false" as true.
    sm_scale = _f32_value("sm_scale", sm_scale)
    lse_base = _option_str("lse_base", lse_base, '"natural" or "base2"')
    normalize = _bool_value("normalize", normalize)
    layout = _option_str("layout", layout, '"bshd" or "thd"')
    id_mode = _option_str("id_mode", id_mode, '"local" or "global"')
    strict_indices = _bool_value("strict_indices", strict_indices)
    with torch.no_grad():
        q16 = query.to(torch.bfloat16).contiguous() if query.is_floating_point() else query
        kv16 = kv.to(torch.bfloat16).contiguous() if kv.is_floating_point() else kv
        # float32, strides kept when already so; a float64 lse on CPU stays float64 (the
        # cpu backend takes it unrounded: at |lse| ~ 1000 float32 would move T by ~6e-5)
        keep = lse.dtype == torch.float64 and lse.device.type == "cpu"
        lse32 = lse if keep or not lse.is_floating_point() else lse.to(torch.float32)
        return torch.ops.dsaib.attention_target(
            q16, kv16, lse32, _ids_int32(topk_indices, strict_indices), cu_seqlens_q, cu_seqlens_k, sm_scale,
            lse_base, normalize, layout, id_mode, strict_indices)


def indexer_kl_loss_and_grad_from_attention(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    query: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    sm_scale: float,
    softmax_scale: float,
    lse_base: str = "natural",
    loss_coeff: float = 1.0,
    grad_loss=1.0,
    normalization_count: int = 0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    a_operand_precision: str = "auto",
    strict_indices: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, d_index_q, d_weights, d_index_k)`` of the indexer KL loss from
    the tensors a DSA layer has: the indexer's ``index_q``, ``weights``,
    ``index_k``, the main attention's ``query``, latent ``kv`` and ``lse``, and
    the selected ``topk_indices``.

    :func:`attention_target` (normalised, with the main attention's
    ``softmax_scale`` and ``lse_base``), then :func:`indexer_kl_loss_and_grad`
    with the indexer's ``sm_scale`` on that target. Both run on the tensors'
    device without a host synchronisation (CUDA: on the current stream), and
    no (S_q, topk) tensor but the target exists. Arguments as those two
    functions take them. With tensor parallelism over the main attention's
    heads, call :func:`attention_target` with ``normalize=False`` per rank,
    all-reduce, normalise, and pass the result to :func:`indexer_kl_loss_and_grad`.
    Errors as those two functions raise them, except that a bad main-attention
    scale is named ``softmax_scale``. ``strict_indices=True`` checks the ids
    once, in :func:`attention_target` (a host read of the ids).
    """
    # Checked here so that an error names softmax_scale, not attention_target's sm_scale.
    softmax_scale = _finite_f32("softmax_scale", softmax_scale)
    attn_score = attention_target(query, kv, lse, topk_indices, sm_scale=softmax_scale, lse_base=lse_base,
                                  normalize=True, layout=layout, id_mode=id_mode, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_k=cu_seqlens_k, strict_indices=strict_indices)
    return indexer_kl_loss_and_grad(index_q, weights, index_k, topk_indices, attn_score, sm_scale=sm_scale,
                                    loss_coeff=loss_coeff, grad_loss=grad_loss,
                                    normalization_count=normalization_count, layout=layout, id_mode=id_mode,
                                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                    a_operand_precision=a_operand_precision)

# The context-parallel loss and backward (torch.distributed), defined in dsaib.distributed.
from .distributed import context_parallel_indexer_backward, context_parallel_indexer_kl_loss  # noqa: E402,F401
