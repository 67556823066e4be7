#!/usr/bin/env python3
"""Build-time self-check of the dsaib extension: does a C++ exception reach Python?

Run by CMake right after linking dsaib._dsaib (python/CMakeLists.txt, option
DSAIB_PY_SELF_CHECK), in a child process so that a crash is seen, not suffered:
the child imports the freshly built module from its build directory and calls
``_dsaib.empty((2,), "f64", "cpu")``, which the library rejects with a
dsaib::Error that nanobind must translate into a ValueError.

Why: on an image whose default compiler links the C++ runtime into the
extension in a way the process's unwinder cannot use (seen on the H200 image
with CC/CXX=/opt/gcc, docs/python.md), the extension segfaults on its first
C++ exception, i.e. on the first invalid argument a user passes. This check
turns that into a build error that names the compiler and the remedy.

usage: check_extension_exceptions.py MODULE_DIR CXX_COMPILER
Exit: 0 the ValueError arrived (or the module cannot be imported in this
environment: reported, not fatal, since the import itself is tested by the
package tests); 1 the child crashed or raised something else.
Test hook: DSAIB_SELF_CHECK_SIMULATE_CRASH=1 makes the child kill itself with
SIGSEGV after the import (the negative control of python/tests/test_build_check.py).
"""
import os
import signal
import subprocess
import sys

CHILD = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
try:
    import _dsaib
except ImportError as e:
    print("IMPORT-SKIPPED: " + str(e))
    sys.exit(3)
if os.environ.get("DSAIB_SELF_CHECK_SIMULATE_CRASH") == "1":
    os.kill(os.getpid(), signal.SIGSEGV)
try:
    _dsaib.empty((2,), "f64", "cpu")
except ValueError as e:
    if "dtype" in str(e):
        print("OK: " + str(e))
        sys.exit(0)
    print("WRONG-MESSAGE: " + str(e))
    sys.exit(2)
except BaseException as e:
    print("WRONG-EXCEPTION: %s: %s" % (type(e).__name__, e))
    sys.exit(2)
print("NO-EXCEPTION: _dsaib.empty accepted dtype 'f64'")
sys.exit(2)
"""


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: check_extension_exceptions.py MODULE_DIR CXX_COMPILER", file=sys.stderr)
        return 2
    module_dir, cxx = argv[1], argv[2]
    r = subprocess.run([sys.executable, "-c", CHILD, module_dir], capture_output=True, text=True)
    out = (r.stdout + r.stderr).strip()
    if r.returncode == 0:
        print("dsaib self-check: a C++ exception reaches Python as ValueError (%s)" % cxx)
        return 0
    if r.returncode == 3:
        print("dsaib self-check: skipped, the module does not import here: " + out)
        return 0
    if r.returncode < 0:
        try:
            what = signal.Signals(-r.returncode).name
        except ValueError:
            what = "signal %d" % -r.returncode
        print(
            "dsaib self-check FAILED: the extension built with the C++ compiler %s crashed (%s) on its first\n"
            "C++ exception (an invalid argument, which the library reports by throwing). Such a build would\n"
            "crash the Python process on any bad input. Rebuild with the system compiler, e.g.\n"
            "  CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ pip install .\n"
            "(docs/python.md, 'Installing'). Skip this check with -C cmake.define.DSAIB_PY_SELF_CHECK=OFF."
            % (cxx, what),
            file=sys.stderr,
        )
        return 1
    print("dsaib self-check FAILED (exit %d): %s" % (r.returncode, out), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
