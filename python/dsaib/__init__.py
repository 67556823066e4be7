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

import collections.abc
import math
import operator

import numpy as _np

from . import _dsaib

__all__ = [
    "indexer_backward",
    "indexer_kl_loss",
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


# ---- frameworks ---------------------------------------------------------------
#
# Inputs are read through DLPack. Outputs are allocated with the framework of
# index_q (numpy, torch, cupy); for jax and any other DLPack producer they are
# dsaib-owned Buffers (jax gets them wrapped as jax arrays, zero-copy).

_DL_CPU, _DL_CUDA, _DL_CUDA_MANAGED = 1, 2, 13


def _framework(x) -> str:
    """'numpy', 'torch', 'cupy', 'jax', 'dsaib' (a Buffer) or 'dlpack' (anything else)."""
    if isinstance(x, _np.ndarray):
        return "numpy"
    if isinstance(x, _dsaib.Buffer):
        return "dsaib"
    root = type(x).__module__.split(".")[0]
    if root == "torch":
        return "torch"
    if root == "cupy":
        return "cupy"
    if root in ("jax", "jaxlib"):
        return "jax"
    return "dlpack"


def _is_torch(x) -> bool:
    return _framework(x) == "torch"


def _device(x):
    """(kind, index) of a tensor: kind 'cpu' or 'cuda' (anything else is reported by the library)."""
    if _is_torch(x):
        return (x.device.type, x.device.index or 0)
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        return ("cpu", 0)  # buffer-protocol objects
    kind, index = dev()
    kind = int(kind)
    if kind in (_DL_CUDA, _DL_CUDA_MANAGED):
        return ("cuda", int(index))
    if kind == _DL_CPU:
        return ("cpu", 0)
    return ("dlpack-device-%d" % kind, int(index))


def _check_arrays(**arrays):
    """TypeError naming the argument for an input that is not a tensor (None, a
    list, a scalar) or a numpy array in non-native byte order, and ValueError for a
    numpy view whose byte strides are not whole elements, before anything else
    happens (the extension would only report "incompatible function arguments")."""
    seen_capsules = []
    for name, x in arrays.items():
        if x is None and (name.startswith("cu_seqlens") or name == "grad_loss"):
            continue
        if not (hasattr(x, "__dlpack__") or isinstance(x, (_np.ndarray, _dsaib.Buffer))
                or type(x).__name__ == "PyCapsule"  # a raw DLPack capsule is taken too
                or _has_buffer(x)):  # and buffer-protocol objects (memoryview, array.array)
            raise TypeError(f"{name}: expected an array (numpy, torch, cupy, jax or a DLPack tensor), "
                            f"got {type(x).__name__}")
        if type(x).__name__ == "PyCapsule":
            # The extension consumes a capsule (renaming it "used_dltensor") and takes only
            # unversioned ones ("dltensor"); a consumed one, a versioned or foreign one, or one
            # capsule given for two arguments would only get nanobind's "incompatible function
            # arguments".
            cname = _capsule_name(x)
            if cname in (b"used_dltensor", b"used_dltensor_versioned"):
                raise ValueError(f"{name}: expected an unused DLPack capsule, got one already consumed "
                                 "(a capsule can be read once: pass the tensor, or a new __dlpack__())")
            if cname != b"dltensor":
                raise TypeError(f"{name}: expected a DLPack capsule named 'dltensor' (unversioned: "
                                f"__dlpack__() without max_version, or pass the tensor), got a capsule "
                                f"named {cname.decode('utf-8', 'replace') if cname else None!r}")
            other = next((n for n, y in seen_capsules if y is x), None)
            if other is not None:
                raise ValueError(f"{name}: expected its own DLPack capsule, got the one given for {other} "
                                 "(a capsule can be read once: pass the tensor, or a new __dlpack__())")
            seen_capsules.append((name, x))
        if isinstance(x, _np.ndarray) and not x.dtype.isnative:
            raise TypeError(f"{name}: expected native byte order, got dtype {x.dtype.str}")
        if isinstance(x, _np.ndarray) and any(st % x.itemsize for st in x.strides):
            # DLPack strides count elements: such a view has none (nanobind would only
            # say "incompatible function arguments").
            raise ValueError(f"{name}: expected strides that are multiples of the element size "
                             f"({x.itemsize} bytes), got byte strides {x.strides}")


_PYCAPSULE_GET_NAME = None


def _capsule_name(capsule):
    """A PyCapsule's name (bytes; None for a nameless one), through the C API. The
    prototype is this module's own: ctypes.pythonapi's shared function object (whose
    restype/argtypes other code may set) is left as it is."""
    global _PYCAPSULE_GET_NAME
    if _PYCAPSULE_GET_NAME is None:
        import ctypes

        proto = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)
        _PYCAPSULE_GET_NAME = proto(("PyCapsule_GetName", ctypes.pythonapi))
    try:
        return _PYCAPSULE_GET_NAME(capsule)
    except ValueError:  # not a real capsule (an object whose type is merely named PyCapsule)
        return None


