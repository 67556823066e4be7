"""Argument coercion: what the extension's typed parameters would otherwise
reject with nanobind's "incompatible function arguments" (which names no
argument), or convert silently (float -> int truncation, a str flag taken as
true), is checked here, with messages in the library's style: "NAME: expected
X, got Y". Values the library itself validates (finite scales, counts >= 0)
are passed through to it, so that its messages are the only ones. The table
of options that uses these is _options.py.
"""

from __future__ import annotations

import collections.abc
import math
import operator
import struct

import numpy as _np

from ._frameworks import _check_arrays, _framework, _is_capsule

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_UINTPTR_MAX = 2**64 - 1
_OUT_NAMES = ("d_index_q", "d_weights", "d_index_k")


def _is_scalar(x) -> bool:
    return isinstance(x, (int, float, _np.integer, _np.floating)) and not isinstance(x, bool)


def _is_bool(x) -> bool:
    return isinstance(x, (bool, _np.bool_))


def _type_name(x) -> str:
    return type(x).__name__


def _float_or_inf(x) -> float:
    """float(x), with a number beyond float64 (a huge int or Fraction) as +-inf,
    which is what float32 makes of it anyway."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _f32_value(name, x) -> float:
    """A real number as the float the extension takes, which it converts to
    float32: rejects bools and non-numbers. Whether it is finite in float32 is
    the library's check (1e300 reaches it as inf: "NAME: expected a finite
    value, got inf")."""
    if _is_bool(x):
        raise TypeError(f"{name}: expected a real number, got bool {x!r}")
    if isinstance(x, (complex, _np.complexfloating)) or isinstance(x, str):
        raise TypeError(f"{name}: expected a real number, got {_type_name(x)} {x!r}")
    try:
        return _float_or_inf(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number, got {_type_name(x)}") from None


def _f32_round(x: float) -> float:
    """x rounded to float32: the value the library applies for a float option
    (sm_scale, loss_coeff), which a float64 computation beside it must use too;
    +-inf beyond float32's range, nan as nan."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _finite_f32(name, x) -> float:
    """A real number as float32 (rounded), finite there: the library's check and
    message for a scale ("NAME: expected a finite value, got inf"), for a value
    the torch layer uses before (or instead of) the library."""
    value = _f32_round(_f32_value(name, x))
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite value, got {value}")
    return value


def _int_value(name, x, lo, hi, what) -> int:
    """An integer (int, numpy integer, anything with __index__; not bool, not float)
    in [lo, hi], the range of the extension's C type; `what` is the range the
    library takes, which it checks itself (a negative count is its error)."""
    if _is_bool(x):
        raise TypeError(f"{name}: expected an int, got bool {x!r}")
    try:
        value = operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {_type_name(x)} {x!r}") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in {what}, got {value}")
    return value


def _normalization_count(x) -> int:
    return _int_value("normalization_count", x, _INT64_MIN, _INT64_MAX, "[0, 2^63-1]")


def _num_threads(x) -> int:
    return _int_value("num_threads", x, _INT32_MIN, _INT32_MAX, "[0, 2^31-1]")


def _stream_value(x) -> int:
    """An explicit cudaStream_t as an int in [0, 2^64-1]: an int (anything with __index__),
    an object with __int__ such as numba's cuda.Stream, or a torch stream (its
    cuda_stream); not bool, float or str."""
    if _framework(x) == "torch" and hasattr(x, "cuda_stream"):
        x = x.cuda_stream
    # A real number that is not an integer (numpy's float32, a 0-d float tensor)
    # has __int__ too, but truncating it to a stream is never meant.
    not_integral = hasattr(x, "dtype") and str(getattr(x, "dtype")).rsplit(".", 1)[-1].startswith(
        ("float", "bfloat", "complex"))
    if _is_bool(x) or isinstance(x, (float, complex, str, bytes)) or not_integral or not (
            hasattr(type(x), "__index__") or hasattr(type(x), "__int__")):
        raise TypeError(f"stream: expected an int (a cudaStream_t), got {_type_name(x)} {x!r}")
    try:
        value = operator.index(x)
    except TypeError:
        value = int(x)  # __int__ only (numba's cuda.Stream)
    if not 0 <= value <= _UINTPTR_MAX:
        raise ValueError(f"stream: expected an int in [0, 2^64-1] (a cudaStream_t), got {value}")
    return value


def _grad_loss(x):
    """(value, tensor): a real number (not bool), or a tensor (checked by the extension:
    one float32 element on the backend's device)."""
    if _is_bool(x):
        raise TypeError(f"grad_loss: expected a real number or a one-element float32 tensor, got bool {x!r}")
    if _is_scalar(x):
        return _f32_value("grad_loss", x), None
    if hasattr(x, "__dlpack__") or _is_capsule(x):
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
    return float(arr.reshape(-1)[0])  # the library checks that it is finite


def _check_writable_out(o, name, expected) -> None:
    """One array given as out (called `name` in messages): writable, and not a
    torch tensor that requires grad or a jax array. `expected` says what out
    should be, for the message of a wrong type."""
    if o is None:
        raise TypeError(f"out: expected {expected}, got None for {name}")
    if isinstance(o, _np.ndarray):
        read_only = not o.flags.writeable
    elif hasattr(o, "__dlpack__") or _framework(o) == "torch":
        read_only = False  # a read-only DLPack export is reported by the extension
    else:
        try:
            read_only = memoryview(o).readonly
        except TypeError:
            raise TypeError(f"out: expected {expected}, got {_type_name(o)} for {name}") from None
    if read_only:
        raise ValueError(f"out: expected writable arrays, got a read-only {name}")
    if _framework(o) == "torch" and o.requires_grad:
        # Written in place behind autograd's back: torch itself refuses that for such tensors.
        raise ValueError(f"out: expected tensors that do not require grad (they are written in place), "
                         f"got {name} with requires_grad=True")
    if _framework(o) == "jax":
        raise TypeError("out: jax arrays are immutable; leave out=None to get new jax arrays")


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
        _check_writable_out(o, name, "3 arrays (d_index_q, d_weights, d_index_k)")
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
