"""The loss forward in torch: each slot's key row, the logits (one opaque op,
row-chunked), the softmax over the valid slots and the float64 forward of
float64 leaves (for finite-difference checks), with the library's validation
of what such a forward's backward will get.

The library computes the loss of every other input (dsaib::indexer_kl_forward);
this forward exists for float64 leaves, whose values it keeps unrounded, and
for dsaib.torch.index_scores (P alone).
"""

import math

import torch

from .. import _dsaib
from .._args import _f32_round, _float_or_inf, _normalization_count
from .._frameworks import _exported
from .convert import fp64, ids_int32, library_float_dtypes, library_view
from .ops import library_options

#: The clip of ``T`` and ``P`` in the loss: exp(-100).
EPS = math.exp(-100.0)


def validate(index_q, weights, index_k, topk_indices, attn_score, *, sm_scale, layout, id_mode, cu_seqlens_q,
             cu_seqlens_k, loss_coeff=1.0, normalization_count=0, backend=None, num_threads=0,
             strict_indices=False, any_integer_cu_seqlens=False, topk_logits=None):
    """The library's validation (dsaib::validate_indexer_kl_loss_inputs, one
    library call) of what the backward will get from a forward computed here,
    before it computes anything, so that a bad argument raises its
    TypeError/ValueError naming the argument, as the backward would.

    The tensors are shown as the loss converts them (library_view): bf16
    index_q/index_k, float32 (or bf16; CPU float64: float64) weights, int32
    topk_indices, float32 (CPU float64: float64) attn_score (absent: shaped
    like topk_indices), topk_logits (when given) as attn_score; index_score is
    the P computed here.
    any_integer_cu_seqlens (index_scores, which has no backward): cu_seqlens of
    any integer dtype on any device are shown as int32 on index_q's device.
    Only metadata is read, and for THD cu_seqlens (on a GPU: a copy to the host
    on the current stream, waited for); strict_indices: the ids themselves too.
    Not run while torch.compile traces (the library is not traceable; the
    backward op checks the same when it runs) nor for meta tensors.
    """
    if torch.compiler.is_compiling() or index_q.device.type not in ("cpu", "cuda"):
        return
    w_dtype, T_dtype = library_float_dtypes(weights, fp64(index_q.device, index_q, weights, index_k))
    if any_integer_cu_seqlens:
        cu_seqlens_q, cu_seqlens_k = (
            cu if cu is None or cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool
            else cu.to(device=index_q.device, dtype=torch.int32) for cu in (cu_seqlens_q, cu_seqlens_k))
    if attn_score is None:
        attn_score = torch.empty(topk_indices.shape[-1:], dtype=torch.float32, device=index_q.device).expand(
            topk_indices.shape)
    tensors = dict(index_q=library_view(index_q, torch.bfloat16), weights=library_view(weights, w_dtype),
                   index_k=library_view(index_k, torch.bfloat16),
                   topk_indices=(ids_int32(topk_indices, strict=True) if strict_indices
                                 else library_view(topk_indices, torch.int32)),
                   attn_score=library_view(attn_score, T_dtype), cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k)
    if topk_logits is not None:
        tensors["topk_logits"] = library_view(topk_logits, T_dtype)
    _library_validation(tensors, index_q.device, sm_scale=sm_scale, layout=layout, id_mode=id_mode,
                        loss_coeff=loss_coeff, normalization_count=normalization_count, backend=backend,
                        num_threads=num_threads, strict_indices=strict_indices)


def validate_topk(index_q, weights, index_k, topk, *, starts, ends, cu_seqlens_q, cu_seqlens_k, options):
    """The library's validation (dsaib::validate_indexer_topk_inputs, one
    library call, nothing computed or written) of what dsaib::indexer_topk
    will get: index_q and index_k shown as bf16, weights as float32 (or bf16),
    starts/ends as given (int32), for a selection of ``topk`` keys; ``options``
    the op's (layout, id_mode, order, causal_offset, strict_ranges,
    num_threads). Only metadata is read, and for THD cu_seqlens, with
    strict_ranges starts and ends (on a GPU: copies to the host on the current
    stream, waited for). Not run while torch.compile traces, nor for meta
    tensors."""
    if torch.compiler.is_compiling() or index_q.device.type not in ("cpu", "cuda"):
        return
    w_dtype = weights.dtype if weights.dtype in (torch.float32, torch.bfloat16) else torch.float32
    tensors = dict(index_q=library_view(index_q, torch.bfloat16), weights=library_view(weights, w_dtype),
                   index_k=library_view(index_k, torch.bfloat16), starts=starts, ends=ends,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    _dsaib.validate_indexer_topk_inputs(
        **_exported({n: t for n, t in tensors.items() if t is not None}), topk=int(topk),
        **library_options(index_q.device, None, **options))


def _library_validation(tensors, device, *, sm_scale, layout, id_mode, loss_coeff, normalization_count, backend,
                        num_threads, strict_indices):
    """One call of dsaib::validate_indexer_kl_loss_inputs on `tensors` (None ones left out)."""
    cuda = device.type == "cuda"
    _dsaib.validate_indexer_kl_loss_inputs(
        **_exported({n: t for n, t in tensors.items() if t is not None}), layout=layout, id_mode=id_mode,
        backend=backend if backend is not None else ("cuda" if cuda else "cpu"),
        sm_scale=_float_or_inf(sm_scale), loss_coeff=_float_or_inf(loss_coeff),
        normalization_count=_normalization_count(int(normalization_count)), num_threads=int(num_threads),
        stream=int(torch.cuda.current_stream(device).cuda_stream) if cuda else 0,
        strict_indices=bool(strict_indices))


def validate_as_given(index_q, weights, index_k, topk_indices, attn_score, index_score, *, sm_scale, layout, id_mode,
                      cu_seqlens_q, cu_seqlens_k, loss_coeff, normalization_count, row_lse=None,
                      row_target_mass=None):
    """The library's validation (one call, nothing computed or written) of
    what a backward call will pass it: the tensors as they are (index_k may be
    a stand-in of the right dtype and shape, one row broadcast), with
    index_score or the P-free row statistics. Only metadata is read, and for
    THD cu_seqlens (on a GPU: a copy to the host, waited for)."""
    if torch.compiler.is_compiling() or index_q.device.type not in ("cpu", "cuda"):
        return
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, index_score=index_score, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, row_lse=row_lse, row_target_mass=row_target_mass)
    _library_validation(tensors, index_q.device, sm_scale=sm_scale, layout=layout, id_mode=id_mode,
                        loss_coeff=loss_coeff, normalization_count=normalization_count, backend=None,
                        num_threads=0, strict_indices=False)