def _has_buffer(x) -> bool:
    if isinstance(x, (str, bytes, bytearray)):
        return False
    try:
        memoryview(x)
        return True
    except TypeError:
        return False


def _export(x):
    """What the extension reads: a DLPack capsule for torch (no stream synchronisation,
    no autograd), the array itself otherwise (the extension calls __dlpack__())."""
    if x is None:
        return None
    fw = _framework(x)
    if fw == "torch":
        x = x.detach()
        if x.device.type == "cuda":
            import torch

            with torch.cuda.device(x.device):
                return x.__dlpack__(stream=-1)  # -1: the producer must not synchronise
        return x.__dlpack__()
    if fw == "jax":
        x.block_until_ready()
    return x


def _alloc(fw, ref, shape, out_dtype, device):
    """A contiguous output of `shape` in framework `fw` on `device` ("cpu"/"cuda:N")."""
    shape = tuple(int(s) for s in shape)
    if fw == "numpy":
        return _np.empty(shape, dtype={"f32": _np.float32, "bf16": _np.uint16}[out_dtype])
    if fw == "torch":
        import torch

        dt = {"f32": torch.float32, "bf16": torch.bfloat16}[out_dtype]
        return torch.empty(shape, dtype=dt, device=ref.device)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(int(device.split(":")[1]) if ":" in device else 0):
            return cupy.empty(shape, dtype={"f32": cupy.float32, "bf16": cupy.uint16}[out_dtype])
    return _dsaib.empty(list(shape), out_dtype, device)


def _default_stream(fw, ref, device) -> int:
    """The stream the cuda backend runs on when none is given: the framework's current one."""
    if not device.startswith("cuda"):
        return 0
    if fw == "torch":
        import torch

        return int(torch.cuda.current_stream(ref.device).cuda_stream)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(int(device.split(":")[1])):
            return int(cupy.cuda.get_current_stream().ptr)
    return 0  # the legacy default stream


def _is_scalar(x) -> bool:
    return isinstance(x, (int, float, _np.integer, _np.floating)) and not isinstance(x, bool)


# ---- argument checks ----------------------------------------------------------
#
# What the extension's typed parameters would otherwise reject with nanobind's
# "incompatible function arguments" (which names no argument), or convert
# silently (float64 -> float32 overflow, float -> int truncation), is checked
# here, with messages in the library's style: "NAME: expected X, got Y".

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_UINTPTR_MAX = 2**64 - 1
_OUT_NAMES = ("d_index_q", "d_weights", "d_index_k")


def _is_bool(x) -> bool:
    return isinstance(x, (bool, _np.bool_))


def _type_name(x) -> str:
    return type(x).__name__


# The smallest magnitude that rounds to inf in float32: 2^128 - 2^103 (halfway
# between FLT_MAX and 2^128; ties go to the even significand, i.e. to inf).
_F32_OVERFLOW = 2.0**128 - 2.0**103


