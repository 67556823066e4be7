"""dsaib: backward of the DeepSeek Sparse Attention lightning indexer.

Two layers:

* :func:`indexer_backward`, a plain function over DLPack tensors (numpy,
  torch, cupy, jax, or any ``__dlpack__`` producer), returning the three
  gradients ``(d_index_q, d_weights, d_index_k)`` of the indexer KL loss
  described in ``docs/math.md``. No framework is imported by ``import dsaib``.
* :mod:`dsaib.torch` (imported on first use of ``dsaib.torch``; needs torch):
  the ``torch.ops.dsaib.indexer_backward`` custom op (torch.compile, CUDA
  graphs, current stream), :func:`dsaib.torch.indexer_kl_loss`, an autograd
  loss whose backward is that op, and the module :class:`dsaib.torch.IndexerKLLoss`.
* :func:`attention_target`: the target ``T`` (attn_score) from the main
  attention's own tensors (query, latent kv, lse; docs/attention-target.md).

bf16 inputs
-----------
numpy has no bfloat16. Ways to pass bf16 data:

* torch / jax: pass ``torch.bfloat16`` / ``jnp.bfloat16`` arrays (DLPack bfloat16).
* numpy / cupy: pass ``uint16`` arrays holding the bf16 bit patterns *and*
  ``uint16_as_bf16=True`` (without the flag a uint16 array is a TypeError).
  :func:`bf16_bits` and :func:`bf16_to_f32` convert between float32 and such
  bit patterns (round to nearest even).

Errors
------
The C++ library's errors surface with the C++ message unchanged:

* ``TypeError``: a dtype the library does not take for that argument; an
  input that is not an array (None, a list, a scalar) or a numpy array in
  non-native byte order (checked in Python, naming the argument).
* ``ValueError``: wrong rank/shape/stride/device, bad option values, bad
  cu_seqlens, overlapping outputs, and (``strict_indices=True``) an invalid
  topk id.
* ``RuntimeError``: the cuda backend is unavailable (e.g. a CPU-only build),
  CUDA failures.
* ``MemoryError``: host memory (validation's copies of ``topk_indices`` /
  ``cu_seqlens``, the cpu backend's fp64 working set) or device memory could
  not be allocated.
"""

from __future__ import annotations

import numpy as _np

from . import _dsaib
from ._args import (_OUT_NAMES, _a_operand, _bool_value, _check_out, _f32_value, _grad_loss, _host_grad_loss,
                    _normalization_count, _num_threads, _option_str, _stream_value)
from ._frameworks import (_alloc, _check_arrays, _default_stream, _device, _export, _exported, _framework,
                          _is_capsule, _shape)

