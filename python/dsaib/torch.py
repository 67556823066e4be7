"""PyTorch integration of dsaib (needs torch; ``import dsaib`` alone never imports it).

* ``torch.ops.dsaib.indexer_backward``: a ``torch.library`` custom op with a
  fake (meta) kernel, so ``torch.compile(fullgraph=True)`` traces it and CUDA
  graphs capture it. CUDA tensors run the sm_90a kernel on the *current* torch
  stream; CPU tensors run the fp64 CPU backend. :func:`indexer_backward` is
  its Python front end.
* :func:`indexer_kl_loss`: the indexer KL (cross-entropy) loss computed in
  torch, differentiable w.r.t. ``index_q``, ``weights`` and ``index_k``. Its
  backward is the custom op, fed with the index scores ``P`` saved by the
  forward and with the upstream gradient from autograd as a device scalar.
* :class:`IndexerKLLoss`: the same as an ``nn.Module``.

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
bf16 (the forward computes the logits from the same rounded values, in float32),
and returns each gradient in the dtype of its input (the rounding is treated
as the identity, like ``.to(torch.bfloat16)`` under autograd). Float64 inputs
make the forward run in float64 on the unrounded values (for finite-difference
checks); the backward still sees them rounded to bf16 (q, k) and float32 (w).
"""
import math
from typing import Optional, Tuple

import torch

from . import (_INT64_MAX, _NORMALIZATION_COUNT_BELOW, _a_operand, _check_f32_finite, _cuda_workspace_bytes,
               _dsaib, _export, _float_or_inf)

__all__ = ["indexer_backward", "indexer_kl_loss", "IndexerKLLoss", "index_scores", "EPS"]

#: The clip of ``T`` and ``P`` in the loss: exp(-100).
EPS = math.exp(-100.0)

_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
_CODES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _out_dtype(name: str, code: str) -> torch.dtype:
    try:
        return _DTYPES[code]
    except KeyError:
        raise ValueError(f'{name}: expected "f32" or "bf16", got {code!r}') from None


_A_OPERAND = ("auto", "bf16x2", "bf16")


def _check_a_operand(word: str) -> str:
    """The fake kernel's copy of the extension's check (same message), so tracing rejects what running would.
    Plain Python on purpose: torch.compile (dynamo) traces it; a call into the extension would break the graph."""
    if word not in _A_OPERAND:
        raise ValueError(f'a_operand_precision: expected "auto", "bf16x2" or "bf16", got "{word}"')
    return word


# ---- the custom op ----------------------------------------------------------