def _float_or_inf(x) -> float:
    """float(x), with a number beyond float64 (a huge int or Fraction) as +-inf,
    which is what float32 makes of it anyway."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _check_f32_finite(name: str, value: float) -> None:
    """ValueError with the C++ library's message for a value that is not finite
    once converted to float32 ("NAME: expected a finite value, got inf", as
    check_finite in core/validate.cpp prints it). Pure Python (no numpy or
    torch), so torch.compile traces it with symbolic floats. A finite value that
    overflows float32 (1e+300) reads as the library sees it: "got inf"."""
    if abs(value) < _F32_OVERFLOW:  # False for nan and +-inf (one comparison: traceable)
        return
    if math.isnan(value):
        text = "-nan" if math.copysign(1.0, value) < 0 else "nan"  # as glibc's ostream prints it
    else:
        text = "-inf" if value < 0 else "inf"
    raise ValueError(f"{name}: expected a finite value, got {text}")


def _f32_value(name, x) -> float:
    """A real number as the float the extension takes, which it converts to
    float32: rejects bools, non-numbers and values that are not finite in float32."""
    if _is_bool(x):
        raise TypeError(f"{name}: expected a real number, got bool {x!r}")
    if isinstance(x, (complex, _np.complexfloating)) or isinstance(x, str):
        raise TypeError(f"{name}: expected a real number, got {_type_name(x)} {x!r}")
    try:
        value = _float_or_inf(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number, got {_type_name(x)}") from None
    _check_f32_finite(name, value)
    return value


def _int_value(name, x, lo, hi, what, below=None) -> int:
    """An integer (int, numpy integer, anything with __index__; not bool, not float) in [lo, hi].
    below: the C++ library's "expected ..." text for a value under lo (its message then)."""
    if _is_bool(x):
        raise TypeError(f"{name}: expected an int, got bool {x!r}")
    try:
        value = operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {_type_name(x)} {x!r}") from None
    if value < lo and below:
        raise ValueError(f"{name}: expected {below}, got {value}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in {what}, got {value}")
    return value


def _stream_value(x) -> int:
    """An explicit cudaStream_t as an int in [0, 2^64-1]: an int (anything with __index__),
    or an object with __int__ such as numba's cuda.Stream; not bool, float or str."""
    if _is_bool(x) or isinstance(x, (float, str, bytes)) or not (
            hasattr(type(x), "__index__") or hasattr(type(x), "__int__")):
        raise TypeError(f"stream: expected an int (a cudaStream_t), got {_type_name(x)} {x!r}")
    try:
        value = operator.index(x)
    except TypeError:
        value = int(x)  # __int__ only (numba's cuda.Stream)
    if not 0 <= value <= _UINTPTR_MAX:
        raise ValueError(f"stream: expected an int in [0, 2^64-1] (a cudaStream_t), got {value}")
    return value


#: The C++ library's "expected" texts for negative counts (core/validate.cpp).
_NORMALIZATION_COUNT_BELOW = ">= 0 (0 = number of query tokens)"
_NUM_THREADS_BELOW = ">= 0 (0 = all hardware threads)"


def _grad_loss(x):
    """(value, tensor): a real number (not bool), or a tensor (checked by the extension:
    one float32 element on the backend's device)."""
    if _is_bool(x):
        raise TypeError(f"grad_loss: expected a real number or a one-element float32 tensor, got bool {x!r}")
    if _is_scalar(x):
        return _f32_value("grad_loss", x), None
    if hasattr(x, "__dlpack__") or type(x).__name__ == "PyCapsule":
        return 1.0, x
    raise TypeError(f"grad_loss: expected a real number or a one-element float32 tensor, got {_type_name(x)}")


def _host_grad_loss(x) -> float:
    """grad_loss as indexer_backward takes it (a real number, or a one-element
    float32 tensor), read on the host for the loss (host tensors only)."""
    value, tensor = _grad_loss(x)
    if tensor is None:
        return value
    _check_arrays(grad_loss=tensor)
    try:
        arr = _np.from_dlpack(tensor) if hasattr(tensor, "__dlpack__") else None
    except (BufferError, RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"grad_loss: expected a one-element float32 tensor in host memory, got one numpy "
                         f"cannot read ({e})") from None
    if arr is None:
        raise TypeError("grad_loss: expected a real number or a one-element float32 tensor with __dlpack__, "
                        "got a raw DLPack capsule")
    if arr.dtype != _np.float32:
        raise TypeError(f"grad_loss: expected dtype float32, got dtype {arr.dtype}")
    if arr.size != 1:
        raise ValueError(f"grad_loss: expected a one-element tensor, got {arr.size} elements")
    value = float(arr.reshape(-1)[0])
    _check_f32_finite("grad_loss", value)
    return value


