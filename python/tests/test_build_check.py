"""The build-time self-check (python/tools/check_extension_exceptions.py) must be able to fail.

CMake runs it after linking the extension; here it runs against the installed
module (it must pass) and against stand-in `_dsaib` modules in a temporary
directory: one whose library call kills the process with SIGSEGV, one that
raises correctly until a valid run and then crashes (as the /opt/gcc build on
the H200 did in python/tests; both must fail, naming the compiler and the
remedy), one that crashes on import, and one whose call returns without raising.
"""
import os
import pathlib
import subprocess
import sys

import pytest

import dsaib._dsaib as ext

CHECK = pathlib.Path(__file__).resolve().parents[1] / "tools" / "check_extension_exceptions.py"

STAND_INS = {
    "crash_on_library_error": (
        "import os, signal\n"
        "def empty(shape, dtype, device):\n"
        "    raise ValueError('dtype: expected \"f32\", \"bf16\", \"f64\" or \"i32\", got \"f16\"')\n"
        "def indexer_backward(**kw):\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n"),
    # The defect seen on the H200: errors raise correctly until
    # the cpu backend has run, then a shape error crashes.
    "crash_after_a_valid_run": (
        "import os, signal\n"
        "ran = []\n"
        "def empty(shape, dtype, device):\n"
        "    raise ValueError('dtype: expected \"f32\", \"bf16\", \"f64\" or \"i32\", got \"f16\"')\n"
        "def indexer_backward(**kw):\n"
        "    if ran:\n"
        "        os.kill(os.getpid(), signal.SIGSEGV)\n"
        "    if kw['normalization_count'] < 0:\n"
        "        raise ValueError('normalization_count: expected >= 0 (0 = number of query tokens), got -1')\n"
        "    ran.append(1)\n"),
    # What -static-libstdc++ without hidden archive symbols did here with torch
    # imported: the right exception, the numbers missing from its message.
    "corrupted_message": (
        "def empty(shape, dtype, device):\n"
        "    raise ValueError('dtype: expected \"f32\", \"bf16\", \"f64\" or \"i32\", got \"f16\"')\n"
        "def indexer_backward(**kw):\n"
        "    raise ValueError('normalization_count: expected >= 0 (0 = number of query tokens), got ')\n"),
    "crash_on_import": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n",
    "no_exception": (
        "def empty(shape, dtype, device):\n"
        "    raise ValueError('dtype: expected \"f32\", \"bf16\", \"f64\" or \"i32\", got \"f16\"')\n"
        "def indexer_backward(**kw):\n"
        "    return None\n"),
}


def run_check(module_dir, env=None):
    return subprocess.run([sys.executable, str(CHECK), str(module_dir), "/opt/example/g++"],
                          capture_output=True, text=True, timeout=300, env=env)


def fake_torch_env(tmp_path, init_source):
    """An environment whose `import torch` runs init_source (a stand-in for a broken torch)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(init_source)
    return dict(os.environ, PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_self_check_passes_on_this_build():
    r = run_check(os.path.dirname(ext.__file__))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "of the extension and of the library reach Python as ValueError" in r.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("kind", sorted(STAND_INS))
def test_self_check_fails_on_a_broken_module(tmp_path, kind):
    (tmp_path / "_dsaib.py").write_text(STAND_INS[kind])
    r = run_check(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED" in r.stderr
    if kind.startswith("crash_") and kind != "crash_on_import":
        assert "crashed (SIGSEGV) on a" in r.stderr and "steps before the crash" in r.stderr
        assert "/opt/example/g++" in r.stderr and "CXX=/usr/bin/g++" in r.stderr
        if kind == "crash_after_a_valid_run":
            assert "VALID-CALL-OK" in r.stderr
    elif kind == "crash_on_import":
        assert "while being imported" in r.stderr
    elif kind == "corrupted_message":
        assert "wrong message" in r.stderr and "WRONG-MESSAGE library" in r.stderr
    else:
        assert "NO-EXCEPTION library" in r.stderr


def test_self_check_goes_on_without_a_torch_that_raises_on_import(tmp_path):
    # A broken torch (raising on import) is not the extension's defect: checked without it, not failed.
    env = fake_torch_env(tmp_path, 'raise ImportError("libtorch_cpu.so: cannot open")\n')
    r = run_check(os.path.dirname(ext.__file__), env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torch failed to import, checked without it: ImportError: libtorch_cpu.so: cannot open" in r.stdout


def test_self_check_checks_the_module_alone_when_torch_crashes_on_import(tmp_path):
    env = fake_torch_env(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    r = run_check(os.path.dirname(ext.__file__), env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reach Python as ValueError with their messages" in r.stdout  # the module itself was checked
    assert "torch failed to import, checked without it: importing it crashed" in r.stdout
