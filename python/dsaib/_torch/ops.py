"""The torch.library custom ops over the library's entry points, with their
fake kernels: torch.ops.dsaib.indexer_backward, indexer_kl_forward,
indexer_kl_loss_and_grad, attention_target and indexer_topk; and
torch.ops.dsaib.scale_gradient, the extension's own kernel that the autograd
losses' backward runs on the gradients their forward formed.

Each op makes one library call on index_q's device: CUDA tensors on the
current stream, CPU tensors on the fp64 cpu backend. The library validates the
arguments once, then (on CUDA) asks for its workspace, which comes from
torch's caching allocator (stream-ordered; a CUDA graph's pool while one is
captured). The arguments with defaults come last, so a call may leave any
of them out. The fake kernels
give torch.compile the outputs' shapes and check what can be checked without
memory: the option words (from the option table, with the library's messages)
and the devices.
"""

import math
from typing import List, Optional, Tuple

import torch

from .. import _dsaib
from .._frameworks import _export, _exported
from .._options import OPTIONS, check_each
from .convert import CODES, check_same_device, out_dtype


def torch_allocator(dev: torch.device):
    """The workspace allocator the extension hands the library: nbytes -> a
    uint8 tensor from torch's caching allocator on the current stream (a CUDA
    graph's pool while one is captured), exported without synchronisation."""
    def allocate(nbytes):
        return _export(torch.empty(nbytes, dtype=torch.uint8, device=dev))
    return allocate


def run_library(entry, dev: torch.device, tensors: dict, options: dict) -> None:
    """entry(**tensors, **options): one library call; on CUDA its workspace from
    torch's caching allocator, asked by the library after validation."""
    entry(**_exported(tensors), **options, workspace=torch_allocator(dev) if dev.type == "cuda" else None)


def library_options(dev, backend, **options) -> dict:
    """The library's options for an op on `dev`: the backend (None: that of the
    device), the current stream on CUDA, and for the indexer's entry points the
    deterministic mode also under torch.use_deterministic_algorithms (read when
    the op runs: eager, compiled, or at capture, whose replays keep it)."""
    cuda = dev.type == "cuda"
    options["backend"] = backend if backend is not None else ("cuda" if cuda else "cpu")
    options["stream"] = int(torch.cuda.current_stream(dev).cuda_stream) if cuda else 0
    if "deterministic" in options:
        options["deterministic"] = bool(options["deterministic"]) or (
            cuda and torch.are_deterministic_algorithms_enabled())
    return options


def check_words(**words) -> None:
    """The option words a fake kernel can check (the library's messages)."""
    for name, word in words.items():
        OPTIONS[name].check(word)


def gradients_like(index_q, weights, index_k, dq_dtype, dw_dtype, dk_dtype):
    """New contiguous d_index_q, d_weights, d_index_k on index_q's device, of the codes' dtypes."""
    return (index_q.new_empty(index_q.shape, dtype=out_dtype("dq_dtype", dq_dtype)),
            index_q.new_empty(weights.shape, dtype=out_dtype("dw_dtype", dw_dtype)),
            index_q.new_empty(index_k.shape, dtype=out_dtype("dk_dtype", dk_dtype)))


# ---- dsaib::indexer_backward --------------------------------------------------


