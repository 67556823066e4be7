"""The DLPack front end: dsaib's operations on any DLPack producer (numpy, torch,
cupy, jax, a dsaib Buffer, a capsule), one library call each.

Outputs are allocated with index_q's framework (_frameworks._alloc); the
library's workspace, on the cuda backend for torch tensors, comes from torch's
caching allocator, asked by the library after it has validated the arguments
(the extension's `workspace` callable); for other frameworks the library
allocates it itself, stream-ordered.
"""

from __future__ import annotations

import functools

from . import _dsaib, _options
from ._args import _OUT_NAMES, _bool_value, _check_out, _check_writable_out, _host_grad_loss
from ._frameworks import _alloc, _check_arrays, _default_stream, _device, _export, _exported, _framework, _shape

_RETURNS = """
    Tensors may come from any DLPack producer: numpy, torch, cupy, jax, or any
    object with ``__dlpack__``/``__dlpack_device__`` (all on one device). bf16 is
    ``torch.bfloat16`` / ``jax.numpy.bfloat16`` (DLPack bfloat16), or ``uint16``
    bit patterns with ``uint16_as_bf16=True`` (numpy, cupy; see
    :func:`dsaib.bf16_bits`). Outputs are in index_q's framework: numpy arrays
    (bf16 as uint16 bits), torch tensors, cupy arrays, jax arrays; for any
    other producer :class:`dsaib.Buffer` objects. Errors: TypeError (a dtype
    the argument does not take, an argument of the wrong type), ValueError
    (shapes, strides, devices, option values, cu_seqlens, strict ids),
    RuntimeError (backend unavailable, CUDA failure), MemoryError; the C++
    library's messages, raised before anything is written.
"""


class _Placement:
    """Where a library call runs (framework, device, backend, stream), its
    outputs allocated there, and the call itself."""

    def __init__(self, index_q, options: dict):
        self.fw = _framework(index_q)
        self.index_q = index_q
        kind, index = _device(index_q)
        self.device = f"cuda:{index}" if kind == "cuda" else kind
        if options["backend"] is None:
            options["backend"] = "cuda" if kind == "cuda" else "cpu"
        self.backend = options["backend"]
        stream = options["stream"]
        self.explicit_stream = stream is not None
        if self.explicit_stream and self.backend == "cpu" and stream != 0:
            raise ValueError(f"stream: expected None or 0 on the cpu backend (it runs on host threads), "
                             f"got {stream!r}")
        if stream is None:
            stream = _default_stream(self.fw, index_q, self.device) if self.backend == "cuda" else 0
        self.stream = int(stream)
        options["stream"] = self.stream
        grad_loss_tensor = options.get("grad_loss", (None, None))[1]
        if grad_loss_tensor is not None:
            _check_arrays(grad_loss=grad_loss_tensor)

    def alloc(self, shape, dtype="f32"):
        return _alloc(self.fw, self.index_q, shape, dtype, self.device)

    def gradients(self, index_q, weights, index_k, codes):
        return tuple(self.alloc(_shape(x), c) for x, c in zip((index_q, weights, index_k), codes))

    def _side_stream(self):
        """torch's stream object for an explicit stream other than the current one (else None)."""
        if not (self.fw == "torch" and self.backend == "cuda" and self.explicit_stream):
            return None
        import torch

        dev = self.index_q.device
        if self.stream == int(torch.cuda.current_stream(dev).cuda_stream):
            return None
        return torch.cuda.ExternalStream(self.stream, device=dev)

    def _workspace(self, side):
        """The extension's workspace argument: torch's caching allocator for torch
        tensors on the cuda backend (stream-ordered, and a CUDA graph's pool
        while one is captured), else None (the library allocates it)."""
        if not (self.fw == "torch" and self.backend == "cuda"):
            return None
        import torch

        dev = self.index_q.device

        def allocate(nbytes):
            block = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            if side is not None:
                block.record_stream(side)
            return _export(block)

        return allocate

    def call(self, entry, tensors: dict, options: dict, out: tuple, allocated: bool, bit_patterns: dict):
        """entry(**tensors, **options): one library call; returns out (jax arrays for jax inputs)."""
        side = self._side_stream()
        if side is not None and allocated:
            for t in out:
                t.record_stream(side)
        entry(**_exported(tensors), **bit_patterns, workspace=self._workspace(side), **options)
        if self.fw == "jax" and allocated:
            import jax.dlpack

            if self.backend == "cuda":
                _dsaib.stream_synchronize(self.stream)
            out = tuple(jax.dlpack.from_dlpack(o) for o in out)
        return out


