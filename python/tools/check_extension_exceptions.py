#!/usr/bin/env python3
"""Build-time self-check of the dsaib extension: do C++ exceptions reach Python?

Run by CMake right after linking dsaib._dsaib (python/CMakeLists.txt, option
DSAIB_PY_SELF_CHECK), in a child process so that a crash is seen, not suffered.
The child imports torch first when this Python has it (as users and the
package's tests do), then the freshly built module from its build directory,
and checks that these calls raise ValueError with exactly the expected message:
  1. ``_dsaib.empty((2,), "f16", "cpu")``: a dsaib::Error thrown in the
     extension's own code;
  2. ``_dsaib.indexer_backward(...)`` on tiny valid cpu arrays (standard-library
     ``array`` buffers, no numpy) with ``normalization_count=-1``: a dsaib::Error
     thrown inside the dsaib library (core/validate.cpp), which is where users'
     invalid arguments are caught;
  3. a valid run of the cpu backend on all cores, then a shape error (a message
     with numbers) and 2. again.

Why: an extension whose C++ runtime is linked statically and exported can end
up running half on that runtime and half on the libstdc++.so torch loaded: on
the H200 image (CC/CXX=/opt/gcc) it segfaulted on a C++ exception once torch
was imported and the cpu backend had run; with -static-libstdc++ here, the
numbers vanish from the messages (python/tests/test_static_runtime.py). The
extension is now linked with -Wl,--exclude-libs,ALL (python/CMakeLists.txt,
DSAIB_PY_HIDE_STATIC_LIBS), which fixes the second; this check turns either
into a build error that names the compiler and the remedy.

usage: check_extension_exceptions.py MODULE_DIR CXX_COMPILER
Exit: 0 every call raised ValueError with its message, or the module cannot be
imported in this environment without crashing (reported, not fatal: the
package tests import it); 1 the child crashed, hung (180 s), raised something
else or a wrong message.
python/tests/test_build_check.py runs it against the installed module and
against a stand-in module whose calls crash (the negative control).
"""
import signal
import subprocess
import sys

TIMEOUT_S = 180
TORCH_FAILURES = []  # messages of a torch that raised on import in a child
TORCH_SKIP = "torch-skip"  # check_once: torch, not the module, crashed or hung

CHILD = r"""
import array, sys
module_dir, order = sys.argv[1], sys.argv[2]
# torch (ORDER torch-first / torch-after) is imported before or after the module,
# as users and the package's tests do: a build with a compiler that links libstdc++
# statically (/opt/gcc of one H200 image) crashed on a library error after a valid
# run with torch imported first; a -static-libstdc++ build garbles messages with
# torch imported after.
def load_torch():
    # A torch that raises on import is the environment's problem, not the module's:
    # the check goes on without it (a crash while importing is reported by the parent).
    try:
        import torch  # noqa: F401
        print("TORCH-LOADED", flush=True)
    except Exception as e:  # noqa: BLE001
        print("TORCH-UNAVAILABLE %s: %s" % (type(e).__name__, e), flush=True)


if order == "torch-first":
    load_torch()
sys.path.insert(0, module_dir)
print("IMPORTING", flush=True)
try:
    import _dsaib
except ImportError as e:
    print("IMPORT-SKIPPED: ImportError: %s" % e, flush=True)
    sys.exit(3)
except Exception as e:
    print("IMPORT-SKIPPED: %s: %s" % (type(e).__name__, e), flush=True)
    sys.exit(3)
print("IMPORTED", flush=True)
sys.path.remove(module_dir)  # the package directory holds a torch.py of its own
if order == "torch-after":
    load_torch()


def expect_value_error(what, message, call):
    # The whole message: a C++ runtime mixed with another one in the process
    # can also corrupt what it formats (numbers missing) without crashing.
    try:
        call()
    except ValueError as e:
        if str(e) == message:
            print("OK %s: %s" % (what, e), flush=True)
            return
        print("WRONG-MESSAGE %s: %s" % (what, e), flush=True)
        sys.exit(2)
    except BaseException as e:
        print("WRONG-EXCEPTION %s: %s: %s" % (what, type(e).__name__, e), flush=True)
        sys.exit(2)
    print("NO-EXCEPTION %s" % what, flush=True)
    sys.exit(2)


def buf(code, shape, fill=0):
    n = 1
    for s in shape:
        n *= s
    return memoryview(array.array(code, [fill] * n)).cast("B").cast(code, shape)


B, S, H, D, K, T = 1, 1, 8, 64, 1, 1
args = dict(index_q=buf("H", [B, S, H, D]), weights=buf("f", [B, S, H]), index_k=buf("H", [B, K, D]),
            topk_indices=buf("i", [B, S, T]), attn_score=buf("f", [B, S, T], 1.0),
            index_score=buf("f", [B, S, T], 1.0), cu_seqlens_q=None, cu_seqlens_k=None,
            d_index_q=buf("f", [B, S, H, D]), d_weights=buf("f", [B, S, H]), d_index_k=buf("f", [B, K, D]),
            layout="bshd", id_mode="local", backend="cpu", sm_scale=1.0, loss_coeff=1.0, grad_loss=1.0,
            grad_loss_device=None, normalization_count=-1, strict_indices=False, deterministic=False, stream=0,
            num_threads=1, workspace=None, uint16_as_bf16=True, out_uint16_as_bf16=True)
NORMALIZATION = "normalization_count: expected >= 0 (0 = number of query tokens), got -1"
expect_value_error("extension", 'dtype: expected "f32", "bf16", "f64" or "i32", got "f16"',
                   lambda: _dsaib.empty((2,), "f16", "cpu"))
expect_value_error("library", NORMALIZATION, lambda: _dsaib.indexer_backward(**args))
# That /opt/gcc build passed the two probes above and still crashed in
# python/tests on a shape error raised after valid runs on the cpu backend's
# worker threads: so run the backend once, on all cores, then raise a shape
# error and the first error again.
valid = dict(args, normalization_count=0, num_threads=0)
try:
    _dsaib.indexer_backward(**valid)
except BaseException as e:
    print("VALID-CALL-RAISED %s: %s" % (type(e).__name__, e), flush=True)
    sys.exit(2)
print("VALID-CALL-OK", flush=True)
expect_value_error("library, shape, after a run", "weights: expected shape (1, 1, 8) (B, S_q, H), got shape (1, 1, 2)",
                   lambda: _dsaib.indexer_backward(**dict(valid, weights=buf("f", [B, S, 2]))))
expect_value_error("library, after a run", NORMALIZATION, lambda: _dsaib.indexer_backward(**args))
sys.exit(0)
"""