@torch.library.custom_op("dsaib::indexer_backward", mutates_args=())
def indexer_backward_op(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, topk_indices: torch.Tensor,
    attn_score: torch.Tensor, index_score: Optional[torch.Tensor], grad_loss: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], sm_scale: float, loss_coeff: float,
    normalization_count: int, layout: str, id_mode: str, dq_dtype: str, dw_dtype: str, dk_dtype: str,
    a_operand_precision: str = "auto", row_lse: Optional[torch.Tensor] = None,
    row_target_mass: Optional[torch.Tensor] = None, l2_hints: str = "auto", start_stagger: str = "auto",
    strict_indices: bool = False, deterministic: bool = False, num_threads: int = 0, backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = index_q.device
    dq, dw, dk = gradients_like(index_q, weights, index_k, dq_dtype, dw_dtype, dk_dtype)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, index_score=index_score, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, d_index_q=dq, d_weights=dw, d_index_k=dk, grad_loss_device=grad_loss,
                   row_lse=row_lse, row_target_mass=row_target_mass)
    options = library_options(
        dev, backend, layout=layout, id_mode=id_mode, sm_scale=float(sm_scale), loss_coeff=float(loss_coeff),
        normalization_count=int(normalization_count), strict_indices=bool(strict_indices),
        deterministic=deterministic, num_threads=int(num_threads), a_operand_precision=a_operand_precision,
        l2_hints=l2_hints, start_stagger=start_stagger)
    run_library(_dsaib.indexer_backward, dev, tensors, options)
    return dq, dw, dk


@indexer_backward_op.register_fake
def _indexer_backward_fake(index_q, weights, index_k, topk_indices, attn_score, index_score, grad_loss,
                           cu_seqlens_q, cu_seqlens_k, sm_scale, loss_coeff, normalization_count, layout,
                           id_mode, dq_dtype, dw_dtype, dk_dtype, a_operand_precision="auto", row_lse=None,
                           row_target_mass=None, l2_hints="auto", start_stagger="auto", strict_indices=False,
                           deterministic=False, num_threads=0, backend=None):
    # Contiguous outputs on index_q's device, like the real kernel's. This is
    # also the Meta kernel: a call that mixes meta tensors with real ones lands
    # here and must fail like the real kernels would, not return empty tensors.
    check_words(a_operand_precision=a_operand_precision, l2_hints=l2_hints, start_stagger=start_stagger,
                backend=backend)
    check_same_device(index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                      attn_score=attn_score, index_score=index_score, grad_loss=grad_loss,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, row_lse=row_lse,
                      row_target_mass=row_target_mass)
    return gradients_like(index_q, weights, index_k, dq_dtype, dw_dtype, dk_dtype)


# ---- dsaib::indexer_kl_forward ------------------------------------------------


def _forward_outputs(index_q, topk_indices, return_index_score):
    """loss (), row_lse and row_target_mass (topk_indices' shape without topk) and
    index_score (topk_indices' shape, or (0,) when not asked for), float32."""
    rows = topk_indices.shape[:-1]
    score = topk_indices.shape if return_index_score else (0,)
    return (index_q.new_empty((), dtype=torch.float32), index_q.new_empty(rows, dtype=torch.float32),
            index_q.new_empty(rows, dtype=torch.float32), index_q.new_empty(score, dtype=torch.float32))


