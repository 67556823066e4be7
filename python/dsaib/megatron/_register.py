"""register() and unregister(): "dsaib" added to Megatron-Core's closed sets of
DSA kernel backends at run time, with no file of Megatron changed.

Megatron-Core has no registry: the backend names are closed in
``dsa_kernels._BACKEND_MODULE_NAME_BY_BACKEND`` (name -> module imported for
the hooks), ``megatron.core.utils._VALID_DSA_KERNEL_BACKENDS`` and the
validation that ``TransformerConfig.__post_init__`` calls
(``_validate_dsa_kernel_backend_dependencies``, imported by name into
``transformer_config``), and the ``Literal`` type of the config field, from
which ``megatron.training``'s command line takes its choices. Each is
changed here and put back by unregister(); nothing else is touched.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing

from . import _hooks

#: The megatron-core releases whose DSA dispatch this backend was checked against.
SUPPORTED_VERSIONS = ("0.19.0", "0.19.1", "0.19.2")

NAME = "dsaib"
_MODULE = "dsaib.megatron"
_ORDERS = ("logit_descending", "id_ascending")

# What register() replaced, to be put back by unregister(): (object, attribute, old value).
_SAVED: list = []


def megatron_version() -> str:
    """The installed megatron-core's release, e.g. "0.19.2" (no VCS suffix)."""
    try:
        info = importlib.import_module("megatron.core.package_info")
    except ImportError as e:
        raise ImportError("dsaib.megatron.register: expected megatron-core "
                          f"{' or '.join(SUPPORTED_VERSIONS)} to be importable, got {e}") from e
    return ".".join(str(v) for v in info.VERSION[:3]) + str(info.VERSION[3])


def _check_version():
    found = megatron_version()
    if found not in SUPPORTED_VERSIONS:
        raise RuntimeError(f"dsaib.megatron.register: expected megatron-core {', '.join(SUPPORTED_VERSIONS)} (the "
                           f"releases whose DSA kernel dispatch it was checked against), got megatron-core {found}")
    return found


def _check_settings(attention, order):
    # a str test first: an unhashable value (a list) cannot be looked up in a dict
    if attention is not None and (not isinstance(attention, str) or attention not in _hooks._ATTENTION_MODULES):
        raise ValueError(f'attention: expected "cudnn", "tilelang" or None (Megatron\'s torch code), got {attention!r}')
    if order is not None and (not isinstance(order, str) or order not in _ORDERS):
        raise ValueError(f'order: expected "logit_descending", "id_ascending" or None, got {order!r}')
    if order is None:
        # FlashMLA's sparse kernels, behind the cuDNN backend, read each row's ids by id.
        order = "id_ascending" if attention == "cudnn" else "logit_descending"
    return attention, order


def _replace(obj, attr, value):
    _SAVED.append((obj, attr, getattr(obj, attr)))
    setattr(obj, attr, value)


def _field_with_dsaib(field_type):
    names = typing.get_args(field_type)
    if typing.get_origin(field_type) is not typing.Literal or not names:
        raise RuntimeError(f"dsaib.megatron.register: expected TransformerConfig.dsa_kernel_backend to be a Literal "
                           f"of names, got {field_type!r}")
    return typing.Literal[tuple(names) + (NAME,)]