def _prepare(operation, index_q, given, uint16_as_bf16):
    """(options checked, placement, library keyword arguments)."""
    options = _options.check(operation, given)
    u16 = _bool_value("uint16_as_bf16", uint16_as_bf16)
    run = _Placement(index_q, options)
    return options, run, u16


@_options.documented("indexer_backward")
def indexer_backward(index_q, weights, index_k, topk_indices, attn_score, index_score, *, sm_scale,
                     loss_coeff=1.0, grad_loss=1.0, normalization_count=0, layout="bshd", id_mode="local",
                     cu_seqlens_q=None, cu_seqlens_k=None, out_dtype=None, backend=None, strict_indices=False,
                     deterministic=False, num_threads=0, stream=None, a_operand_precision="auto", l2_hints="auto",
                     start_stagger="auto", row_lse=None, row_target_mass=None, out=None, uint16_as_bf16=False):
    """Gradients ``(d_index_q, d_weights, d_index_k)`` of the indexer KL loss (docs/math.md).

    ============  ===============  ==================================
    argument      shape (BSHD)     dtype
    ============  ===============  ==================================
    index_q       (B, S_q, H, D)   bf16
    weights       (B, S_q, H)      bf16 or float32 (cpu: or float64)
    index_k       (B, S_kv, D)     bf16
    topk_indices  (B, S_q, topk)   int32 (-1 or out of range: ignored)
    attn_score    (B, S_q, topk)   float32 (cpu: or float64; target T)
    index_score   (B, S_q, topk)   float32 (cpu: or float64; softmax P)
    ============  ===============  ==================================

    THD (``layout="thd"``): drop the batch dim and pack the sequences, with
    ``cu_seqlens_q``/``cu_seqlens_k`` int32 of shape (B + 1,). H is a multiple
    of 8 in [8, 128], D 64 or 128, topk >= 1. P-free form: ``index_score=None``
    with ``row_lse`` and ``row_target_mass`` as :func:`indexer_kl_forward`
    returns them. ``out``: optional ``(d_index_q, d_weights, d_index_k)`` to
    write into (contiguous, on the inputs' device), returned. With an explicit
    torch ``stream`` other than the current one, outputs allocated here are
    marked as used on it (``record_stream``); ordering the inputs before it is
    the caller's job. jax inputs: the call waits for the stream before
    wrapping the outputs as jax arrays.
    """
    p_arrays = {n: x for n, x in (("index_score", index_score), ("row_lse", row_lse),
                                  ("row_target_mass", row_target_mass)) if x is not None}
    if not p_arrays:
        p_arrays["index_score"] = None  # "index_score: expected an array ..."
    _check_arrays(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                  attn_score=attn_score, **p_arrays, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    options, run, u16 = _prepare("indexer_backward", index_q, dict(
        sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count, layout=layout,
        id_mode=id_mode, backend=backend, strict_indices=strict_indices, num_threads=num_threads, stream=stream,
        grad_loss=grad_loss, out_dtype=out_dtype, deterministic=deterministic,
        a_operand_precision=a_operand_precision, l2_hints=l2_hints, start_stagger=start_stagger), uint16_as_bf16)
    if out is not None:
        out = _check_out(out)
        _check_arrays(**dict(zip(_OUT_NAMES, out)))
        if options["out_dtype"] is not None:  # out's own dtypes are written: the two would disagree
            raise ValueError(f"out_dtype: expected None with out= (the outputs' own dtypes are written), got "
                             f"{out_dtype!r}")
    allocated = out is None
    if allocated:
        out = run.gradients(index_q, weights, index_k, options["out_dtype"] or ("f32",) * 3)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, index_score=index_score, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, d_index_q=out[0], d_weights=out[1], d_index_k=out[2],
                   grad_loss_device=options["grad_loss"][1], row_lse=row_lse, row_target_mass=row_target_mass)
    # numpy/cupy bf16 outputs allocated here are uint16 bit patterns; this does
    # not change how uint16 inputs are read.
    bits = dict(uint16_as_bf16=u16, out_uint16_as_bf16=True if allocated else u16)
    return run.call(_dsaib.indexer_backward, tensors, _options.library_kwargs(options), out, allocated, bits)


