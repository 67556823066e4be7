"""dsaib: backward of the DeepSeek Sparse Attention lightning indexer.

The one entry point is :func:`indexer_backward`, a plain function over
DLPack-capable tensors (numpy arrays on the CPU backend; torch tensors when
torch is installed). It returns the three gradients ``(d_index_q, d_weights,
d_index_k)`` of the indexer KL loss described in ``docs/math.md``.

bf16 inputs
-----------
numpy has no bfloat16. Two ways to pass bf16 data:

* torch: pass ``torch.bfloat16`` tensors (they travel through DLPack).
* numpy: pass ``uint16`` arrays holding the bf16 bit patterns *and*
  ``uint16_as_bf16=True`` (without the flag a uint16 array is a TypeError).
  :func:`bf16_bits` and :func:`bf16_to_f32` convert between float32 and such
  bit patterns (round to nearest even).

Errors
------
The C++ library's errors surface with the C++ message unchanged:

* ``TypeError``: a dtype the library does not take for that argument.
* ``ValueError``: wrong rank/shape/stride/device, bad option values, bad
  cu_seqlens, overlapping outputs, and (``strict_indices=True``) an invalid
  topk id.
* ``RuntimeError``: the cuda backend is unavailable (e.g. a CPU-only build),
  ``deterministic=True`` on cuda, CUDA failures.
"""

from __future__ import annotations

import numpy as _np

from . import _dsaib

__all__ = [
    "indexer_backward",
    "indexer_kl_loss",
    "cuda_backend_available",
    "bf16_bits",
    "bf16_to_f32",
]

__version__ = "0.1.0"

cuda_backend_available = _dsaib.cuda_backend_available