def register(*, attention=None, order=None) -> None:
    """Makes ``TransformerConfig(dsa_kernel_backend="dsaib")`` (and the
    command line's ``--dsa-kernel-backend dsaib``) select dsaib for the DSA
    indexer: its top-k and its sparse KL loss with gradients.

    attention: the backend of the main sparse attention, ``"cudnn"``,
    ``"tilelang"`` or ``None`` (Megatron's torch code).
    order: the order of each row's ids, ``"logit_descending"``,
    ``"id_ascending"`` or ``None`` (``"id_ascending"`` with ``attention="cudnn"``,
    whose FlashMLA kernels read them so; else ``"logit_descending"``, the
    order of Megatron's torch top-k).

    Calling it again changes the settings; :func:`unregister` undoes it.
    Raises RuntimeError naming the version found for a megatron-core other
    than :data:`SUPPORTED_VERSIONS`.
    """
    attention, order = _check_settings(attention, order)
    _check_version()
    kernels = importlib.import_module("megatron.core.transformer.experimental_attention_variant.dsa_kernels")
    utils = importlib.import_module("megatron.core.utils")
    config_module = importlib.import_module("megatron.core.transformer.transformer_config")
    for obj, attr in ((kernels, "_BACKEND_MODULE_NAME_BY_BACKEND"), (utils, "_VALID_DSA_KERNEL_BACKENDS"),
                      (utils, "_validate_dsa_kernel_backend_dependencies"),
                      (config_module, "_validate_dsa_kernel_backend_dependencies")):
        if not hasattr(obj, attr):
            raise RuntimeError(f"dsaib.megatron.register: expected {obj.__name__}.{attr} (megatron-core "
                               f"{megatron_version()}), got no such name")
    _hooks.SETTINGS.update(attention=attention, order=order)
    if _SAVED:
        return  # already registered: only the settings change
    fields = {f.name: f for f in dataclasses.fields(config_module.TransformerConfig)}
    field = fields.get("dsa_kernel_backend")
    if field is None:
        raise RuntimeError("dsaib.megatron.register: expected TransformerConfig.dsa_kernel_backend, got no such field")
    widened = _field_with_dsaib(field.type)
    original_validate = config_module._validate_dsa_kernel_backend_dependencies

    def validate(dsa_kernel_backend):
        if dsa_kernel_backend != NAME:
            return original_validate(dsa_kernel_backend)
        _validate_dsaib()

    _replace(kernels, "_BACKEND_MODULE_NAME_BY_BACKEND", {**kernels._BACKEND_MODULE_NAME_BY_BACKEND, NAME: _MODULE})
    _replace(utils, "_VALID_DSA_KERNEL_BACKENDS", tuple(utils._VALID_DSA_KERNEL_BACKENDS) + (NAME,))
    _replace(utils, "_validate_dsa_kernel_backend_dependencies", validate)
    _replace(config_module, "_validate_dsa_kernel_backend_dependencies", validate)
    _replace(field, "type", widened)
    annotations = config_module.TransformerConfig.__annotations__
    _SAVED.append((annotations, None, annotations["dsa_kernel_backend"]))
    annotations["dsa_kernel_backend"] = widened
    # A backend module Megatron cached under another selection is dropped so
    # that the next lookup imports the selected one.
    _replace(kernels, "_BACKEND", None)
    _replace(kernels, "_BACKEND_SELECTION", None)


def _validate_dsaib():
    """The config's check for dsa_kernel_backend="dsaib": on a machine with a
    GPU, dsaib's cuda backend must be there (else the first step would fail);
    the delegated attention backend's own packages must be there."""
    import torch

    import dsaib

    if torch.cuda.is_available() and not dsaib.cuda_backend_available():
        raise ValueError("dsa_kernel_backend=dsaib: expected dsaib built with its cuda backend on this GPU machine "
                         f"(pip install . -C cmake.define.DSAIB_ENABLE_CUDA=ON), got cuda_compiled()="
                         f"{dsaib.cuda_compiled()}, cuda_backend_available()=False")
    attention = _hooks.SETTINGS["attention"]
    if attention is not None:
        utils = importlib.import_module("megatron.core.utils")
        original = next(old for obj, attr, old in _SAVED if obj is utils and attr == "_validate_dsa_kernel_backend_dependencies")
        original(attention)


def unregister() -> None:
    """Puts back every name register() changed (a no-op when not registered)."""
    while _SAVED:
        obj, attr, old = _SAVED.pop()
        if attr is None:
            obj["dsa_kernel_backend"] = old
        else:
            setattr(obj, attr, old)
    _hooks.SETTINGS.update(attention=None, order="logit_descending")


def registered() -> bool:
    """Whether register() is in effect."""
    return bool(_SAVED)