# A functional op (no mutated argument): P is an output, empty unless asked
# for. An Optional mutated argument breaks torch releases whose in-place
# bookkeeping indexes the mutated argument in the dispatcher's argument tuple,
# which drops trailing arguments left at their defaults.
@torch.library.custom_op("dsaib::indexer_kl_forward", mutates_args=())
def indexer_kl_forward_op(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, topk_indices: torch.Tensor,
    attn_score: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    sm_scale: float, loss_coeff: float, normalization_count: int, layout: str, id_mode: str,
    strict_indices: bool = False, num_threads: int = 0, backend: Optional[str] = None,
    return_index_score: bool = False, topk_logits: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, row_lse, row_target_mass, index_score), float32, through
    dsaib::indexer_kl_forward. index_score is P (shaped like topk_indices) with
    return_index_score, else empty (0,): the backward rebuilds P from the row
    statistics. topk_logits: the selected keys' logits as indexer_topk writes
    them, taken instead of recomputing them."""
    dev = index_q.device
    loss, row_lse, row_target_mass, index_score = _forward_outputs(index_q, topk_indices, return_index_score)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, loss=loss,
                   row_lse=row_lse, row_target_mass=row_target_mass,
                   index_score=index_score if return_index_score else None, topk_logits=topk_logits)
    options = library_options(dev, backend, layout=layout, id_mode=id_mode, sm_scale=float(sm_scale),
                              loss_coeff=float(loss_coeff), normalization_count=int(normalization_count),
                              strict_indices=bool(strict_indices), num_threads=int(num_threads))
    run_library(_dsaib.indexer_kl_forward, dev, tensors, options)
    return loss, row_lse, row_target_mass, index_score


@indexer_kl_forward_op.register_fake
def _indexer_kl_forward_fake(index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k,
                             sm_scale, loss_coeff, normalization_count, layout, id_mode, strict_indices=False,
                             num_threads=0, backend=None, return_index_score=False, topk_logits=None):
    check_words(backend=backend)
    check_same_device(index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                      attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      topk_logits=topk_logits)
    return _forward_outputs(index_q, topk_indices, return_index_score)


# ---- dsaib::indexer_kl_loss_and_grad -------------------------------------------


@torch.library.custom_op("dsaib::indexer_kl_loss_and_grad", mutates_args=())
def indexer_kl_loss_and_grad_op(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, topk_indices: torch.Tensor,
    attn_score: torch.Tensor, grad_loss: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor], sm_scale: float, loss_coeff: float, normalization_count: int,
    layout: str, id_mode: str, dq_dtype: str, dw_dtype: str, dk_dtype: str, a_operand_precision: str = "auto",
    loss_dtype: str = "f32", strict_indices: bool = False, l2_hints: str = "auto", start_stagger: str = "auto",
    deterministic: bool = False, num_threads: int = 0, backend: Optional[str] = None, forward_fusion: str = "auto",
    topk_logits: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d_index_q, d_weights, d_index_k) through dsaib::indexer_kl_loss_and_grad;
    topk_logits as for indexer_kl_forward."""
    dev = index_q.device
    loss = index_q.new_empty((), dtype=out_dtype("loss_dtype", loss_dtype))
    dq, dw, dk = gradients_like(index_q, weights, index_k, dq_dtype, dw_dtype, dk_dtype)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, loss=loss,
                   d_index_q=dq, d_weights=dw, d_index_k=dk, grad_loss_device=grad_loss, topk_logits=topk_logits)
    options = library_options(
        dev, backend, layout=layout, id_mode=id_mode, sm_scale=float(sm_scale), loss_coeff=float(loss_coeff),
        normalization_count=int(normalization_count), strict_indices=bool(strict_indices),
        deterministic=deterministic, num_threads=int(num_threads), a_operand_precision=a_operand_precision,
        l2_hints=l2_hints, start_stagger=start_stagger, forward_fusion=forward_fusion)
    run_library(_dsaib.indexer_kl_loss_and_grad, dev, tensors, options)
    return loss, dq, dw, dk


@indexer_kl_loss_and_grad_op.register_fake
def _indexer_kl_loss_and_grad_fake(index_q, weights, index_k, topk_indices, attn_score, grad_loss, cu_seqlens_q,
                                   cu_seqlens_k, sm_scale, loss_coeff, normalization_count, layout, id_mode,
                                   dq_dtype, dw_dtype, dk_dtype, a_operand_precision="auto", loss_dtype="f32",
                                   strict_indices=False, l2_hints="auto", start_stagger="auto",
                                   deterministic=False, num_threads=0, backend=None, forward_fusion="auto",
                                   topk_logits=None):
    check_words(a_operand_precision=a_operand_precision, l2_hints=l2_hints, start_stagger=start_stagger,
                backend=backend, forward_fusion=forward_fusion)
    check_same_device(index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                      attn_score=attn_score, grad_loss=grad_loss, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, topk_logits=topk_logits)
    return (index_q.new_empty((), dtype=out_dtype("loss_dtype", loss_dtype)),
            *gradients_like(index_q, weights, index_k, dq_dtype, dw_dtype, dk_dtype))


# ---- dsaib::attention_target ---------------------------------------------------