indexer_backward.__doc__ += _RETURNS


@_options.documented("indexer_kl_forward")
def indexer_kl_forward(index_q, weights, index_k, topk_indices, attn_score, *, sm_scale, loss_coeff=1.0,
                       normalization_count=0, layout="bshd", id_mode="local", cu_seqlens_q=None, cu_seqlens_k=None,
                       backend=None, strict_indices=False, num_threads=0, stream=None, return_index_score=False,
                       uint16_as_bf16=False, topk_logits=None):
    """The indexer KL loss and its per-row statistics: ``(loss, row_lse, row_target_mass)``.

    The inputs of :func:`indexer_backward` without ``index_score``. float32
    outputs: the loss (shape ``()``, bitwise reproducible), each query row's
    log-sum-exp of its logits (``-inf`` for a row without a valid slot) and its
    target mass ``sum_i max(T_i, eps) [Pb_i >= eps]`` divided by
    ``sum_i Pb_i``, ``Pb_i = exp(z_i - row_lse)`` the P that the P-free
    backward rebuilds from the float32 LSE (docs/kl-forward.md), shaped
    ``(B, S_q)`` or ``(T_q,)``: what :func:`indexer_backward` takes in place of
    ``index_score``. With ``return_index_score=True`` also P (float32, shaped
    like topk_indices) as a fourth item. ``topk_logits`` (optional, float32
    or on the cpu backend float64, shaped like topk_indices): the selected
    keys' logits as :func:`indexer_topk` writes them; the forward then takes
    ``sm_scale`` times them instead of gathering the keys and recomputing them.
    """
    _check_arrays(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                  attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  topk_logits=topk_logits)
    options, run, u16 = _prepare("indexer_kl_forward", index_q, dict(
        sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count, layout=layout,
        id_mode=id_mode, backend=backend, strict_indices=strict_indices, num_threads=num_threads, stream=stream,
        return_index_score=return_index_score), uint16_as_bf16)
    return _forward(run, options, u16, index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q,
                    cu_seqlens_k, options["return_index_score"], topk_logits)


def _forward(run, options, u16, index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q, cu_seqlens_k,
             with_p, topk_logits=None):
    ids_shape = _shape(topk_indices)
    out = (run.alloc(()), run.alloc(ids_shape[:-1]), run.alloc(ids_shape[:-1]))
    if with_p:
        out += (run.alloc(ids_shape),)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, loss=out[0],
                   row_lse=out[1], row_target_mass=out[2], index_score=out[3] if with_p else None,
                   topk_logits=topk_logits)
    return run.call(_dsaib.indexer_kl_forward, tensors, _options.library_kwargs(options), out, True,
                    dict(uint16_as_bf16=u16))


indexer_kl_forward.__doc__ += _RETURNS