@torch.library.custom_op("dsaib::indexer_backward", mutates_args=())
def _indexer_backward_op(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    attn_score: torch.Tensor,
    index_score: torch.Tensor,
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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = index_q.device
    dq = torch.empty(index_q.shape, dtype=_out_dtype("dq_dtype", dq_dtype), device=dev)
    dw = torch.empty(weights.shape, dtype=_out_dtype("dw_dtype", dw_dtype), device=dev)
    dk = torch.empty(index_k.shape, dtype=_out_dtype("dk_dtype", dk_dtype), device=dev)
    workspace = None
    stream = 0
    deterministic = False
    if dev.type == "cuda":
        backend = "cuda"
        stream = int(torch.cuda.current_stream(dev).cuda_stream)
        # torch.use_deterministic_algorithms: the fixed-point d_index_k (read when the op runs).
        deterministic = torch.are_deterministic_algorithms_enabled()
        nbytes = _cuda_workspace_bytes(index_k.numel(), dk.dtype == torch.bfloat16, deterministic)
        if nbytes:
            # The dK accumulator (indexer_backward_workspace_size), from torch's
            # allocator: stream-ordered, and from the graph pool under capture.
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    else:
        backend = "cpu"
    _dsaib.indexer_backward(
        _export(index_q), _export(weights), _export(index_k), _export(topk_indices), _export(attn_score),
        _export(index_score), _export(cu_seqlens_q), _export(cu_seqlens_k),
        _export(dq), _export(dw), _export(dk),
        layout, id_mode, backend, float(sm_scale), float(loss_coeff), 1.0, _export(grad_loss),
        int(normalization_count), False, deterministic, stream, 0, _export(workspace), False, False,
        a_operand_precision,
    )
    return dq, dw, dk


def _check_same_device(index_q, **tensors):
    """ValueError naming the first tensor (None skipped) not on index_q's device."""
    for name, t in tensors.items():
        if t is not None and t.device != index_q.device:
            raise ValueError(f"{name}: expected memory on device '{index_q.device}' (that of index_q), "
                             f"got device '{t.device}'")


@_indexer_backward_op.register_fake
def _indexer_backward_fake(index_q, weights, index_k, topk_indices, attn_score, index_score, grad_loss,
                           cu_seqlens_q, cu_seqlens_k, sm_scale, loss_coeff, normalization_count, layout,
                           id_mode, dq_dtype, dw_dtype, dk_dtype, a_operand_precision="auto"):
    # Contiguous outputs on index_q's device, like the real kernel's. This is
    # also the Meta kernel: a call that mixes meta tensors with real ones lands
    # here and must fail like the real kernels would, not return empty tensors.
    _check_a_operand(a_operand_precision)
    _check_same_device(index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                       attn_score=attn_score, index_score=index_score, grad_loss=grad_loss,
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return (
        index_q.new_empty(index_q.shape, dtype=_out_dtype("dq_dtype", dq_dtype)),
        index_q.new_empty(weights.shape, dtype=_out_dtype("dw_dtype", dw_dtype)),
        index_q.new_empty(index_k.shape, dtype=_out_dtype("dk_dtype", dk_dtype)),
    )


def indexer_backward(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    attn_score: torch.Tensor,
    index_score: torch.Tensor,
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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_index_q, d_weights, d_index_k)`` through ``torch.ops.dsaib.indexer_backward``.

    Same tensors, shapes and dtypes as :func:`dsaib.indexer_backward` (index_q
    and index_k ``torch.bfloat16``; weights bf16 or float32; topk_indices
    int32; attn_score and index_score float32), all on one device: CUDA tensors
    run the cuda backend on the current stream, CPU tensors the CPU backend.

    Args:
      grad_loss: a number, or a one-element float32 tensor on the tensors'
        device, read when the kernel runs (a captured CUDA graph sees the value
        it holds at replay).
      out_dtype: ``"f32"`` or ``"bf16"`` for all three outputs, or a tuple of
        three such codes (d_index_q, d_weights, d_index_k).
      a_operand_precision: CUDA only: ``"auto"`` (default), ``"bf16x2"`` or
        ``"bf16"``, the precision of the a operand of the dK/dQ GEMMs. One
        bf16 term (``"bf16"``) is ~30% faster at DeepSeek shapes and adds
        ~1.3-1.6e-3 relative RMS error to d_index_q/d_index_k; two terms
        (``"bf16x2"``) keep float32 outputs within 1e-3. ``"auto"`` takes two
        terms when d_index_q or d_index_k is float32. The CPU backend ignores
        it. See :func:`dsaib.indexer_backward`.

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
        _a_operand(a_operand_precision),
    )


# ---- the forward: logits, index scores, loss (plain torch) ------------------


def _binding_dtype_name(dtype: torch.dtype) -> str:
    """How the extension names a torch dtype in a dtype error: the library's codes
    ("dtype f32") for the dtypes the library has, the DLPack spelling otherwise."""
    special = {torch.float32: "dtype f32", torch.bfloat16: "dtype bf16", torch.bool: "bool8"}
    return special.get(dtype, str(dtype).replace("torch.", ""))


def _shape_str(shape) -> str:
    dims = tuple(int(d) for d in shape)
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def _check_forward_arguments(index_q, weights, index_k, topk_indices, attn_score, sm_scale, layout,
                             cu_seqlens_q, cu_seqlens_k, loss_coeff=1.0, normalization_count=0):
    """The checks of the C++ validation that the torch forward depends on, with its messages
    (attn_score None: not checked, for index_scores).

    Run before the forward computes anything (so _key_rows and _logits can
    take ranks and shapes as given), so that a bad shape raises ValueError
    naming the argument instead of failing inside torch. cu_seqlens values are
    checked here for cpu tensors in eager mode only (the rules of
    core/validate.cpp's check_cu_seqlens; no device sync, and nothing
    data-dependent for torch.compile to trace); for the loss (attn_score given)
    also the cu_seqlens dtype and device, which its backward needs. The rest
    (strides, GPU cu_seqlens values, ...) is validated by the library in the
    backward.
    """
    def fail(name, expected, got):
        raise ValueError(f"{name}: expected {expected}, got {got}")

    loss = attn_score is not None  # index_scores (no backward) takes any integer cu_seqlens on any device

    names = ("index_q", "weights", "index_k", "topk_indices", "attn_score")[: 5 if loss else 4]
    tensors = (index_q, weights, index_k, topk_indices, attn_score)[: len(names)]
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    # One device for every tensor (torch mixes meta with cpu tensors without an
    # error, and the forward would then compute from uninitialised memory).
    _check_same_device(index_q, **dict(zip(names[1:], tensors[1:])))
    if layout not in ("bshd", "thd"):
        fail("layout", '"bshd" or "thd"', f'"{layout}"')
    thd = layout == "thd"
    r = 1 if thd else 0
    # Per tensor, in the library's order: the dtype, then the rank.
    for name, t, rank in zip(names, tensors, (4 - r, 3 - r, 3 - r, 3 - r, 3 - r)):
        if name == "topk_indices" and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise TypeError(f"topk_indices: expected an integer dtype, got {t.dtype}")
        if name == "attn_score" and not t.is_floating_point():
            raise TypeError(f"attn_score: expected a floating-point dtype, got {t.dtype}")
        if t.dim() != rank:
            fail(name, f"rank {rank}", f"rank {t.dim()} with shape {_shape_str(t.shape)}")
    H, D = index_q.shape[-2], index_q.shape[-1]
    if H < 8 or H > 128 or H % 8 != 0:
        fail("index_q", f"H (heads, dim {2 - r}) a multiple of 8 in [8, 128]", f"H = {H} (shape {_shape_str(index_q.shape)})")
    if D not in (64, 128):
        fail("index_q", "D (last dim) 64 or 128", f"D = {D} (shape {_shape_str(index_q.shape)})")
    K = topk_indices.shape[-1]
    if K < 1:
        fail("topk_indices", "topk (last dim) >= 1", f"topk = {K}")

    def expect(name, t, shape, meaning):
        if tuple(t.shape) != tuple(shape):
            fail(name, f"shape {_shape_str(shape)} {meaning}", f"shape {_shape_str(t.shape)}")

    if thd:
        T, Tk = index_q.shape[0], index_k.shape[0]
        expect("weights", weights, (T, H), "(T_q, H)")
        expect("index_k", index_k, (Tk, D), "(T_k, D)")
        expect("topk_indices", topk_indices, (T, K), "(T_q, topk)")
        if loss:
            expect("attn_score", attn_score, (T, K), "(T_q, topk), topk from topk_indices")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu is None:
                fail(name, "a tensor", "nothing (absent)")
            if not isinstance(cu, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(cu).__name__}")
            if loss and cu.dtype != torch.int32:  # what the backward would raise, before the forward
                raise TypeError(f"{name}: expected dtype i32, got {_binding_dtype_name(cu.dtype)}")
            if loss:
                _check_same_device(index_q, **{name: cu})
            if cu.dim() != 1:
                fail(name, "rank 1", f"rank {cu.dim()} with shape {_shape_str(cu.shape)}")
        nq, nk = cu_seqlens_q.shape[0], cu_seqlens_k.shape[0]
        if nq < 1:
            fail("cu_seqlens_q", "length B + 1 >= 1", "length 0")
        if nk != nq:
            fail("cu_seqlens_k", f"length B + 1 = {nq} (that of cu_seqlens_q)", f"length {nk}")
        # Values: read here only for cpu tensors (no device sync); on a GPU the
        # forward stays in bounds (_key_rows) and the backward's library check raises.
        for name, cu, total, what in (("cu_seqlens_q", cu_seqlens_q, T, "T_q (index_q dim 0)"),
                                      ("cu_seqlens_k", cu_seqlens_k, Tk, "T_k (index_k dim 0)")):
            if cu.device.type != "cpu" or cu.is_floating_point() or torch.compiler.is_compiling():
                continue  # compiled: not traceable (data-dependent); the backward's library check raises
            v = [int(x) for x in cu.tolist()]
            if v[0] != 0:
                fail(name, "cu_seqlens starting at 0", f"first value {v[0]}")
            for i in range(1, len(v)):
                if v[i] < v[i - 1]:
                    fail(name, "non-decreasing values", f"value {v[i]} at position {i} after {v[i - 1]}")
            if v[-1] != total:
                fail(name, f"last value equal to {what} = {total}", str(v[-1]))
    else:
        B, S = index_q.shape[0], index_q.shape[1]
        expect("weights", weights, (B, S, H), "(B, S_q, H)")
        expect("index_k", index_k, (B, index_k.shape[1], D), "(B, S_kv, D) with B and D of index_q")
        expect("topk_indices", topk_indices, (B, S, K), "(B, S_q, topk)")
        if loss:
            expect("attn_score", attn_score, (B, S, K), "(B, S_q, topk), topk from topk_indices")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu is not None:
                fail(name, "absent for layout bshd", "a tensor")
    for name, x in (("sm_scale", sm_scale), ("loss_coeff", loss_coeff)):
        _check_f32_finite(name, _float_or_inf(x))  # the library's precision: 1e39 -> inf
    n = int(normalization_count)  # as the loss converts it
    if n < 0:
        fail("normalization_count", _NORMALIZATION_COUNT_BELOW, str(n))
    if n > _INT64_MAX:
        fail("normalization_count", "an int in [0, 2^63-1]", str(n))


def _key_rows(index_k, topk_indices, layout, id_mode, cu_seqlens_q, cu_seqlens_k):
    """Flat key row of every slot ((R, topk) int64, 0 at invalid slots) and the valid mask."""
    ids = topk_indices.to(torch.int64)
    dev = ids.device
    if layout == "bshd":
        B, S_kv = ids.shape[0], index_k.shape[1]
        start = (torch.arange(B, device=dev, dtype=torch.int64) * S_kv).view(B, 1, 1)
        length = torch.full_like(start, S_kv)
    else:  # "thd" (_check_forward_arguments checked the layout before every call)
        cu_q = cu_seqlens_q.to(device=dev, dtype=torch.int64)
        cu_k = cu_seqlens_k.to(device=dev, dtype=torch.int64)
        n_seq = cu_q.numel() - 1
        rows_q = torch.arange(ids.shape[0], device=dev, dtype=torch.int64)
        seq = torch.searchsorted(cu_q[1:].contiguous(), rows_q, right=True).clamp(0, max(n_seq - 1, 0))
        seq_end = (seq + 1).clamp(max=cu_k.numel() - 1)  # in bounds for any cu_seqlens (checked elsewhere)
        start = cu_k[seq].unsqueeze(1)
        length = (cu_k[seq_end] - cu_k[seq]).unsqueeze(1)
    if id_mode == "local":
        valid = (ids >= 0) & (ids < length)
        rows = ids + start
    elif id_mode == "global":
        valid = (ids >= start) & (ids < start + length)
        rows = ids
    else:
        raise ValueError(f'id_mode: expected "local" or "global", got "{id_mode}"')
    # In bounds even for cu_seqlens the library will reject in the backward
    # (values are not read to the host here for GPU tensors).
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
    """
    _check_forward_arguments(index_q, weights, index_k, topk_indices, None, sm_scale, layout,
                             cu_seqlens_q, cu_seqlens_k)
    with torch.no_grad():
        rows, valid = _key_rows(index_k, topk_indices, layout, id_mode, cu_seqlens_q, cu_seqlens_k)
        z = _logits(index_q, weights, index_k, rows, valid, sm_scale, dtype)
        return _softmax_valid(z).reshape(topk_indices.shape)


class _IndexerKLLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, index_q, weights, index_k, topk_indices, attn_score, sm_scale, loss_coeff,
                normalization_count, layout, id_mode, cu_seqlens_q, cu_seqlens_k, a_operand_precision):
        f64 = any(t.dtype == torch.float64 for t in (index_q, weights, index_k))
        cdt = torch.float64 if f64 else torch.float32
        q16 = index_q.to(torch.bfloat16).contiguous()
        k16 = index_k.to(torch.bfloat16).contiguous()
        w_op = (weights if weights.dtype in (torch.bfloat16, torch.float32) else weights.to(torch.float32)).contiguous()
        rows, valid = _key_rows(index_k, topk_indices, layout, id_mode, cu_seqlens_q, cu_seqlens_k)
        # The logits from the values the backward sees (bf16 q/k), except in
        # float64 mode, where the forward is exact in the given values.
        z = _logits(index_q if f64 else q16, weights, index_k if f64 else k16, rows, valid, sm_scale, cdt)
        P = _softmax_valid(z)
        T = attn_score.reshape(P.shape).to(cdt)
        terms = T.clamp_min(EPS) * torch.log(P.clamp_min(EPS))
        n = int(normalization_count) if normalization_count else P.shape[0]
        loss = -(float(loss_coeff) / max(n, 1)) * torch.where(valid, terms, torch.zeros_like(terms)).sum()

        ids32 = topk_indices.to(torch.int32).contiguous()
        ctx.save_for_backward(q16, w_op, k16, ids32, attn_score.to(torch.float32).contiguous(),
                              P.to(torch.float32).reshape(topk_indices.shape).contiguous(),
                              cu_seqlens_q, cu_seqlens_k)
        ctx.in_dtypes = (index_q.dtype, weights.dtype, index_k.dtype)
        ctx.options = (float(sm_scale), float(loss_coeff), int(normalization_count), layout, id_mode,
                       a_operand_precision)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        q16, w_op, k16, ids32, T32, P32, cu_q, cu_k = ctx.saved_tensors
        sm_scale, loss_coeff, normalization_count, layout, id_mode, a_operand_precision = ctx.options
        q_dt, w_dt, k_dt = ctx.in_dtypes
        # Outputs straight in the input dtype when the library can write it.
        codes = tuple(_CODES.get(dt, "f32") for dt in (q_dt, w_dt, k_dt))
        g = grad_loss.detach().reshape(()).to(torch.float32)
        dq, dw, dk = torch.ops.dsaib.indexer_backward(
            q16, w_op, k16, ids32, T32, P32, g, cu_q, cu_k, sm_scale, loss_coeff, normalization_count,
            layout, id_mode, *codes, a_operand_precision,
        )
        need = ctx.needs_input_grad
        return (
            dq.to(q_dt) if need[0] else None,
            dw.to(w_dt) if need[1] else None,
            dk.to(k_dt) if need[2] else None,
            None, None, None, None, None, None, None, None, None, None,
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
) -> torch.Tensor:
    """The indexer KL loss, a 0-dim tensor; its backward runs ``torch.ops.dsaib.indexer_backward``.

    ============  ======================  ===========================================
    argument      BSHD shape (THD)        dtype
    ============  ======================  ===========================================
    index_q       (B, S_q, H, D)          bf16 (float32/float64 are rounded to bf16)
                  ((T_q, H, D))
    weights       (B, S_q, H) ((T_q, H))  bf16 or float32 (float64 -> float32)
    index_k       (B, S_kv, D) ((T_k, D)) bf16 (float32/float64 are rounded to bf16)
    topk_indices  (B, S_q, topk)          integer; -1 or out of range: invalid slot
    attn_score    (B, S_q, topk)          float; the target distribution T
    ============  ======================  ===========================================

    H a multiple of 8 in [8, 128], D 64 or 128. The forward computes the logits
    and ``P`` (float32; float64 for float64 inputs) and saves ``P`` for the
    backward, which gets ``grad_loss`` from autograd as a device tensor (CUDA
    graphs can replay it with new values). Gradients come back in the dtypes of
    index_q, weights and index_k.

    Raises, before computing anything: ValueError for tensors on different
    devices, a shape, rank, H, D or topk the library does not take, an
    ``sm_scale`` or ``loss_coeff`` not finite as float32, a
    ``normalization_count`` outside [0, 2^63-1], a bad ``layout``,
    missing/extra cu_seqlens, cu_seqlens of the wrong length and, for cpu
    tensors in eager mode, cu_seqlens values (the C++ library's messages);
    TypeError for a non-tensor argument, non-integer ``topk_indices``,
    non-float ``attn_score`` or cu_seqlens that are not int32. The library
    validates everything else (strides, GPU cu_seqlens values, ...) in the
    backward, where its errors surface as ValueError/TypeError when
    ``backward()`` runs.

    ``a_operand_precision`` (``"auto"``, ``"bf16x2"`` or ``"bf16"``) goes to
    the backward's op (see :func:`indexer_backward`): ``"auto"`` uses two bf16
    terms for float32 gradients of index_q/index_k (float32/float64 leaves)
    and one for bf16 leaves; ``"bf16"`` is ~30% faster and adds ~1.3-1.6e-3
    relative RMS error to those gradients. A bad value is a ValueError here.
    """
    _check_a_operand(_a_operand(a_operand_precision))
    _check_forward_arguments(index_q, weights, index_k, topk_indices, attn_score, sm_scale, layout,
                             cu_seqlens_q, cu_seqlens_k, loss_coeff, normalization_count)
    return _IndexerKLLossFunction.apply(
        index_q, weights, index_k, topk_indices, attn_score, float(sm_scale), float(loss_coeff),
        int(normalization_count), layout, id_mode, cu_seqlens_q, cu_seqlens_k, a_operand_precision,
    )


class IndexerKLLoss(torch.nn.Module):
    """:func:`indexer_kl_loss` as a module: ``IndexerKLLoss(sm_scale=D**-0.5)(q, w, k, ids, T)``.

    ``a_operand_precision`` (``"auto"``, ``"bf16x2"``, ``"bf16"``) is passed to the backward.
    """

    def __init__(self, sm_scale: float, loss_coeff: float = 1.0, normalization_count: int = 0,
                 layout: str = "bshd", id_mode: str = "local", a_operand_precision: str = "auto"):
        super().__init__()
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
            a_operand_precision=self.a_operand_precision,
        )

    def extra_repr(self) -> str:
        return (f"sm_scale={self.sm_scale}, loss_coeff={self.loss_coeff}, "
                f"normalization_count={self.normalization_count}, layout={self.layout}, id_mode={self.id_mode}, "
                f"a_operand_precision={self.a_operand_precision}")
