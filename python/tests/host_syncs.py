"""Counting a call's host synchronisations, for the tests.

A dsaib call can make the host wait for a GPU in two places:

* in torch, when the Python layer reads device data (``.item()``, ``bool()``,
  ``.nonzero()``, ``.tolist()``, a copy to the host);
* in the library, whose validation copies cu_seqlens (THD) and, with
  strict_indices, the ids to the host and waits for the copy; the extension
  counts the CUDA runtime's blocking calls made inside it
  (``_dsaib.host_waits()``, a CUDA build linked with ``--wrap``).

:class:`HostSyncs` counts both, and the library calls (``_dsaib.library_calls()``:
each validates once, so on a GPU each THD call waits twice, once per
cu_seqlens tensor). torch's host reads are counted by kind with a dispatch mode
and a wrapper of ``Tensor.tolist`` (which does not dispatch on CPU tensors), on
any device: on CPU tensors they are the reads that would be synchronisations
were the tensors on a GPU. On CUDA, torch's own count of its synchronisations
(``torch.cuda.set_sync_debug_mode("warn")``) is taken beside it.
"""
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsaib import _dsaib

_SCALAR = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default"}
_DATA_DEPENDENT = {"aten.nonzero.default", "aten.masked_select.default", "aten.unique_consecutive.default",
                   "aten._unique2.default", "aten.unique_dim.default", "aten.repeat_interleave.Tensor"}
_COPIES = {"aten._to_copy.default", "aten.copy_.default", "aten.to.dtype_layout", "aten.to.device"}


def _device_of(x):
    return x.device if isinstance(x, torch.Tensor) else None


class _Reads(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts
        self.quiet = 0  # inside a counted tolist(): its own copy to the host is not counted again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if self.quiet:
            return out
        if name in _SCALAR:
            self.counts["scalar"] += 1
        elif name in _DATA_DEPENDENT:
            self.counts["data_dependent"] += 1
        elif name in _COPIES:
            src = _device_of(args[1] if name == "aten.copy_.default" else args[0])
            dst = _device_of(args[0] if name == "aten.copy_.default" else out)
            if src is not None and dst is not None and src.type != "cpu" and dst.type == "cpu":
                self.counts["to_host"] += 1
        return out


class HostSyncs:
    """``with HostSyncs() as s: ...`` then ``s.library_calls``, ``s.library_waits``,
    ``s.torch_reads`` (dict by kind; ``s.torch_total`` their sum) and, on CUDA,
    ``s.torch_syncs`` (torch's sync-debug warnings)."""

    def __init__(self, cuda=None):
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.torch_reads = dict(scalar=0, data_dependent=0, to_host=0, tolist=0)

    def __enter__(self):
        self._calls, self._waits = _dsaib.library_calls(), _dsaib.host_waits()
        self._mode = _Reads(self.torch_reads)
        self._tolist = torch.Tensor.tolist
        mode, original, counts = self._mode, self._tolist, self.torch_reads

        def tolist(t, *a, **kw):
            counts["tolist"] += 1
            mode.quiet += 1
            try:
                return original(t, *a, **kw)
            finally:
                mode.quiet -= 1

        torch.Tensor.tolist = tolist
        self._warnings = None
        if self.cuda:
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self._debug_mode)
            # torch's reports of a synchronising call ("called a synchronizing CUDA
            # operation"), not the one-time notice that the debug mode is a prototype
            self.torch_sync_messages = [str(w.message) for w in self._caught
                                        if "called a synchronizing" in str(w.message)]
            self.torch_syncs = len(self.torch_sync_messages)
            self._warnings.__exit__(*exc)
        self.library_calls = _dsaib.library_calls() - self._calls
        self.library_waits = _dsaib.host_waits() - self._waits
        return False

    @property
    def torch_total(self):
        return sum(self.torch_reads.values())
