"""The build-time self-check (python/tools/check_extension_exceptions.py) must be able to fail.

CMake runs it after linking the extension; here it runs against the installed
module: it passes on a healthy build, and fails, naming the compiler and the
remedy, when its child process crashes (simulated with SIGSEGV).
"""
import os
import pathlib
import subprocess
import sys

import dsaib._dsaib as ext

CHECK = pathlib.Path(__file__).resolve().parents[1] / "tools" / "check_extension_exceptions.py"
MODULE_DIR = os.path.dirname(ext.__file__)


def run_check(simulate_crash):
    env = dict(os.environ)
    env.pop("DSAIB_SELF_CHECK_SIMULATE_CRASH", None)
    if simulate_crash:
        env["DSAIB_SELF_CHECK_SIMULATE_CRASH"] = "1"
    return subprocess.run([sys.executable, str(CHECK), MODULE_DIR, "/opt/example/g++"],
                          capture_output=True, text=True, env=env, timeout=120)


def test_self_check_passes_on_this_build():
    r = run_check(simulate_crash=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reaches Python as ValueError" in r.stdout


def test_self_check_fails_when_the_module_crashes():
    r = run_check(simulate_crash=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "SIGSEGV" in r.stderr
    assert "/opt/example/g++" in r.stderr
    assert "CXX=/usr/bin/g++" in r.stderr
