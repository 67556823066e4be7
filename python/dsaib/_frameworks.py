"""DLPack and framework plumbing: what a tensor is (numpy, torch, cupy, jax, a
dsaib Buffer or any DLPack producer), where it lives, how the extension reads
it, and how outputs and the default stream are taken from its framework.

Inputs are read through DLPack. Outputs are allocated with the framework of
index_q (numpy, torch, cupy); for jax and any other DLPack producer they are
dsaib-owned Buffers (jax gets them wrapped as jax arrays, zero-copy).
"""

from __future__ import annotations

import numpy as _np

from . import _dsaib

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


def _is_capsule(x) -> bool:
    """A raw DLPack capsule (read once by the extension)."""
    return type(x).__name__ == "PyCapsule"


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
        if x is None and (name.startswith("cu_seqlens") or name in ("grad_loss", "topk_logits")):
            continue
        if not (hasattr(x, "__dlpack__") or isinstance(x, (_np.ndarray, _dsaib.Buffer))
                or _is_capsule(x)  # a raw DLPack capsule is taken too
                or _has_buffer(x)):  # and buffer-protocol objects (memoryview, array.array)
            raise TypeError(f"{name}: expected an array (numpy, torch, cupy, jax or a DLPack tensor), "
                            f"got {type(x).__name__}")
        if _is_capsule(x):
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
        if isinstance(x, _np.ndarray) and x.dtype.kind in "OSUV":
            # object, bytes, str or structured arrays: nanobind would only say
            # "incompatible function arguments"
            raise TypeError(f"{name}: expected an array of numbers, got dtype {x.dtype}")
        if isinstance(x, _np.ndarray) and not x.dtype.isnative:
            raise TypeError(f"{name}: expected native byte order, got dtype {x.dtype.str}")
        if getattr(getattr(x, "device", None), "type", None) == "meta":  # a torch tensor without memory
            raise TypeError(f"{name}: expected an array in memory (cpu or cuda), got a tensor on the meta device")
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
        return _np.empty(shape, dtype={"f32": _np.float32, "bf16": _np.uint16, "f64": _np.float64,
                                       "i32": _np.int32}[out_dtype])
    if fw == "torch":
        import torch

        dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f64": torch.float64, "i32": torch.int32}[out_dtype]
        return torch.empty(shape, dtype=dt, device=ref.device)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(int(device.split(":")[1]) if ":" in device else 0):
            return cupy.empty(shape, dtype={"f32": cupy.float32, "bf16": cupy.uint16, "f64": cupy.float64,
                                            "i32": cupy.int32}[out_dtype])
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


def _exported(tensors: dict) -> dict:
    """{name: _export(tensor)}: what one extension call reads (a torch capsule is
    consumed by the call, so each call gets its own)."""
    return {name: _export(x) for name, x in tensors.items()}


def _shape(x):
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"cannot allocate outputs like a {type(x).__name__} (it has no shape, e.g. a raw DLPack "
                        "capsule): pass the array itself, or out=(d_index_q, d_weights, d_index_k)")
    return tuple(int(s) for s in shape)