@torch.library.custom_op("dsaib::attention_target", mutates_args=())
def attention_target_op(
    query: torch.Tensor, kv: torch.Tensor, lse: Optional[torch.Tensor], topk_indices: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], sm_scale: float, lse_base: str,
    normalize: bool, layout: str, id_mode: str, strict_indices: bool = False, num_threads: int = 0,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """attn_score (float32, shaped like topk_indices) through dsaib::attention_target (lse None: each
    head's lse over the row's selected keys, computed by the library)."""
    dev = query.device
    attn_score = query.new_empty(topk_indices.shape, dtype=torch.float32)
    tensors = dict(query=query, kv=kv, lse=lse, topk_indices=topk_indices, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, attn_score=attn_score)
    options = library_options(dev, backend, layout=layout, id_mode=id_mode, sm_scale=float(sm_scale),
                              lse_base=lse_base, normalize=bool(normalize), strict_indices=bool(strict_indices),
                              num_threads=int(num_threads))
    run_library(_dsaib.attention_target, dev, tensors, options)
    return attn_score


@attention_target_op.register_fake
def _attention_target_fake(query, kv, lse, topk_indices, cu_seqlens_q, cu_seqlens_k, sm_scale, lse_base, normalize,
                           layout, id_mode, strict_indices=False, num_threads=0, backend=None):
    check_words(lse_base=lse_base, backend=backend)
    check_same_device(query, kv=kv, lse=lse, topk_indices=topk_indices, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k)
    return query.new_empty(topk_indices.shape, dtype=torch.float32)


# ---- dsaib::indexer_topk --------------------------------------------------------


def _topk_outputs(index_q, topk, with_logits, with_lengths):
    """(topk_indices int32, topk_logits float32, topk_lengths int32), contiguous on
    index_q's device; an output not asked for is an empty (0,) tensor (an op
    returns tensors, never None)."""
    rows = index_q.shape[:-2]
    try:
        ids = index_q.new_empty((*rows, topk), dtype=torch.int32)
        logits = index_q.new_empty((*rows, topk) if with_logits else (0,), dtype=torch.float32)
        lengths = index_q.new_empty(rows if with_lengths else (0,), dtype=torch.int32)
    except RuntimeError as e:  # torch's allocators (torch.OutOfMemoryError is one)
        count = math.prod(rows)
        nbytes = 4 * count * (topk * (2 if with_logits else 1) + (1 if with_lengths else 0))
        raise MemoryError(f"topk: expected outputs that fit in memory on {index_q.device}, got topk {topk}: "
                          f"{count} query rows need {nbytes} bytes of outputs, which could not be allocated "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return ids, logits, lengths


@torch.library.custom_op("dsaib::indexer_topk", mutates_args=())
def indexer_topk_op(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, topk: int,
    starts: Optional[torch.Tensor], ends: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor], layout: str, id_mode: str, order: str = "logit_descending",
    causal_offset: Optional[int] = None, strict_ranges: bool = False, with_logits: bool = False,
    with_lengths: bool = False, num_threads: int = 0, backend: Optional[str] = None,
    index_q_scale: Optional[torch.Tensor] = None, index_k_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topk_indices, topk_logits, topk_lengths) through dsaib::indexer_topk;
    topk_logits and topk_lengths are empty (0,) tensors unless asked for.
    index_q_scale / index_k_scale: the scales of float8_e4m3fn index_q and index_k."""
    dev = index_q.device
    # The op's own integers by the option table's rules, before its outputs
    # are sized (the library never sees topk: it is the outputs' width).
    check_each(topk=topk, causal_offset=causal_offset, num_threads=num_threads)
    ids, logits, lengths = _topk_outputs(index_q, int(topk), with_logits, with_lengths)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, starts=starts, ends=ends,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, topk_indices=ids,
                   topk_logits=logits if with_logits else None, topk_lengths=lengths if with_lengths else None,
                   index_q_scale=index_q_scale, index_k_scale=index_k_scale)
    options = library_options(dev, backend, layout=layout, id_mode=id_mode, order=order,
                              strict_ranges=bool(strict_ranges), num_threads=int(num_threads))
    if causal_offset is not None:
        options["causal_offset"] = int(causal_offset)
    run_library(_dsaib.indexer_topk, dev, tensors, options)
    return ids, logits, lengths


@indexer_topk_op.register_fake
def _indexer_topk_fake(index_q, weights, index_k, topk, starts, ends, cu_seqlens_q, cu_seqlens_k, layout, id_mode,
                       order="logit_descending", causal_offset=None, strict_ranges=False, with_logits=False,
                       with_lengths=False, num_threads=0, backend=None, index_q_scale=None, index_k_scale=None):
    check_words(layout=layout, id_mode=id_mode, order=order, backend=backend)
    check_each(topk=topk, causal_offset=causal_offset, num_threads=num_threads)
    check_same_device(index_q, weights=weights, index_k=index_k, starts=starts, ends=ends,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, index_q_scale=index_q_scale,
                      index_k_scale=index_k_scale)
    return _topk_outputs(index_q, topk, with_logits, with_lengths)


#: The ops' names, for tests and docs.
OPS: List[str] = ["indexer_backward", "indexer_kl_forward", "indexer_kl_loss_and_grad", "attention_target",
                  "indexer_topk"]


# Read once: torch.compile traces the backwards that test it.
_SCALE_ON_CUDA = bool(_dsaib.cuda_compiled())


@torch.library.custom_op("dsaib::scale_gradient", mutates_args=())
def scale_gradient_op(gradient: torch.Tensor, grad_loss: torch.Tensor, out_code: str) -> torch.Tensor:
    """gradient * grad_loss, the product in float32 rounded once to out_code's
    dtype ("bf16" or "f32"), on gradient's CUDA device and the current stream;
    grad_loss (one float32 there) is read when the kernel runs. The kernel reads
    contiguous 16-byte-aligned data; other layouts take torch's multiply, which
    gives the same values. The layout is looked at here, not by the caller:
    torch.compile traces the caller, and a tensor's storage offset is not traceable."""
    out = torch.empty(gradient.shape, dtype=out_dtype("out_code", out_code), device=gradient.device)
    if not (gradient.is_contiguous() and gradient.data_ptr() % 16 == 0):
        return torch.mul(gradient, _factor_for(gradient, grad_loss), out=out)
    stream = int(torch.cuda.current_stream(gradient.device).cuda_stream)
    _dsaib.scale_gradient(_export(gradient), _export(out), _export(grad_loss), stream)
    return out