__all__ = [
    "indexer_backward",
    "indexer_kl_forward",
    "indexer_kl_loss_and_grad",
    "indexer_kl_loss",
    "attention_target",
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
    # `dsaib.torch` is loaded on first use, so `import dsaib` never imports torch.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
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


# ---- shared by the library calls ------------------------------------------


def _check_out_dtype(out_dtype):
    # "f64": the cpu backend's fp64 results unrounded (the cuda backend refuses it, naming the output).
    if out_dtype not in ("f32", "bf16", "f64"):
        raise ValueError(f'out_dtype: expected "f32", "bf16" or "f64", got {out_dtype!r}')


def _library_options(*, layout, id_mode, backend, strict_indices, deterministic, uint16_as_bf16, sm_scale,
                     loss_coeff, grad_loss, normalization_count, num_threads, a_operand_precision, l2_hints,
                     start_stagger) -> dict:
    """The library's options (dsaib::IndexerOptions) as the extension's
    keyword arguments, coerced with messages naming the argument; one set for a
    call and its workspace size (a new option is one more entry here). Also
    carries uint16_as_bf16 and grad_loss_tensor (a one-element tensor or None),
    which the caller takes out."""
    layout = _option_str("layout", layout, '"bshd" or "thd"')
    id_mode = _option_str("id_mode", id_mode, '"local" or "global"')
    if backend is not None:
        backend = _option_str("backend", backend, '"cpu", "cuda" or None')
    strict_indices = _bool_value("strict_indices", strict_indices)
    deterministic = _bool_value("deterministic", deterministic)
    uint16_as_bf16 = _bool_value("uint16_as_bf16", uint16_as_bf16)
    sm_scale = _f32_value("sm_scale", sm_scale)
    loss_coeff = _f32_value("loss_coeff", loss_coeff)
    grad_loss_value, grad_loss_tensor = _grad_loss(grad_loss)
    normalization_count = _normalization_count(normalization_count)
    num_threads = _num_threads(num_threads)
    a_operand_precision = _a_operand(a_operand_precision)
    l2_hints = _option_str("l2_hints", l2_hints, '"auto", "on" or "off"')
    start_stagger = _option_str("start_stagger", start_stagger, '"auto" or "off"')
    return dict(layout=layout, id_mode=id_mode, backend=backend, sm_scale=sm_scale, loss_coeff=loss_coeff,
                grad_loss=grad_loss_value, normalization_count=normalization_count, strict_indices=strict_indices,
                deterministic=deterministic, num_threads=num_threads, a_operand_precision=a_operand_precision,
                l2_hints=l2_hints, start_stagger=start_stagger, uint16_as_bf16=uint16_as_bf16,
                grad_loss_tensor=grad_loss_tensor)


class _Placement:
    """Where a library call runs (framework, device, backend, stream), its
    outputs allocated there, and the call itself with its workspace."""

    def __init__(self, index_q, options: dict, stream):
        if options["grad_loss_tensor"] is not None:
            _check_arrays(grad_loss=options["grad_loss_tensor"])
        self.fw = _framework(index_q)
        self.index_q = index_q
        kind, index = _device(index_q)
        self.device = f"cuda:{index}" if kind == "cuda" else kind
        if options["backend"] is None:
            options["backend"] = "cuda" if kind == "cuda" else "cpu"
        self.backend = options["backend"]
        self.explicit_stream = stream is not None
        if self.explicit_stream:
            stream = _stream_value(stream)
        if self.explicit_stream and self.backend == "cpu" and stream != 0:
            raise ValueError(f"stream: expected None or 0 on the cpu backend (it runs on host threads), "
                             f"got {stream!r}")
        if stream is None:
            stream = _default_stream(self.fw, index_q, self.device) if self.backend == "cuda" else 0
        self.stream = int(stream)
        options["stream"] = self.stream

    def alloc(self, shape, dtype="f32"):
        return _alloc(self.fw, self.index_q, shape, dtype, self.device)

    def gradients(self, index_q, weights, index_k, out_dtype):
        return (self.alloc(_shape(index_q), out_dtype), self.alloc(_shape(weights), out_dtype),
                self.alloc(_shape(index_k), out_dtype))

    def call(self, entry, workspace_size, tensors: dict, options: dict, out: tuple, allocated: bool,
             with_out_bit_patterns=True):
        """entry(**tensors, **options) with the workspace; returns out (jax arrays for jax inputs)."""
        uint16_as_bf16 = options.pop("uint16_as_bf16")
        bit_patterns = dict(uint16_as_bf16=uint16_as_bf16)
        if with_out_bit_patterns:
            # numpy/cupy bf16 outputs allocated here are uint16 bit patterns; this
            # does not change how uint16 *inputs* are read.
            bit_patterns["out_uint16_as_bf16"] = True if allocated else uint16_as_bf16
        workspace = None
        if (self.fw == "torch" and self.backend == "cuda" and _framework(out[-1]) == "torch"
                and not any(_is_capsule(x) for x in tensors.values())):  # a raw capsule can be read once
            import torch

            # The library's scratch memory, from torch's caching allocator so it is
            # stream-ordered and CUDA-graph safe (else the library allocates it).
            nbytes = workspace_size(**_exported(tensors), **bit_patterns, **options)
            if nbytes:
                workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.index_q.device)

        if self.fw == "torch" and self.backend == "cuda" and self.explicit_stream:
            import torch

            dev = self.index_q.device
            if self.stream != int(torch.cuda.current_stream(dev).cuda_stream):
                ext = torch.cuda.ExternalStream(self.stream, device=dev)
                for t in (*(out if allocated else ()), workspace):
                    if t is not None:
                        t.record_stream(ext)

        entry(**_exported(tensors), **bit_patterns, workspace=_export(workspace), **options)
        if self.fw == "jax" and allocated:
            import jax.dlpack

            if self.backend == "cuda":
                _dsaib.stream_synchronize(self.stream)
            out = tuple(jax.dlpack.from_dlpack(o) for o in out)
        return out


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
    grad_loss=1.0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    out_dtype: str = "f32",
    out=None,
    backend=None,
    normalization_count: int = 0,
    strict_indices: bool = False,
    deterministic: bool = False,
    num_threads: int = 0,
    stream=None,
    uint16_as_bf16: bool = False,
    a_operand_precision: str = "auto",
    l2_hints: str = "auto",
    start_stagger: str = "auto",
    row_lse=None,
    row_target_mass=None,
):
    """Gradients of the indexer KL loss w.r.t. index_q, weights and index_k.

    Shapes (``layout="bshd"``; for ``"thd"`` drop the batch dim and pack the
    sequences, with ``cu_seqlens_q``/``cu_seqlens_k`` int32 of shape (B + 1,)):

    ============  ===============  ==================================
    argument      shape            dtype
    ============  ===============  ==================================
    index_q       (B, S_q, H, D)   bf16
    weights       (B, S_q, H)      bf16 or float32 (cpu: or float64)
    index_k       (B, S_kv, D)     bf16
    topk_indices  (B, S_q, topk)   int32 (-1 or out of range: ignored)
    attn_score    (B, S_q, topk)   float32 (cpu: or float64; target T)
    index_score   (B, S_q, topk)   float32 (cpu: or float64; softmax P)
    ============  ===============  ==================================

    P-free form: ``index_score=None`` with ``row_lse`` and ``row_target_mass``
    (float32, or float64 on the cpu backend; (B, S_q) or (T_q,)), as
    :func:`indexer_kl_forward` returns them;
    the backward then rebuilds P from its own logits and no (S_q, topk) tensor
    of P is needed.

    H must be a multiple of 8 in [8, 128], D 64 or 128, topk >= 1.
    bf16 is ``torch.bfloat16`` / ``jax.numpy.bfloat16`` (any DLPack bfloat16),
    or ``uint16`` bit patterns with ``uint16_as_bf16=True`` (numpy, cupy; see
    :func:`bf16_bits`).

    Tensors may come from any DLPack producer: numpy, torch, cupy, jax, or any
    object with ``__dlpack__``/``__dlpack_device__`` (all on one device).

    Args:
      sm_scale: multiplies every logit (finite).
      loss_coeff: the loss weight.
      grad_loss: the upstream gradient of the loss; c = grad_loss * loss_coeff / N.
        A number, or a one-element float32 tensor on the backend's device that
        is read when the work runs (so a captured CUDA graph sees new values).
      layout: ``"bshd"`` or ``"thd"``.
      id_mode: ``"local"`` (ids are rows of the query's own sequence) or
        ``"global"`` (flat rows of index_k).
      out_dtype: ``"f32"``, ``"bf16"`` or ``"f64"`` for outputs allocated
        here (numpy and cupy bf16 outputs are uint16 bit patterns; ``"f64"``:
        the cpu backend only, its fp64 results unrounded).
      out: optional ``(d_index_q, d_weights, d_index_k)`` to write into:
        contiguous, shaped like index_q, weights, index_k, float32 or bf16
        (or float64 on the cpu backend), on the inputs' device. They are returned.
      backend: ``"cpu"`` (fp64 reference on host tensors), ``"cuda"`` (the
        sm_90a kernel), or None: ``"cuda"`` when index_q is a CUDA tensor, else ``"cpu"``.
      normalization_count: N; 0 means the number of query tokens.
      strict_indices: raise ValueError on the first invalid topk id.
      deterministic: require bitwise-reproducible outputs; on cuda this runs the
        fixed-point d_index_k (d_index_q and d_weights always are; the cpu backend always is).
      num_threads: cpu worker threads (0 = all cores).
      stream: cuda only: the cudaStream_t to run on, as an int (not bool or
        float) or an object with ``__int__`` (numba's Stream). None (default)
        is the current stream of index_q's framework: torch's
        ``torch.cuda.current_stream()``, cupy's ``cupy.cuda.get_current_stream()``;
        for jax and other producers the legacy default stream (0). The call
        returns without waiting for the GPU, except for jax inputs, where it
        waits for the stream before wrapping the outputs. With an explicit
        torch stream other than the current one, outputs allocated here are
        marked as used on it (``record_stream``); ordering the inputs before
        that stream is the caller's job. On the cpu backend only None or 0
        (anything else is a ValueError).
      uint16_as_bf16: read uint16/int16 arrays (inputs, and outputs given in
        ``out``) as bf16 bit patterns; without it a uint16 array is a TypeError.
      a_operand_precision: cuda only: the precision of the tensor-core operand
        ``a = gs * w * sm_scale * [q.k > 0]`` in the dK and dQ GEMMs.
        ``"bf16x2"``: two bf16 terms (a = a_hi + a_lo, error ~2^-16; the GEMMs
        run twice). ``"bf16"``: one bf16 term, faster (bf16x2 takes ~1.15x
        the time of bf16 at DeepSeek shapes), but it adds ~1.3-1.6e-3 relative RMS error to d_index_q and d_index_k
        (fine for bf16 outputs, whose budget is 3e-3; not for float32 outputs
        held to 1e-3). ``"auto"`` (default): ``"bf16x2"`` when d_index_q or
        d_index_k is float32, else ``"bf16"``. d_weights never depends on it;
        the cpu backend ignores it (float64 throughout). Anything else is a
        ValueError.
      l2_hints: cuda only: ``"auto"`` (default: the launch decides from the
        key table's size against the L2), ``"on"`` or ``"off"``: whether the
        d_index_k reductions carry an L2 eviction policy. A tuning knob; the
        results do not depend on it (docs/api.md).
      start_stagger: cuda only: ``"auto"`` (default) or ``"off"``: whether the
        persistent CTAs that run one task fewer start delayed. A tuning knob;
        the results do not depend on it.

    Returns:
      ``(d_index_q, d_weights, d_index_k)``, shaped like index_q, weights and
      index_k, in index_q's framework: numpy arrays, torch tensors (on index_q's
      device), cupy arrays, jax arrays (zero-copy views of dsaib-owned memory);
      for any other DLPack producer, :class:`Buffer` objects (``__dlpack__``,
      ``__dlpack_device__``, ``shape``, ``dtype``; pass them to
      ``numpy.from_dlpack``/``torch.from_dlpack``/...). With ``out=`` the given
      tensors are returned.

    Raises:
      TypeError: unsupported dtype (message from the C++ library or the
        binding: ``NAME: expected dtype X, got Y`` with X what NAME takes); a
        bool or non-number for sm_scale/loss_coeff/grad_loss; a non-int
        normalization_count/num_threads/stream; a non-bool strict_indices/
        deterministic/uint16_as_bf16; a non-str layout/id_mode/backend; None
        in ``out``.
      ValueError: bad rank/shape/stride/device/option/cu_seqlens, or an
        invalid id with ``strict_indices=True`` (message from the C++ library);
        sm_scale/loss_coeff/grad_loss not finite as float32; num_threads
        outside [0, 2^31-1]; stream outside [0, 2^64-1], or not None or 0 on
        the cpu backend; ``out`` not 3 arrays, or a read-only one; a DLPack
        capsule already consumed, or given for two arguments (a versioned or
        foreign capsule is a TypeError).
      RuntimeError: backend unavailable, unsupported option, CUDA failure.
      MemoryError: host or device memory could not be allocated.
    """
    # P is index_score, or (the P-free form) row_lse and row_target_mass; the
    # library says which combination is wrong.
    p_arrays = {n: x for n, x in (("index_score", index_score), ("row_lse", row_lse),
                                  ("row_target_mass", row_target_mass)) if x is not None}
    if not p_arrays:
        p_arrays["index_score"] = None  # "index_score: expected an array ..."
    _check_arrays(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                  attn_score=attn_score, **p_arrays, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    _check_out_dtype(out_dtype)
    options = _library_options(
        layout=layout, id_mode=id_mode, backend=backend, strict_indices=strict_indices, deterministic=deterministic,
        uint16_as_bf16=uint16_as_bf16, sm_scale=sm_scale, loss_coeff=loss_coeff, grad_loss=grad_loss,
        normalization_count=normalization_count, num_threads=num_threads, a_operand_precision=a_operand_precision,
        l2_hints=l2_hints, start_stagger=start_stagger)
    if out is not None:
        out = _check_out(out)
        _check_arrays(**dict(zip(_OUT_NAMES, out)))
    run = _Placement(index_q, options, stream)
    allocated = out is None
    if allocated:
        out = run.gradients(index_q, weights, index_k, out_dtype)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, index_score=index_score, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, d_index_q=out[0], d_weights=out[1], d_index_k=out[2],
                   grad_loss_device=options.pop("grad_loss_tensor"), row_lse=row_lse,
                   row_target_mass=row_target_mass)
    return run.call(_dsaib.indexer_backward, _dsaib.indexer_backward_workspace_size, tensors, options, out,
                    allocated)