def key_rows(index_k, topk_indices, layout, id_mode, cu_seqlens_q, cu_seqlens_k):
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
LOGITS_CHUNK_ELEMENTS = 1 << 26


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
    chunk = max(1, LOGITS_CHUNK_ELEMENTS // max(1, topk * max(D, H)))
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


def logits(index_q, weights, index_k, rows, valid, sm_scale, dtype):
    """z (R, topk) in `dtype`, -inf at invalid slots (see _index_logits_op)."""
    return _index_logits_op(index_q, weights, index_k, rows, valid, float(sm_scale), dtype)


def softmax_valid(z):
    """Softmax over the finite entries of each row; rows with none give 0."""
    zmax = z.amax(dim=-1, keepdim=True)
    zmax = torch.where(torch.isfinite(zmax), zmax, torch.zeros_like(zmax))
    e = torch.exp(z - zmax)
    s = e.sum(dim=-1, keepdim=True)
    return e / torch.where(s > 0, s, torch.ones_like(s))


def float64_forward(index_q, weights, index_k, topk_indices, attn_score, sm_scale, loss_coeff,
                     normalization_count, layout, id_mode, cu_seqlens_q, cu_seqlens_k, topk_logits=None):
    """(loss, row_lse, row_target_mass) in float64 in torch, from the unrounded
    values: the forward of float64 inputs, for finite-difference checks.
    sm_scale and loss_coeff as the library applies them, rounded to float32:
    its backward rebuilds P with that sm_scale from row_lse, so the gradient
    is that of the loss returned here. topk_logits (the top-k's logits) stand
    in for the recomputed ones at the valid slots, as the library takes them:
    shaped like topk_indices (checked here too: torch.compile skips the
    library's validation), and a row whose valid logits have no softmax (all
    -inf, or a +inf one) is NaN, as the library's LSE of such a row."""
    sm_scale, loss_coeff = _f32_round(float(sm_scale)), _f32_round(float(loss_coeff))
    rows, valid = key_rows(index_k, topk_indices, layout, id_mode, cu_seqlens_q, cu_seqlens_k)
    z = logits(index_q, weights, index_k, rows, valid, sm_scale, torch.float64)
    if topk_logits is not None:
        if topk_logits.shape != topk_indices.shape:
            raise ValueError(f"topk_logits: expected shape {tuple(topk_indices.shape)} like topk_indices, got "
                             f"shape {tuple(topk_logits.shape)}")
        given = topk_logits.detach().reshape(z.shape).to(torch.float64) * sm_scale
        z = torch.where(valid, given, z)
        # exp(z - max z) over the valid slots is NaN where that max is infinite
        zmax = torch.where(valid, z, -math.inf).amax(dim=-1, keepdim=True)
        undefined = valid & valid.any(dim=-1, keepdim=True) & torch.isinf(zmax)
        z = torch.where(undefined, math.nan, z)
    P = softmax_valid(z)
    T = attn_score.reshape(P.shape).to(torch.float64).clamp_min(EPS)
    zero = torch.zeros_like(P)
    terms = torch.where(valid, T * torch.log(P.clamp_min(EPS)), zero)
    n = int(normalization_count) if normalization_count else P.shape[0]
    loss = -(float(loss_coeff) / max(n, 1)) * terms.sum()
    row_shape = topk_indices.shape[:-1]
    row_lse = torch.logsumexp(z, dim=-1).reshape(row_shape)  # -inf for a row without a valid slot
    row_target_mass = torch.where(valid & (P >= EPS), T, zero).sum(-1).reshape(row_shape)
    return loss, row_lse, row_target_mass
