"""An extension with its C++ runtime linked statically must still work beside torch.

The H200 image's default compiler (/opt/gcc) links libstdc++ into the extension,
and that build segfaulted on a C++ exception once torch was imported
(docs/python.md). Here the same kind of build is made with the system compiler
and ``-static-libstdc++ -static-libgcc``:

- with the archive symbols hidden (``DSAIB_PY_HIDE_STATIC_LIBS``, the default:
  ``-Wl,--exclude-libs,ALL``) it must build, pass its self-check and raise
  the library's messages intact with torch imported before or after it;
- without (the negative control), the extension runs partly on torch's
  libstdc++.so: here, with torch imported after it, the numbers vanish from
  the messages, and the build-time self-check must then fail the install.
  Where that defect does not show, the control is skipped, not passed.

Two `pip install` builds of the CPU-only extension (about 20-40 s each); skipped
without torch, a C++ compiler or the build requirements.
"""
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF linker flags"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (the other C++ runtime)"),
    pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="needs a C++ compiler"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("nanobind", "scikit_build_core")),
                       reason="needs nanobind and scikit-build-core (no build isolation)"),
]

PROBE = r"""
import array, sys
if sys.argv[2] == "torch-first":
    import torch  # noqa: F401
sys.path.insert(0, sys.argv[1])
from dsaib import _dsaib
if sys.argv[2] == "torch-after":
    import torch  # noqa: F401,F811
def buf(code, shape, fill=0):
    n = 1
    for s in shape:
        n *= s
    return memoryview(array.array(code, [fill] * n)).cast("B").cast(code, shape)
args = dict(index_q=buf("H", [1, 1, 8, 64]), weights=buf("f", [1, 1, 2]), index_k=buf("H", [1, 1, 64]),
            topk_indices=buf("i", [1, 1, 1]), attn_score=buf("f", [1, 1, 1], 1.0),
            index_score=buf("f", [1, 1, 1], 1.0), cu_seqlens_q=None, cu_seqlens_k=None,
            d_index_q=buf("f", [1, 1, 8, 64]), d_weights=buf("f", [1, 1, 8]), d_index_k=buf("f", [1, 1, 64]),
            layout="bshd", id_mode="local", backend="cpu", sm_scale=1.0, loss_coeff=1.0, grad_loss=1.0,
            grad_loss_device=None, normalization_count=0, strict_indices=False, deterministic=False, stream=0,
            num_threads=0, workspace=None, uint16_as_bf16=True, out_uint16_as_bf16=True)
try:
    _dsaib.indexer_backward(**args)
except ValueError as e:
    print("MESSAGE " + str(e))
"""
EXPECTED = "MESSAGE weights: expected shape (1, 1, 8) (B, S_q, H), got shape (1, 1, 2)"


def pip_install(tmp_path, name, hide):
    site, build = tmp_path / f"{name}-site", tmp_path / f"{name}-build"
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
           "--disable-pip-version-check", "--target", str(site), str(REPO), "-v",
           "-C", "cmake.define.DSAIB_ENABLE_CUDA=OFF",
           "-C", "cmake.define.CMAKE_MODULE_LINKER_FLAGS=-static-libstdc++ -static-libgcc",
           "-C", f"cmake.define.DSAIB_PY_HIDE_STATIC_LIBS={'ON' if hide else 'OFF'}",
           "-C", f"build-dir={build}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2)))
    return r, site


ORDERS = ("torch-first", "torch-after")


def probe(site, order):
    return subprocess.run([sys.executable, "-c", PROBE, str(site), order], capture_output=True, text=True,
                          timeout=300)


def test_static_runtime_with_hidden_archive_symbols_keeps_messages_beside_torch(tmp_path):
    r, site = pip_install(tmp_path, "hidden", hide=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "dsaib self-check: C++ exceptions of the extension and of the library reach Python" in r.stdout + r.stderr
    for order in ORDERS:
        p = probe(site, order)
        assert p.returncode == 0, (order, p.stdout + p.stderr)
        assert p.stdout.strip() == EXPECTED, (order, p.stdout + p.stderr)


def test_static_runtime_with_exported_archive_symbols_fails_the_self_check(tmp_path):
    r, site = pip_install(tmp_path, "exported", hide=False)
    out = r.stdout + r.stderr
    if r.returncode == 0:
        probes = [probe(site, order) for order in ORDERS]
        if all(p.returncode == 0 and p.stdout.strip() == EXPECTED for p in probes):
            pytest.skip("the mixed-runtime defect does not show in this environment (messages intact)")
        shown = [(o, p.returncode, p.stdout + p.stderr) for o, p in zip(ORDERS, probes)]
        pytest.fail("the defect shows (%r) but the self-check let the install pass:\n%s" % (shown, out[-3000:]))
    assert "dsaib self-check FAILED" in out, out[-4000:]
