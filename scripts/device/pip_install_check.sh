#!/usr/bin/env bash
# `pip install .` ON the H200 (issue 5: built there against its Python 3.12 and
# torch), with the cuda backend, then the GPU tests of python/tests against that
# install and the autograd-capture diagnostic. The H200 has no package registry
# and no CUTLASS headers: the build runs without isolation (scikit-build-core,
# nanobind, cmake, ninja and nvcc are installed there), with the system gcc
# (/usr/bin/gcc 13.3: the image's default CC/CXX, /opt/gcc, links libstdc++
# statically into the extension, whose first C++ exception then segfaults —
# measured 2026-11-30), and the pinned CUTLASS
# headers travel as .device/cutlass-include.tar.xz (made here from the
# nvidia-cutlass==4.2.0.0 wheel: tar -C <site>/cutlass_library/source -cJf ... include).
#
#   device run, carry [".device/cutlass-include.tar.xz"]: bash scripts/device/pip_install_check.sh
# Writes into $OUT: pip_install.log, pytest_gpu.log, capture_diagnostic.log.
# PYTEST_ARGS (default python/tests) narrows the pytest run; PYTEST_LIMIT (s, default 300).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/device/pip_cuda_install.sh
OUT=${OUT:-/tmp/dsaib-pip-check}
SITE=/tmp/dsaib-pip-site
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-16}
export PATH=/usr/local/cuda/bin:$PATH
status=0
{
  python3 -c 'import sys, torch, scikit_build_core, nanobind; print(sys.version.split()[0], "torch", torch.__version__, "scikit-build-core", scikit_build_core.__version__, "nanobind", nanobind.__version__)'
  unpack_pinned_cutlass
  start=$(date +%s)
  CC=${DSAIB_CC:-/usr/bin/gcc} CXX=${DSAIB_CXX:-/usr/bin/g++} CUDAHOSTCXX=${DSAIB_CXX:-/usr/bin/g++} \
    pip_install_cuda 0 "$SITE" /tmp/dsaib-pip-build 2>&1 | grep -E "CUTLASS|cuda|Successfully|error|Error|ptxas info    : Used" | head -40
  echo "pip install rc=${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
} > "$OUT/pip_install.log" 2>&1
cat "$OUT/pip_install.log"
grep -q "pip install rc=0" "$OUT/pip_install.log" || exit 2
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import dsaib, dsaib.torch; print("dsaib from", dsaib.__file__, "cuda backend:", dsaib.cuda_available() if hasattr(dsaib, "cuda_available") else "?")'
timeout "${PYTEST_LIMIT:-300}" python3 -m pytest -q --no-header -p no:cacheprovider ${PYTEST_ARGS:-python/tests} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
status=${PIPESTATUS[0]}
[[ -n ${SKIP_DIAG:-} ]] || timeout 60 python3 scripts/device/diagnose_autograd_capture.py 2>&1 | tee "$OUT/capture_diagnostic.log" | tail -20
exit $status