REMEDY = ("Rebuild with the system compiler, e.g.\n"
          "  CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ pip install .\n"
          "(docs/python.md, 'Installing'). Skip this check with -C cmake.define.DSAIB_PY_SELF_CHECK=OFF.")


def signal_name(rc):
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return "signal %d" % -rc


def main(argv):
    if len(argv) != 3:
        print("usage: check_extension_exceptions.py MODULE_DIR CXX_COMPILER", file=sys.stderr)
        return 2
    module_dir, cxx = argv[1], argv[2]
    try:
        import importlib.util
        have_torch = importlib.util.find_spec("torch") is not None
    except Exception:  # noqa: BLE001
        have_torch = False
    orders = ("torch-first", "torch-after") if have_torch else ("alone",)
    for order in orders:
        rc = check_once(module_dir, cxx, order)
        if rc == TORCH_SKIP:  # torch crashed or hung while importing: check the module without it
            TORCH_FAILURES.append("importing it crashed or took more than %d s" % TIMEOUT_S)
            rc = check_once(module_dir, cxx, "alone")
            if rc is None:
                break
        if rc is not None:
            return rc
    torch_note = "torch not installed"
    if have_torch:
        torch_note = ("torch imported before and after the module" if not TORCH_FAILURES else
                      "torch failed to import, checked without it: " + TORCH_FAILURES[0])
    print("dsaib self-check: C++ exceptions of the extension and of the library reach Python as "
          "ValueError with their messages (%s; %s)" % (cxx, torch_note))
    return 0


def torch_import_unfinished(order, stdout):
    """Whether the child stopped while importing torch (its markers: IMPORTING, IMPORTED, TORCH-*)."""
    if order == "torch-first":
        return "IMPORTING" not in stdout
    return order == "torch-after" and "IMPORTED" in stdout and "TORCH-" not in stdout


def check_once(module_dir, cxx, order):
    """None when the child passed; TORCH_SKIP when importing torch crashed or hung; else main's exit status."""
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, module_dir, order], capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        if torch_import_unfinished(order, partial):
            return TORCH_SKIP
        print("dsaib self-check FAILED: the extension built with %s did not answer in %d s (a hang while\n"
              "importing it or while raising a C++ exception). %s" % (cxx, TIMEOUT_S, REMEDY), file=sys.stderr)
        return 1
    out = (r.stdout + r.stderr).strip()
    for line in r.stdout.splitlines():
        if line.startswith("TORCH-UNAVAILABLE "):
            TORCH_FAILURES.append(line[len("TORCH-UNAVAILABLE "):])
    if r.returncode == 0:
        return None  # this order passed
    if r.returncode == 3:
        print("dsaib self-check: skipped, the module does not import here: " + out)
        return 0
    if r.returncode < 0:
        if torch_import_unfinished(order, r.stdout):  # torch itself crashed while being imported: not ours to judge
            return TORCH_SKIP
        if "IMPORTED" not in r.stdout:
            print("dsaib self-check FAILED: the extension built with %s crashed (%s) while being imported.\n%s"
                  % (cxx, signal_name(r.returncode), out), file=sys.stderr)
            return 1
        print("dsaib self-check FAILED: the extension built with the C++ compiler %s crashed (%s) on a\n"
              "C++ exception (an invalid argument, which the library reports by throwing). Such a build would\n"
              "crash the Python process on any bad input. %s\nThe check's steps before the crash:\n%s"
              % (cxx, signal_name(r.returncode), REMEDY, out),
              file=sys.stderr)
        return 1
    if "WRONG-MESSAGE" in r.stdout:
        print("dsaib self-check FAILED: the extension built with the C++ compiler %s raised ValueError with a\n"
              "wrong message (a C++ runtime linked into the extension and another one in the process, e.g.\n"
              "torch's, can corrupt what it formats). %s\nThe check's steps:\n%s" % (cxx, REMEDY, out),
              file=sys.stderr)
        return 1
    print("dsaib self-check FAILED (exit %d): %s" % (r.returncode, out), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