def indexer_kl_forward(
    index_q,
    weights,
    index_k,
    topk_indices,
    attn_score,
    *,
    sm_scale: float,
    loss_coeff: float = 1.0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    return_index_score: bool = False,
    backend=None,
    normalization_count: int = 0,
    strict_indices: bool = False,
    num_threads: int = 0,
    stream=None,
    uint16_as_bf16: bool = False,
):
    """The indexer KL loss and its per-row statistics (dsaib::indexer_kl_forward).

    Same inputs as :func:`indexer_backward` without ``index_score``. Returns
    ``(loss, row_lse, row_target_mass)``, float32, in index_q's framework (as
    :func:`indexer_backward` allocates): the loss (shape ``()``), each query
    row's log-sum-exp of its logits in float32 (``-inf`` for a row without a
    valid slot) and its target mass ``sum_i max(T_i, eps) * [Pb_i >= eps]``
    divided by ``sum_i Pb_i``, with ``Pb_i = exp(z_i - row_lse)`` the P that
    the P-free backward rebuilds from the float32 LSE (the division cancels
    that LSE's rounding; docs/kl-forward.md), shaped ``(B, S_q)`` (BSHD) or
    ``(T_q,)`` (THD). With ``return_index_score=True``
    also P (float32, shaped like topk_indices) as a fourth item. row_lse and
    row_target_mass are what :func:`indexer_backward` takes in place of
    index_score (the P-free form). The loss is bitwise reproducible.
    Options and errors as :func:`indexer_backward`.
    """
    _check_arrays(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                  attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return_index_score = _bool_value("return_index_score", return_index_score)
    options = _library_options(
        layout=layout, id_mode=id_mode, backend=backend, strict_indices=strict_indices, deterministic=False,
        uint16_as_bf16=uint16_as_bf16, sm_scale=sm_scale, loss_coeff=loss_coeff, grad_loss=1.0,
        normalization_count=normalization_count, num_threads=num_threads, a_operand_precision="auto",
        l2_hints="auto", start_stagger="auto")
    run = _Placement(index_q, options, stream)
    options.pop("grad_loss_tensor")
    ids_shape = _shape(topk_indices)
    out = (run.alloc(()), run.alloc(ids_shape[:-1]), run.alloc(ids_shape[:-1]))
    if return_index_score:
        out += (run.alloc(ids_shape),)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, loss=out[0],
                   row_lse=out[1], row_target_mass=out[2], index_score=out[3] if return_index_score else None)
    return run.call(_dsaib.indexer_kl_forward, _dsaib.indexer_kl_forward_workspace_size, tensors, options, out,
                    True, with_out_bit_patterns=False)