def bf16_bits(x) -> _np.ndarray:
    """float32 array -> uint16 array of bf16 bit patterns (round to nearest even).

    NaN stays NaN. The result is meant for ``uint16_as_bf16=True``.
    """
    f = _np.ascontiguousarray(x, dtype=_np.float32)
    u = f.view(_np.uint32).astype(_np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = _np.isnan(f)
    out = rounded.astype(_np.uint16)
    out[nan] = ((u[nan] >> 16) | 0x40).astype(_np.uint16)
    return out


def bf16_to_f32(bits) -> _np.ndarray:
    """uint16 array of bf16 bit patterns -> float32 array (exact)."""
    b = _np.ascontiguousarray(bits, dtype=_np.uint16)
    return (b.astype(_np.uint32) << 16).view(_np.float32)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _alloc_like(ref, shape, out_dtype):
    """Allocates a contiguous output of `shape` next to `ref` (numpy or torch)."""
    if _is_torch(ref):
        import torch

        dt = {"f32": torch.float32, "bf16": torch.bfloat16}[out_dtype]
        return torch.empty(tuple(shape), dtype=dt, device=ref.device)
    dt = {"f32": _np.float32, "bf16": _np.uint16}[out_dtype]
    return _np.empty(tuple(shape), dtype=dt)


def _shape(x):
    return tuple(int(s) for s in x.shape)


def indexer_backward(
    index_q,
    weights,
    index_k,
    topk_indices,
    attn_score,
    index_score,
    *,
    sm_scale: float,
    loss_coeff: float = 1.0,
    grad_loss: float = 1.0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    out_dtype: str = "f32",
    out=None,
    backend: str = "cpu",
    normalization_count: int = 0,
    strict_indices: bool = False,
    deterministic: bool = False,
    num_threads: int = 0,
    stream: int = 0,
    uint16_as_bf16: bool = False,
):
    """Gradients of the indexer KL loss w.r.t. index_q, weights and index_k.

    Shapes (``layout="bshd"``; for ``"thd"`` drop the batch dim and pack the
    sequences, with ``cu_seqlens_q``/``cu_seqlens_k`` int32 of shape (B + 1,)):

    ============  ===============  ==================================
    argument      shape            dtype
    ============  ===============  ==================================
    index_q       (B, S_q, H, D)   bf16
    weights       (B, S_q, H)      bf16 or float32
    index_k       (B, S_kv, D)     bf16
    topk_indices  (B, S_q, topk)   int32 (-1 or out of range: ignored)
    attn_score    (B, S_q, topk)   float32 (target distribution T)
    index_score   (B, S_q, topk)   float32 (indexer softmax P)
    ============  ===============  ==================================

    H must be a multiple of 8 in [8, 128], D 64 or 128, topk >= 1.
    bf16 is ``torch.bfloat16``, or numpy ``uint16`` bit patterns with
    ``uint16_as_bf16=True`` (see :func:`bf16_bits`).

    Args:
      sm_scale: multiplies every logit (finite).
      loss_coeff, grad_loss: the loss weight and its upstream gradient;
        c = grad_loss * loss_coeff / N.
      layout: ``"bshd"`` or ``"thd"``.
      id_mode: ``"local"`` (ids are rows of the query's own sequence) or
        ``"global"`` (flat rows of index_k).
      out_dtype: ``"f32"`` or ``"bf16"`` for outputs allocated here
        (numpy bf16 outputs are uint16 bit patterns).
      out: optional ``(d_index_q, d_weights, d_index_k)`` to write into:
        contiguous, shaped like index_q, weights, index_k, float32 or bf16,
        on the inputs' device. They are returned.
      backend: ``"cpu"`` (fp64 reference on host tensors) or ``"cuda"``.
      normalization_count: N; 0 means the number of query tokens.
      strict_indices: raise ValueError on the first invalid topk id.
      deterministic: require bitwise-reproducible outputs (cuda rejects it).
      num_threads: cpu worker threads (0 = all cores).
      stream: cuda: a cudaStream_t as an int (0 = the legacy default stream).
      uint16_as_bf16: read uint16/int16 arrays (inputs, and outputs given in
        ``out``) as bf16 bit patterns; without it a uint16 array is a TypeError.

    Returns:
      ``(d_index_q, d_weights, d_index_k)``, shaped like index_q, weights and
      index_k; numpy arrays for numpy inputs, torch tensors for torch inputs.

    Raises:
      TypeError: unsupported dtype (message from the C++ library).
      ValueError: bad rank/shape/stride/device/option/cu_seqlens, or an
        invalid id with ``strict_indices=True`` (message from the C++ library).
      RuntimeError: backend unavailable, unsupported option, CUDA failure.
    """
    if out_dtype not in ("f32", "bf16"):
        raise ValueError(f'out_dtype: expected "f32" or "bf16", got {out_dtype!r}')
    out_uint16_as_bf16 = bool(uint16_as_bf16)
    if out is None:
        out = (
            _alloc_like(index_q, _shape(index_q), out_dtype),
            _alloc_like(index_q, _shape(weights), out_dtype),
            _alloc_like(index_q, _shape(index_k), out_dtype),
        )
        # numpy bf16 outputs allocated here are uint16 bit patterns; this does
        # not change how uint16 *inputs* are read.
        out_uint16_as_bf16 = True
    else:
        out = tuple(out)
        if len(out) != 3:
            raise ValueError(f"out: expected (d_index_q, d_weights, d_index_k), got {len(out)} items")
    _dsaib.indexer_backward(
        index_q, weights, index_k, topk_indices, attn_score, index_score,
        cu_seqlens_q, cu_seqlens_k, out[0], out[1], out[2],
        layout, id_mode, backend, float(sm_scale), float(loss_coeff), float(grad_loss),
        int(normalization_count), bool(strict_indices), bool(deterministic),
        int(stream), int(num_threads), bool(uint16_as_bf16), out_uint16_as_bf16,
    )
    return out


def indexer_kl_loss(
    index_q,
    weights,
    index_k,
    topk_indices,
    attn_score,
    index_score,
    *,
    sm_scale: float,
    loss_coeff: float = 1.0,
    grad_loss: float = 1.0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    normalization_count: int = 0,
    recompute_p: bool = True,
    uint16_as_bf16: bool = False,
) -> float:
    """The scalar loss (fp64, host tensors only) whose gradient is indexer_backward's.

    Loss = -c * sum_rows sum_valid max(T_i, eps) * log(max(P_i, eps)), with P
    recomputed from index_q/weights/index_k when ``recompute_p`` (else taken
    from index_score). Same arguments, shapes and errors as
    :func:`indexer_backward`.
    """
    return _dsaib.indexer_kl_loss(
        index_q, weights, index_k, topk_indices, attn_score, index_score,
        cu_seqlens_q, cu_seqlens_k, layout, id_mode, float(sm_scale), float(loss_coeff),
        float(grad_loss), int(normalization_count), bool(recompute_p), bool(uint16_as_bf16),
    )