@scale_gradient_op.register_fake
def _scale_gradient_fake(gradient, grad_loss, out_code):
    return gradient.new_empty(gradient.shape, dtype=out_dtype("out_code", out_code))


def scaled_gradient(d, g, dtype):
    """A held gradient (or None) times the factor g (a float32 0-dim tensor on
    d's device), in float32 and rounded once to dtype, in one pass over d.
    CUDA bf16/float32 gradients go through the extension's op (its kernel at
    the copy rate for the contiguous ones the library writes); the rest through
    torch.mul with g as a 1-element 1-dim tensor: a 0-dim tensor takes no part
    in type promotion against a tensor with dimensions, so a bf16 multiply would
    round g to bf16 first, where a 1-dim float32 one makes the computation
    float32 and the output's dtype rounds the product once (a 0-dim d takes g
    0-dim, the same rule)."""
    if d is None:
        return None
    if d.device.type == "cuda" and d.dtype in CODES and dtype in CODES and _SCALE_ON_CUDA:
        return torch.ops.dsaib.scale_gradient(d, g.reshape(1), CODES[dtype])
    return torch.mul(d, _factor_for(d, g), out=torch.empty_like(d, dtype=dtype))


def _factor_for(d, g):
    """The one-element factor g shaped to share d's type-promotion category
    (1-dim for a d with dimensions, 0-dim for a 0-dim d), so that the multiply
    computes in float32 and keeps d's shape."""
    return g.reshape(1) if d.dim() else g.reshape(())