def indexer_kl_loss_and_grad(
    index_q,
    weights,
    index_k,
    topk_indices,
    attn_score,
    *,
    sm_scale: float,
    loss_coeff: float = 1.0,
    grad_loss=1.0,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    out_dtype: str = "f32",
    backend=None,
    normalization_count: int = 0,
    strict_indices: bool = False,
    deterministic: bool = False,
    num_threads: int = 0,
    stream=None,
    uint16_as_bf16: bool = False,
    a_operand_precision: str = "auto",
    l2_hints: str = "auto",
    start_stagger: str = "auto",
):
    """The loss and its three gradients in one library call (dsaib::indexer_kl_loss_and_grad),
    for an indexer trained only by this loss.

    Same inputs as :func:`indexer_backward` without ``index_score``: no P is
    passed or made (the forward's per-row statistics stay in the library's
    workspace). Returns ``(loss, d_index_q, d_weights, d_index_k)``: the loss
    float32 of shape ``()`` (float64 with ``out_dtype="f64"``; not scaled by
    grad_loss), the gradients as :func:`indexer_backward` returns them
    (``out_dtype``). ``grad_loss`` may be
    a one-element float32 tensor on the backend's device, read when the work
    runs; on the cuda backend the call does not synchronise the host (BSHD and
    THD), so it can be captured in a CUDA graph. Options and errors as
    :func:`indexer_backward`.
    """
    _check_arrays(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                  attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    _check_out_dtype(out_dtype)
    options = _library_options(
        layout=layout, id_mode=id_mode, backend=backend, strict_indices=strict_indices, deterministic=deterministic,
        uint16_as_bf16=uint16_as_bf16, sm_scale=sm_scale, loss_coeff=loss_coeff, grad_loss=grad_loss,
        normalization_count=normalization_count, num_threads=num_threads, a_operand_precision=a_operand_precision,
        l2_hints=l2_hints, start_stagger=start_stagger)
    run = _Placement(index_q, options, stream)
    out = (run.alloc((), "f64" if out_dtype == "f64" else "f32"),) + run.gradients(index_q, weights, index_k,
                                                                                 out_dtype)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, loss=out[0],
                   d_index_q=out[1], d_weights=out[2], d_index_k=out[3],
                   grad_loss_device=options.pop("grad_loss_tensor"))
    return run.call(_dsaib.indexer_kl_loss_and_grad, _dsaib.indexer_kl_loss_and_grad_workspace_size, tensors,
                    options, out, True)


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
    _check_arrays(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                  attn_score=attn_score, index_score=index_score, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k)
    layout = _option_str("layout", layout, '"bshd" or "thd"')
    id_mode = _option_str("id_mode", id_mode, '"local" or "global"')
    recompute_p = _bool_value("recompute_p", recompute_p)
    uint16_as_bf16 = _bool_value("uint16_as_bf16", uint16_as_bf16)
    sm_scale = _f32_value("sm_scale", sm_scale)
    loss_coeff = _f32_value("loss_coeff", loss_coeff)
    grad_loss = _host_grad_loss(grad_loss)
    normalization_count = _normalization_count(normalization_count)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, index_score=index_score, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k)
    return _dsaib.indexer_kl_loss(
        **_exported(tensors), recompute_p=recompute_p, uint16_as_bf16=uint16_as_bf16, layout=layout,
        id_mode=id_mode, sm_scale=sm_scale, loss_coeff=loss_coeff, grad_loss=grad_loss,
        normalization_count=normalization_count,
    )



