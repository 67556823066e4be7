"""dsaib: training the DeepSeek Sparse Attention lightning indexer.

The indexer is trained by a KL (cross-entropy) loss between its softmax P over
the selected keys and the main attention's distribution T over them
(docs/math.md). dsaib computes, through its C++ library (the fp64 cpu backend,
or the sm_90a cuda kernels):

* :func:`indexer_backward`: the gradients ``(d_index_q, d_weights, d_index_k)``
  given P (``index_score``), or without P from the forward's row statistics;
* :func:`indexer_kl_forward`: the loss and each query row's statistics (and P);
* :func:`indexer_kl_loss`: the loss alone;
* :func:`indexer_kl_loss_and_grad`: the loss and the three gradients in one call;
* :func:`attention_target`: the target T from the main attention's tensors;
* :func:`indexer_topk`: the indexer's forward, each query row's exact top-k
  keys by logit (the ids the loss then takes), and their logits;
* :func:`reference_kl_loss`: the loss in fp64 on the host (a reference).

Two front ends take the same arguments for each of these, from one table of
options (:data:`OPTIONS`):

* this module, over DLPack tensors (numpy, torch, cupy, jax, or any
  ``__dlpack__`` producer), returning outputs in index_q's framework; no
  framework is imported by ``import dsaib``;
* :mod:`dsaib.torch` (needs torch, loaded on first use): the same functions as
  ``torch.library`` custom ops (torch.compile, CUDA graphs, the current
  stream), where :func:`dsaib.torch.indexer_kl_loss` is differentiable, plus
  the ``nn.Module`` :class:`dsaib.torch.IndexerKLLoss`; and
  :mod:`dsaib.distributed`, the loss and backward of a sequence split over a
  ``torch.distributed`` group (context parallelism).

Each function makes one library call, which validates its arguments once,
before anything is written. Host synchronisations: docs/python.md.

bf16 inputs
-----------
numpy has no bfloat16. torch and jax arrays travel through DLPack as
bfloat16; numpy and cupy pass ``uint16`` arrays of bf16 bit patterns with
``uint16_as_bf16=True`` (:func:`bf16_bits` and :func:`bf16_to_f32` convert).

Errors
------
The C++ library's messages come through unchanged, naming the argument:
``TypeError`` (a dtype the argument does not take, an argument of the wrong
type), ``ValueError`` (rank, shape, stride, device, option values,
cu_seqlens, an invalid id with ``strict_indices=True``), ``RuntimeError`` (the
cuda backend unavailable, CUDA failures), ``MemoryError``.
"""

from __future__ import annotations

import numpy as _np

from . import _dsaib
from ._generic import (attention_target, indexer_backward, indexer_kl_forward, indexer_kl_loss,
                       indexer_kl_loss_and_grad, indexer_topk, reference_kl_loss)
from ._options import OPTIONS, OPERATIONS

__all__ = [
    "indexer_backward",
    "indexer_kl_forward",
    "indexer_kl_loss",
    "indexer_kl_loss_and_grad",
    "attention_target",
    "indexer_topk",
    "reference_kl_loss",
    "OPTIONS",
    "OPERATIONS",
    "cuda_backend_available",
    "cuda_compiled",
    "Buffer",
    "bf16_bits",
    "bf16_to_f32",
]

__version__ = "0.1.0"

cuda_backend_available = _dsaib.cuda_backend_available
cuda_compiled = _dsaib.cuda_compiled
Buffer = _dsaib.Buffer


def __getattr__(name):
    # `dsaib.torch` and `dsaib.distributed` are loaded on first use, so `import dsaib` never imports torch.
    if name in ("torch", "distributed"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def bf16_bits(x) -> _np.ndarray:
    """float32 array -> uint16 array of bf16 bit patterns (round to nearest even),
    of the same shape (a 0-d input gives a 0-d result).

    NaN stays NaN. The result is meant for ``uint16_as_bf16=True``.
    """
    given = _np.asarray(x, dtype=_np.float32)
    f = _np.ascontiguousarray(given).reshape(-1)  # 1-D here, the input's shape back at the end
    u = f.view(_np.uint32).astype(_np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = _np.isnan(f)
    out = rounded.astype(_np.uint16)
    out[nan] = ((u[nan] >> 16) | 0x40).astype(_np.uint16)
    return out.reshape(given.shape)


def bf16_to_f32(bits) -> _np.ndarray:
    """uint16 array of bf16 bit patterns -> float32 array (exact), of the same shape.

    Raises ValueError for values that are not 16-bit patterns (outside
    [0, 65535] as unsigned, or [-32768, 65535] for signed input such as int16
    bits), which a cast to uint16 would wrap."""
    a = _np.asarray(bits)
    if a.dtype.kind in "iu" and a.size and (int(a.min()) < -32768 or int(a.max()) > 65535):
        raise ValueError(f"bits: expected 16-bit patterns, got values in [{int(a.min())}, {int(a.max())}]")
    if a.dtype.kind not in "iub":
        raise TypeError(f"bits: expected an integer array of bf16 bit patterns, got dtype {a.dtype}")
    b = _np.ascontiguousarray(a.astype(_np.uint16)).reshape(-1)
    return (b.astype(_np.uint32) << 16).view(_np.float32).reshape(a.shape)
