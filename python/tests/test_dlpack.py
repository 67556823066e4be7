"""Any DLPack producer: a plain __dlpack__ object (CPU, runs everywhere), cupy and jax (skipped when absent)."""
import numpy as np
import pytest

import dsaib
from conftest import make_problem, numpy_reference

SM = 0.125


class Producer:
    """A minimal DLPack producer around a numpy array (no buffer protocol, not numpy)."""

    def __init__(self, a):
        self._a = np.ascontiguousarray(a)
        self.shape = self._a.shape

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return self._a.__dlpack__()

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_generic_producer_gets_buffers_back():
    p = make_problem(0)
    prod = {k: Producer(v) for k, v in p.items()}
    got = dsaib.indexer_backward(**prod, sm_scale=SM, uint16_as_bf16=True)
    for g, w in zip(got, numpy_reference(p, SM)):
        assert isinstance(g, dsaib.Buffer)
        assert g.shape == w.shape and g.dtype == "f32" and g.device == "cpu"
        assert g.__dlpack_device__() == (1, 0)
        a = np.from_dlpack(g)
        assert a.dtype == np.float32 and a.shape == w.shape
        np.testing.assert_allclose(a.astype(np.float64), w, rtol=1e-5, atol=1e-7)
        # every export is a fresh capsule over the same memory
        assert np.from_dlpack(g).ctypes.data == a.ctypes.data


def test_buffers_as_outputs_and_bf16_buffers():
    p = make_problem(1)
    out = tuple(dsaib._dsaib.empty(list(p[n].shape), "bf16", "cpu") for n in ("index_q", "weights", "index_k"))
    got = dsaib.indexer_backward(**p, sm_scale=SM, uint16_as_bf16=True, out=out)
    assert all(g is o for g, o in zip(got, out))
    assert "dtype=bf16" in repr(out[0]) and out[1].shape == p["weights"].shape
    try:  # numpy cannot import bf16 through DLPack; jax can
        import jax
        import jax.numpy as jnp
    except ImportError:
        jax = None
    if jax is not None:
        want = dsaib.indexer_backward(**p, sm_scale=SM, uint16_as_bf16=True, out_dtype="bf16")
        for o, w in zip(out, want):
            bits = jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(o), jnp.uint16)
            np.testing.assert_array_equal(np.asarray(bits), w)
    with pytest.raises(ValueError, match=r'^dtype: expected "f32", "bf16", "f64" or "i32", got "f16"$'):
        dsaib._dsaib.empty([2], "f16", "cpu")
    f64 = dsaib._dsaib.empty([2, 3], "f64", "cpu")  # the cpu backend's unrounded outputs
    assert np.from_dlpack(f64).dtype == np.float64 and np.from_dlpack(f64).shape == (2, 3)
    with pytest.raises(ValueError, match=r'^device: expected "cpu" or "cuda:N", got "tpu"$'):
        dsaib._dsaib.empty([2], "f32", "tpu")


def test_dlpack_capsule_inputs():
    # Raw capsules carry no shape the Python layer can read before the call: they need out=.
    p = make_problem(2)
    caps = {k: v.__dlpack__() for k, v in p.items()}
    with pytest.raises(TypeError, match="out="):
        dsaib.indexer_backward(**caps, sm_scale=SM, uint16_as_bf16=True)
    caps = {k: v.__dlpack__() for k, v in p.items()}
    out = tuple(np.empty(p[n].shape, np.float32) for n in ("index_q", "weights", "index_k"))
    got = dsaib.indexer_backward(**caps, sm_scale=SM, uint16_as_bf16=True, out=out)
    for g, w in zip(got, numpy_reference(p, SM)):
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=1e-5, atol=1e-7)


# --- cupy (CUDA) -------------------------------------------------------------

def _cupy():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("cupy: no CUDA device")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cupy: no CUDA device ({e})")
    if not dsaib.cuda_backend_available():
        pytest.skip("dsaib cuda backend not available (CPU-only build or no sm_90 device)")
    return cupy


def test_cupy_inputs_run_on_cupy_current_stream_and_return_cupy():
    cupy = _cupy()
    p = make_problem(3)
    want = dsaib.indexer_backward(**p, sm_scale=SM, uint16_as_bf16=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cp = {k: cupy.asarray(v) for k, v in p.items()}
        got = dsaib.indexer_backward(**cp, sm_scale=SM, uint16_as_bf16=True)  # backend cuda, cupy's stream
        assert all(isinstance(g, cupy.ndarray) for g in got)
        host = [cupy.asnumpy(g, stream=stream) for g in got]
        stream.synchronize()
    for h, w in zip(host, want):
        np.testing.assert_allclose(h, w, rtol=2e-3, atol=2e-4 * np.abs(w).max())
    bf = dsaib.indexer_backward(**cp, sm_scale=SM, uint16_as_bf16=True, out_dtype="bf16")
    assert all(b.dtype == cupy.uint16 for b in bf)


# --- jax ---------------------------------------------------------------------

def _jax_device(kind):
    jax = pytest.importorskip("jax")
    try:
        devs = jax.devices(kind)
    except RuntimeError:
        pytest.skip(f"jax: no {kind} device")
    if not devs:
        pytest.skip(f"jax: no {kind} device")
    return jax, devs[0]


def _jax_problem(jax, dev, p):
    import jax.numpy as jnp

    out = {}
    for k, v in p.items():
        if k in ("index_q", "index_k"):
            v = jnp.asarray(dsaib.bf16_to_f32(v)).astype(jnp.bfloat16)  # exact: the values are on the bf16 grid
        out[k] = jax.device_put(v, dev)
    return out


def test_jax_cpu_inputs_return_jax_arrays():
    jax, dev = _jax_device("cpu")
    p = make_problem(4)
    got = dsaib.indexer_backward(**_jax_problem(jax, dev, p), sm_scale=SM)
    for g, w in zip(got, numpy_reference(p, SM)):
        assert isinstance(g, jax.Array) and g.dtype == np.float32
        np.testing.assert_allclose(np.asarray(g).astype(np.float64), w, rtol=1e-5, atol=1e-7)


def test_jax_gpu_inputs_return_jax_arrays():
    jax, dev = _jax_device("gpu")
    if not dsaib.cuda_backend_available():
        pytest.skip("dsaib cuda backend not available")
    p = make_problem(5)
    want = numpy_reference(p, SM)
    jp = _jax_problem(jax, dev, p)
    got = dsaib.indexer_backward(**jp, sm_scale=SM)
    for g, w in zip(got, want):
        assert isinstance(g, jax.Array) and list(g.devices())[0].platform == "gpu"
        np.testing.assert_allclose(np.asarray(g).astype(np.float64), w, rtol=2e-3, atol=2e-4 * np.abs(w).max())
    bf = dsaib.indexer_backward(**jp, sm_scale=SM, out_dtype="bf16")
    import jax.numpy as jnp

    assert all(b.dtype == jnp.bfloat16 for b in bf)
    # jax can compute with the outputs (they are ordinary jax arrays)
    assert np.isfinite(float(jnp.sum(got[0] * 2))) and np.isfinite(float(jnp.sum(bf[2].astype(jnp.float32))))