def attention_target(
    query,
    kv,
    lse,
    topk_indices,
    *,
    sm_scale: float,
    lse_base: str = "natural",
    normalize: bool = True,
    layout: str = "bshd",
    id_mode: str = "local",
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    out=None,
    backend=None,
    strict_indices: bool = False,
    num_threads: int = 0,
    stream=None,
    uint16_as_bf16: bool = False,
):
    """The attention target ``T`` (attn_score) of the indexer loss from the main
    attention's tensors (dsaib::attention_target, docs/attention-target.md).

    For query row t and valid slot i with key row j::

        U_i = sum_h exp(sm_scale * query[t, h] . kv[j] - lse[t, h])     (lse_base="natural")
        U_i = sum_h exp2(sm_scale * log2(e) * query[t, h] . kv[j] - lse[t, h])   ("base2")
        T_i = U_i / sum_i' U_i'    (normalize=True; a row whose sum is 0 gives 0)

    and 0 at invalid slots (-1 or outside the row's sequence).

    ============  ====================  ====================
    argument      BSHD shape            THD shape
    ============  ====================  ====================
    query         (B, S_q, Hq, Dqk)     (T_q, Hq, Dqk)        bf16, contiguous
    kv            (B, S_kv, Dqk)        (T_k, Dqk)            bf16, contiguous (one latent row per token)
    lse           (B, S_q, Hq)          (T_q, Hq)             float32, any strides
    topk_indices  (B, S_q, topk)        (T_q, topk)           int32, contiguous
    ============  ====================  ====================

    Args:
      sm_scale: the main attention's softmax scale (multiplies query . kv).
      lse_base: ``"natural"`` or ``"base2"`` (FlashMLA's lse): the base of lse.
      normalize: False returns the unnormalised sums U, for a tensor-parallel
        all-reduce over the head shards before dividing by each row's sum.
      out: optional float32 array shaped like topk_indices to write into (returned).
      backend, stream, num_threads, strict_indices, uint16_as_bf16, layout,
      id_mode, cu_seqlens_q, cu_seqlens_k: as for :func:`indexer_backward`.
        The cuda backend takes Hq a multiple of 16 up to 128 and Dqk a
        multiple of 64 up to 576; the cpu backend (fp64) any sizes.

    Returns:
      attn_score, float32, shaped like topk_indices, in query's framework
      (as :func:`indexer_backward` allocates).

    Raises: as :func:`indexer_backward`, with the C++ library's messages.
    """
    _check_arrays(query=query, kv=kv, lse=lse, topk_indices=topk_indices, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k)
    options = dict(
        layout=_option_str("layout", layout, '"bshd" or "thd"'),
        id_mode=_option_str("id_mode", id_mode, '"local" or "global"'),
        backend=None if backend is None else _option_str("backend", backend, '"cpu", "cuda" or None'),
        sm_scale=_f32_value("sm_scale", sm_scale),
        lse_base=_option_str("lse_base", lse_base, '"natural" or "base2"'),
        normalize=_bool_value("normalize", normalize),
        strict_indices=_bool_value("strict_indices", strict_indices),
        num_threads=_num_threads(num_threads),
        uint16_as_bf16=_bool_value("uint16_as_bf16", uint16_as_bf16),
        grad_loss_tensor=None,
    )
    if out is not None:
        _check_arrays(attn_score=out)
    run = _Placement(query, options, stream)
    options.pop("grad_loss_tensor")
    allocated = out is None
    if allocated:
        out = run.alloc(_shape(topk_indices))
    tensors = dict(query=query, kv=kv, lse=lse, topk_indices=topk_indices, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, attn_score=out)
    return run.call(_dsaib.attention_target, _dsaib.attention_target_workspace_size, tensors, options, (out,),
                    allocated, with_out_bit_patterns=False)[0]