def _check_out(out) -> tuple:
    """out as a tuple of three writable arrays."""
    # A sequence (tuple, list, ...), as docs/python.md says: an iterator or generator is
    # refused rather than consumed.
    if isinstance(out, (str, bytes)) or not isinstance(out, collections.abc.Sequence):
        raise TypeError(f"out: expected a tuple (d_index_q, d_weights, d_index_k), got {_type_name(out)}")
    out = tuple(out)
    if len(out) != 3:
        raise ValueError(f"out: expected (d_index_q, d_weights, d_index_k), got {len(out)} items")
    for name, o in zip(_OUT_NAMES, out):
        if o is None:
            raise TypeError(f"out: expected 3 arrays (d_index_q, d_weights, d_index_k), got None for {name}")
        if isinstance(o, _np.ndarray):
            read_only = not o.flags.writeable
        elif hasattr(o, "__dlpack__") or _framework(o) == "torch":
            read_only = False  # a read-only DLPack export is reported by the extension
        else:
            try:
                read_only = memoryview(o).readonly
            except TypeError:
                raise TypeError(f"out: expected 3 arrays (d_index_q, d_weights, d_index_k), got "
                                f"{_type_name(o)} for {name}") from None
        if read_only:
            raise ValueError(f"out: expected writable arrays, got a read-only {name}")
        if _framework(o) == "torch" and o.requires_grad:
            # Written in place behind autograd's back: torch itself refuses that for such tensors.
            raise ValueError(f"out: expected tensors that do not require grad (they are written in place), "
                             f"got {name} with requires_grad=True")
    if any(_framework(o) == "jax" for o in out):
        raise TypeError("out: jax arrays are immutable; leave out=None to get new jax arrays")
    return out


def _bool_value(name, x) -> bool:
    """A flag: bool or numpy bool only (a str such as "false" would be truthy)."""
    if not _is_bool(x):
        raise TypeError(f"{name}: expected a bool, got {_type_name(x)} {x!r}")
    return bool(x)


def _option_str(name, x, words) -> str:
    """An option word as the str the extension parses (it raises ValueError for a bad word)."""
    if not isinstance(x, str):
        raise TypeError(f"{name}: expected a str ({words}), got {_type_name(x)} {x!r}")
    return x


def _cuda_workspace_bytes(dk_elements: int, dk_bf16: bool, deterministic: bool) -> int:
    """Scratch bytes of a cuda call (indexer_backward_workspace_size in
    include/dsaib/indexer_backward.hpp): deterministic, the int64 fixed-point dK
    (8 bytes per d_index_k element, rounded up to 256) and a 16-byte bound; else
    the fp32 dK accumulator for a bf16 d_index_k (4 bytes per element); else 0."""
    if deterministic:
        return (dk_elements * 8 + 255) // 256 * 256 + 16
    return max(dk_elements, 1) * 4 if dk_bf16 else 0


def _a_operand(a_operand_precision) -> str:
    """The option as the str the extension parses (it raises ValueError for a bad word)."""
    return _option_str("a_operand_precision", a_operand_precision, '"auto", "bf16x2" or "bf16"')