def _refuses_the_host_loss_call(fn):
    """A call of indexer_kl_loss with the arguments of reference_kl_loss (the fp64
    host evaluation: index_score, recompute_p) gets an error naming that function."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        given = [n for n in ("index_score", "recompute_p") if n in kwargs]
        # A sixth positional array is the old call's index_score; anything else
        # (an sm_scale given by position) gets Python's own message.
        old_p = len(args) > 5 and (args[5] is None or hasattr(args[5], "__dlpack__") or hasattr(args[5], "__array__"))
        given = given or (["index_score"] if old_p else [])
        if given:
            raise TypeError(
                f"indexer_kl_loss: expected (index_q, weights, index_k, topk_indices, attn_score, *, sm_scale, ...), "
                f"the arguments of dsaib.torch.indexer_kl_loss, got {given[0]} (the fp64 host evaluation that takes "
                f"index_score and recompute_p is dsaib.reference_kl_loss)")
        return fn(*args, **kwargs)
    return wrapper


@_refuses_the_host_loss_call
@_options.documented("indexer_kl_loss")
def indexer_kl_loss(index_q, weights, index_k, topk_indices, attn_score, *, sm_scale, loss_coeff=1.0,
                    normalization_count=0, layout="bshd", id_mode="local", cu_seqlens_q=None, cu_seqlens_k=None,
                    backend=None, strict_indices=False, num_threads=0, stream=None, deterministic=False,
                    a_operand_precision="auto", l2_hints="auto", start_stagger="auto", gradients="forward",
                    uint16_as_bf16=False, topk_logits=None):
    """The indexer KL loss, a 0-d float32 array in index_q's framework: the loss
    of :func:`dsaib.torch.indexer_kl_loss` for the same arguments (the
    library's forward, one call), without autograd. ``topk_logits`` as for
    :func:`indexer_kl_forward`.

    The backward's options (``deterministic``, ``a_operand_precision``,
    ``l2_hints``, ``start_stagger``, ``gradients``) are checked as the library
    checks them and otherwise unused here (dsaib.torch's loss passes them on to
    where its gradients are formed). The
    fp64 host evaluation of the loss from a given P is :func:`reference_kl_loss`.
    """
    _check_arrays(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                  attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  topk_logits=topk_logits)
    options, run, u16 = _prepare("indexer_kl_loss", index_q, dict(
        sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count, layout=layout,
        id_mode=id_mode, backend=backend, strict_indices=strict_indices, num_threads=num_threads, stream=stream,
        deterministic=deterministic, a_operand_precision=a_operand_precision, l2_hints=l2_hints,
        start_stagger=start_stagger, gradients=gradients), uint16_as_bf16)
    return _forward(run, options, u16, index_q, weights, index_k, topk_indices, attn_score, cu_seqlens_q,
                    cu_seqlens_k, False, topk_logits)[0]


indexer_kl_loss.__doc__ += _RETURNS


@_options.documented("indexer_kl_loss_and_grad")
def indexer_kl_loss_and_grad(index_q, weights, index_k, topk_indices, attn_score, *, sm_scale, loss_coeff=1.0,
                             grad_loss=1.0, normalization_count=0, layout="bshd", id_mode="local",
                             cu_seqlens_q=None, cu_seqlens_k=None, out_dtype=None, backend=None,
                             strict_indices=False, deterministic=False, num_threads=0, stream=None,
                             a_operand_precision="auto", l2_hints="auto", start_stagger="auto",
                             forward_fusion="auto", uint16_as_bf16=False, topk_logits=None):
    """``(loss, d_index_q, d_weights, d_index_k)`` in one library call, for an
    indexer trained only by this loss.

    The inputs of :func:`indexer_backward` without ``index_score``; no P is
    passed or made. The loss is float32 of shape ``()`` (float64 with
    ``out_dtype="f64"``), not scaled by ``grad_loss``; the gradients as
    :func:`indexer_backward` returns them. On the cuda backend the call does
    not synchronise the host when a CUDA graph is being captured (BSHD and
    THD), so it can be captured. ``topk_logits`` as for
    :func:`indexer_kl_forward` (the backward recomputes its logits).
    """
    _check_arrays(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                  attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  topk_logits=topk_logits)
    options, run, u16 = _prepare("indexer_kl_loss_and_grad", index_q, dict(
        sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count, layout=layout,
        id_mode=id_mode, backend=backend, strict_indices=strict_indices, num_threads=num_threads, stream=stream,
        grad_loss=grad_loss, out_dtype=out_dtype, deterministic=deterministic,
        a_operand_precision=a_operand_precision, l2_hints=l2_hints, start_stagger=start_stagger,
        forward_fusion=forward_fusion), uint16_as_bf16)
    codes = options["out_dtype"] or ("f32",) * 3
    out = (run.alloc((), "f64" if codes == ("f64",) * 3 else "f32"),) + run.gradients(index_q, weights, index_k,
                                                                                      codes)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, loss=out[0],
                   d_index_q=out[1], d_weights=out[2], d_index_k=out[3], grad_loss_device=options["grad_loss"][1],
                   topk_logits=topk_logits)
    return run.call(_dsaib.indexer_kl_loss_and_grad, tensors, _options.library_kwargs(options), out, True,
                    dict(uint16_as_bf16=u16, out_uint16_as_bf16=True))


indexer_kl_loss_and_grad.__doc__ += _RETURNS


@_options.documented("attention_target")
def attention_target(query, kv, lse, topk_indices, *, sm_scale, lse_base="natural", normalize=True, layout="bshd",
                     id_mode="local", cu_seqlens_q=None, cu_seqlens_k=None, backend=None, strict_indices=False,
                     num_threads=0, stream=None, out=None, uint16_as_bf16=False):
    """The attention target ``T`` (attn_score) of the indexer loss from the main
    attention's tensors (docs/attention-target.md).

    For query row t and valid slot i with key row j::

        U_i = sum_h exp(sm_scale * query[t, h] . kv[j] - lse[t, h])     (lse_base="natural")
        U_i = sum_h exp2(sm_scale * log2(e) * query[t, h] . kv[j] - lse[t, h])   ("base2")
        T_i = U_i / sum_i' U_i'    (normalize=True; a row whose sum is 0 gives 0)

    and 0 at invalid slots. ``lse=None``: each head's softmax over the row's
    valid selected slots, ``lse[t, h] = log sum_i exp(sm_scale * query[t, h] .
    kv[j_i])`` computed by the library (Megatron-Core's sparse indexer loss;
    lse_base is then not used). ``query`` (B, S_q, Hq, Dqk) / (T_q, Hq, Dqk) and
    ``kv`` (B, S_kv, Dqk) / (T_k, Dqk) bf16 and contiguous, ``lse`` (B, S_q, Hq)
    / (T_q, Hq) float32 with any strides or None, ``topk_indices`` int32. ``sm_scale``
    is the main attention's softmax scale. The cuda backend takes Hq a multiple
    of 16 up to 128 and Dqk a multiple of 64 up to 576; the cpu backend (fp64)
    any sizes. ``out``: an optional float32 array shaped like topk_indices to
    write into. Returns attn_score, float32, shaped like topk_indices.
    """
    _check_arrays(query=query, kv=kv, topk_indices=topk_indices, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, **({} if lse is None else dict(lse=lse)))
    options, run, u16 = _prepare("attention_target", query, dict(
        sm_scale=sm_scale, lse_base=lse_base, normalize=normalize, layout=layout, id_mode=id_mode,
        backend=backend, strict_indices=strict_indices, num_threads=num_threads, stream=stream), uint16_as_bf16)
    if out is not None:
        _check_writable_out(out, "attn_score", "a float32 array shaped like topk_indices")
        _check_arrays(attn_score=out)
    allocated = out is None
    if allocated:
        out = run.alloc(_shape(topk_indices))
    tensors = dict(query=query, kv=kv, lse=lse, topk_indices=topk_indices, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, attn_score=out)
    return run.call(_dsaib.attention_target, tensors, _options.library_kwargs(options), (out,), allocated,
                    dict(uint16_as_bf16=u16))[0]


attention_target.__doc__ += _RETURNS


def reference_kl_loss(index_q, weights, index_k, topk_indices, attn_score, index_score, *, sm_scale,
                      loss_coeff=1.0, grad_loss=1.0, layout="bshd", id_mode="local", cu_seqlens_q=None,
                      cu_seqlens_k=None, normalization_count=0, recompute_p=True, uint16_as_bf16=False) -> float:
    """The loss whose gradient :func:`indexer_backward` computes, in fp64 on the
    host (host tensors only), as a Python float: the library's reference
    (dsaib::indexer_kl_loss).

    Loss = -c * sum_rows sum_valid max(T_i, eps) * log(max(P_i, eps)) with
    c = grad_loss * loss_coeff / N, P recomputed from index_q, weights and
    index_k when ``recompute_p`` (else taken from index_score). Arguments,
    shapes and errors as :func:`indexer_backward`.
    """
    _check_arrays(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                  attn_score=attn_score, index_score=index_score, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k)
    o = _options.check_each(sm_scale=sm_scale, loss_coeff=loss_coeff, normalization_count=normalization_count,
                            layout=layout, id_mode=id_mode)
    recompute_p = _bool_value("recompute_p", recompute_p)
    uint16_as_bf16 = _bool_value("uint16_as_bf16", uint16_as_bf16)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                   attn_score=attn_score, index_score=index_score, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k)
    return _dsaib.indexer_kl_loss(
        **_exported(tensors), recompute_p=recompute_p, uint16_as_bf16=uint16_as_bf16, **o,
        grad_loss=_host_grad_loss(grad_loss))


@_options.documented("indexer_topk")
def indexer_topk(index_q, weights, index_k, topk, *, starts=None, ends=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 layout="bshd", id_mode="local", order="logit_descending", causal_offset=None, strict_ranges=False,
                 return_logits=False, return_lengths=False, backend=None, stream=None, num_threads=0,
                 uint16_as_bf16=False, index_q_scale=None, index_k_scale=None, uint8_as_e4m3=False):
    """The lightning indexer's forward: each query row's ``topk`` keys with the
    largest logits ``I[t, s] = sum_h weights[t, h] * relu(index_q[t, h] . index_k[s])``
    among the keys it sees (include/dsaib/indexer_topk.hpp).

    ========  ===============  ==============  ======================
    argument  shape (BSHD)     shape (THD)     dtype
    ========  ===============  ==============  ======================
    index_q   (B, S_q, H, D)   (T_q, H, D)     bf16 or float8_e4m3fn
    weights   (B, S_q, H)      (T_q, H)        bf16 or float32
    index_k   (B, S_kv, D)     (T_k, D)        index_q's dtype
    starts    (B, S_q)         (T_q,)          int32 (optional)
    ends      (B, S_q)         (T_q,)          int32 (optional)
    ========  ===============  ==============  ======================

    float8 e4m3 inputs (cuda: D 128; ``uint8_as_e4m3=True`` reads uint8
    arrays as their codes, numpy having no float8) take the optional float32
    (or float64, read unrounded)
    ``index_q_scale`` ``(B, S_q, H)`` / ``(T_q, H)`` and ``index_k_scale``
    ``(B, S_kv)`` / ``(T_k,)``: ``I[t, s] = index_k_scale[s] * sum_h
    weights[t, h] * index_q_scale[t, h] * relu(index_q[t, h] . index_k[s])``.

    ``weights`` carry any scale (there is no sm_scale). Row t sees the keys
    ``[starts[t], ends[t])`` in its sequence's key coordinates (BSHD: positions
    0..S_kv of its batch row; THD: flat rows of index_k inside its sequence),
    or without starts/ends the causal keys ``[0, t + causal_offset + 1)``.
    Strided views are read as they are (the last dimension contiguous).

    Returns ``topk_indices`` (int32, ``(B, S_q, topk)`` / ``(T_q, topk)``,
    ids as ``id_mode`` says, in ``order``, -1 past each row's count); with
    ``return_logits`` and/or ``return_lengths`` a tuple ``(topk_indices,
    topk_logits, topk_lengths)`` of those asked for, in that order:
    ``topk_logits`` float32 shaped like topk_indices (-inf past the count),
    ``topk_lengths`` int32 ``(B, S_q)`` / ``(T_q,)``. Selection is exact and
    deterministic: logit descending, equal logits by id ascending, a NaN
    logit above +inf.
    """
    arrays = dict(index_q=index_q, weights=weights, index_k=index_k)
    arrays.update({n: x for n, x in (("starts", starts), ("ends", ends), ("index_q_scale", index_q_scale),
                                      ("index_k_scale", index_k_scale)) if x is not None})
    _check_arrays(**arrays, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    options, run, u16 = _prepare("indexer_topk", index_q, dict(
        topk=topk, layout=layout, id_mode=id_mode, order=order, causal_offset=causal_offset,
        strict_ranges=strict_ranges, return_logits=return_logits, return_lengths=return_lengths, backend=backend,
        num_threads=num_threads, stream=stream), uint16_as_bf16)
    rows = _shape(index_q)[:-2]
    out = (run.alloc(rows + (options["topk"],), "i32"),)
    logits = run.alloc(rows + (options["topk"],), "f32") if options["return_logits"] else None
    lengths = run.alloc(rows, "i32") if options["return_lengths"] else None
    out += tuple(x for x in (logits, lengths) if x is not None)
    tensors = dict(index_q=index_q, weights=weights, index_k=index_k, starts=starts, ends=ends,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, topk_indices=out[0], topk_logits=logits,
                   topk_lengths=lengths)
    tensors.update(index_q_scale=index_q_scale, index_k_scale=index_k_scale)
    out = run.call(_dsaib.indexer_topk, tensors, _options.library_kwargs(options), out, True,
                   dict(uint16_as_bf16=u16, uint8_as_e4m3=_bool_value("uint8_as_e4m3", uint8_as_e4m3)))
    return out if len(out) > 1 else out[0]


indexer_topk.__doc__ += _RETURNS