def _shape(x):
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"cannot allocate outputs like a {type(x).__name__} (it has no shape, e.g. a raw DLPack "
                        "capsule): pass the array itself, or out=(d_index_q, d_weights, d_index_k)")
    return tuple(int(s) for s in shape)


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
      out_dtype: ``"f32"`` or ``"bf16"`` for outputs allocated here
        (numpy and cupy bf16 outputs are uint16 bit patterns).
      out: optional ``(d_index_q, d_weights, d_index_k)`` to write into:
        contiguous, shaped like index_q, weights, index_k, float32 or bf16,
        on the inputs' device. They are returned.
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
        run twice). ``"bf16"``: one bf16 term, ~30% faster at DeepSeek shapes,
        but it adds ~1.3-1.6e-3 relative RMS error to d_index_q and d_index_k
        (fine for bf16 outputs, whose budget is 3e-3; not for float32 outputs
        held to 1e-3). ``"auto"`` (default): ``"bf16x2"`` when d_index_q or
        d_index_k is float32, else ``"bf16"``. d_weights never depends on it;
        the cpu backend ignores it (float64 throughout). Anything else is a
        ValueError.

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
    _check_arrays(index_q=index_q, weights=weights, index_k=index_k, topk_indices=topk_indices,
                  attn_score=attn_score, index_score=index_score, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k)
    if out_dtype not in ("f32", "bf16"):
        raise ValueError(f'out_dtype: expected "f32" or "bf16", got {out_dtype!r}')
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
    normalization_count = _int_value("normalization_count", normalization_count, 0, _INT64_MAX, "[0, 2^63-1]",
                                     _NORMALIZATION_COUNT_BELOW)
    num_threads = _int_value("num_threads", num_threads, 0, _INT32_MAX, "[0, 2^31-1]", _NUM_THREADS_BELOW)
    if out is not None:
        out = _check_out(out)
        _check_arrays(**dict(zip(_OUT_NAMES, out)))
    if grad_loss_tensor is not None:
        _check_arrays(grad_loss=grad_loss_tensor)
    fw = _framework(index_q)
    kind, index = _device(index_q)
    device = f"cuda:{index}" if kind == "cuda" else kind
    if backend is None:
        backend = "cuda" if kind == "cuda" else "cpu"
    explicit_stream = stream is not None
    if explicit_stream:
        stream = _stream_value(stream)
    if explicit_stream and backend == "cpu" and stream != 0:
        raise ValueError(f"stream: expected None or 0 on the cpu backend (it runs on host threads), got {stream!r}")
    if stream is None:
        stream = _default_stream(fw, index_q, device) if backend == "cuda" else 0

    out_uint16_as_bf16 = bool(uint16_as_bf16)
    allocated = out is None
    if out is None:
        out = (
            _alloc(fw, index_q, _shape(index_q), out_dtype, device),
            _alloc(fw, index_q, _shape(weights), out_dtype, device),
            _alloc(fw, index_q, _shape(index_k), out_dtype, device),
        )
        # numpy/cupy bf16 outputs allocated here are uint16 bit patterns; this
        # does not change how uint16 *inputs* are read.
        out_uint16_as_bf16 = True

    workspace = None
    if fw == "torch" and backend == "cuda" and device.startswith("cuda") and _framework(out[2]) == "torch":
        import torch

        # The dK accumulator (indexer_backward_workspace_size), from torch's caching
        # allocator so it is stream-ordered and CUDA-graph safe.
        nbytes = _cuda_workspace_bytes(int(index_k.numel()), str(out[2].dtype) == "torch.bfloat16", deterministic)
        if nbytes:
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=index_q.device)

    if fw == "torch" and backend == "cuda" and explicit_stream:
        import torch

        if int(stream) != int(torch.cuda.current_stream(index_q.device).cuda_stream):
            ext = torch.cuda.ExternalStream(int(stream), device=index_q.device)
            for t in (*(out if allocated else ()), workspace):
                if t is not None:
                    t.record_stream(ext)

    _dsaib.indexer_backward(
        _export(index_q), _export(weights), _export(index_k), _export(topk_indices), _export(attn_score),
        _export(index_score), _export(cu_seqlens_q), _export(cu_seqlens_k),
        _export(out[0]), _export(out[1]), _export(out[2]),
        layout, id_mode, backend, float(sm_scale), float(loss_coeff), grad_loss_value, _export(grad_loss_tensor),
        int(normalization_count), strict_indices, deterministic,
        int(stream), int(num_threads), _export(workspace), uint16_as_bf16, out_uint16_as_bf16,
        _a_operand(a_operand_precision),
    )
    if fw == "jax" and allocated:
        import jax.dlpack

        if backend == "cuda":
            _dsaib.stream_synchronize(int(stream))
        out = tuple(jax.dlpack.from_dlpack(o) for o in out)
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
    normalization_count = _int_value("normalization_count", normalization_count, 0, _INT64_MAX, "[0, 2^63-1]",
                                     _NORMALIZATION_COUNT_BELOW)
    return _dsaib.indexer_kl_loss(
        _export(index_q), _export(weights), _export(index_k), _export(topk_indices), _export(attn_score),
        _export(index_score), _export(cu_seqlens_q), _export(cu_seqlens_k), layout, id_mode, float(sm_scale), float(loss_coeff),
        float(grad_loss), int(normalization_count), recompute_p, uint16_as_bf16,
    )
