#!/usr/bin/env bash
# Builds the dsaib Python package as a cp312 wheel WITH the cuda backend, on this
# (GPU-less) machine, for the H200 (Python 3.12, torch 2.11+cu130, no network),
# into .device/wheels/ (ignored by git). Then checks it here: size, contents, and
# that it imports and runs the CPU backend under Python 3.12 without a GPU.
#
#   bash scripts/device/build_python_wheel.sh
#
# Then, on the H200 (device tool; carry .device/wheels):
#   bash scripts/device/python_check.sh
#
# Environment: PYTHON312 (default /root/.pyenv/versions/3.12.1/bin/python3),
# NVCC (default /usr/local/cuda/bin/nvcc, CUDA 13.0, the H200's), JOBS (default 2).
# Build tools pinned as in .ci/run: nanobind 2.9.2, scikit-build-core 0.11.6;
# the CUTLASS headers come from nvidia-cutlass==4.2.0.0 in that interpreter
# (cmake/dependencies.cmake finds them through Python3_EXECUTABLE).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PY=${PYTHON312:-/root/.pyenv/versions/3.12.1/bin/python3}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
WHEEL_DIR=.device/wheels
BUILD_DIR=build-py312-cuda
MAX_MIB=15

die() { echo "build_python_wheel: $*" >&2; exit 1; }
[[ -x $PY ]] || die "no Python 3.12 at $PY (set PYTHON312)"
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || die "$PY is not Python 3.12"
[[ -x $NVCC ]] || die "no nvcc at $NVCC (set NVCC)"

pip_install() { PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install --quiet --root-user-action=ignore "$@"; }
echo "== build requirements into $PY"
pip_install "nanobind==2.9.2" "scikit-build-core==0.11.6" numpy pytest "nvidia-cutlass==4.2.0.0"

echo "== wheel (cuda backend ON, sm_90a) -> $WHEEL_DIR"
rm -rf "$WHEEL_DIR"
mkdir -p "$WHEEL_DIR"
export PATH="$(dirname "$NVCC"):$PATH" CUDACXX="$NVCC"
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}
start=$SECONDS
PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip wheel --no-build-isolation --no-deps -w "$WHEEL_DIR" \
  -C cmake.define.DSAIB_ENABLE_CUDA=ON -C "cmake.define.CMAKE_CUDA_COMPILER=$NVCC" \
  -C "build-dir=$BUILD_DIR" -C install.strip=true .
echo "built in $((SECONDS - start)) s"

shopt -s nullglob
wheels=("$WHEEL_DIR"/dsaib-*-cp312-cp312-*.whl)
[[ ${#wheels[@]} -eq 1 ]] || die "expected one cp312 wheel in $WHEEL_DIR, got: ${wheels[*]:-none}"
whl=${wheels[0]}
bytes=$(stat -c %s "$whl")
echo "== $whl: $((bytes / 1024)) KiB"
(( bytes < MAX_MIB * 1024 * 1024 )) || die "wheel is $((bytes / 1048576)) MiB, over $MAX_MIB MiB"
"$PY" - "$whl" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for i in z.infolist():
        print(f"   {i.file_size:>10}  {i.filename}")
    names = z.namelist()
assert any(n.startswith("dsaib/_dsaib") and n.endswith(".so") for n in names), "no extension in the wheel"
assert "dsaib/torch.py" in names and "dsaib/__init__.py" in names
EOF

echo "== the extension needs no CUDA runtime library (cudart is static; libcuda is loaded at run time)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install --quiet --root-user-action=ignore --no-deps --no-index \
  --target "$tmp/site" "$whl"
so=$(ls "$tmp"/site/dsaib/_dsaib*.so)
if ldd "$so" | grep -E 'libcudart|not found'; then die "$so links a CUDA runtime library or misses one (above)"; fi
ldd "$so" | sed 's/^/   /'
cuobjdump=$(command -v cuobjdump || echo "$(dirname "$NVCC")/cuobjdump")
if [[ -x $cuobjdump ]]; then
  archs=$("$cuobjdump" --list-elf "$so" 2>/dev/null | grep -o 'sm_[0-9a-z]*' | sort -u | tr '\n' ' ')
  echo "   device code: ${archs:-none found}"
  [[ $archs == *sm_90a* ]] || die "no sm_90a device code in $so"
else
  readelf -S "$so" | grep '\.nv_fatbin' >/dev/null || die "no .nv_fatbin section (device code) in $so"
  strings "$so" | grep 'sm_90a' >/dev/null || die "the device code in $so does not mention sm_90a"
  fatbin_hex=$(readelf -S -W "$so" | awk '/\.nv_fatbin/ {print $6}')
  echo "   device code: a .nv_fatbin section of $((16#${fatbin_hex:-0})) bytes, for sm_90a (no cuobjdump here to list it)"
fi

echo "== imports and runs the CPU backend here (Python 3.12, no GPU)"
(cd "$tmp" && PYTHONPATH="$tmp/site" "$PY" - <<'EOF'
import sys
import numpy as np
import dsaib
assert "torch" not in sys.modules
print("   dsaib", dsaib.__version__, "from", dsaib.__file__)
print("   cuda_compiled:", dsaib.cuda_compiled(), "| cuda_backend_available:", dsaib.cuda_backend_available())
assert dsaib.cuda_compiled(), "the wheel was built without the cuda backend"
rng = np.random.default_rng(0)
q = dsaib.bf16_bits(rng.standard_normal((1, 4, 8, 64)).astype(np.float32))
k = dsaib.bf16_bits(rng.standard_normal((1, 6, 64)).astype(np.float32))
w = rng.standard_normal((1, 4, 8)).astype(np.float32)
ids = rng.integers(0, 6, (1, 4, 3)).astype(np.int32)
T = np.full((1, 4, 3), 1 / 3, np.float32)
dq, dw, dk = dsaib.indexer_backward(q, w, k, ids, T, T, sm_scale=0.125, uint16_as_bf16=True)
assert np.isfinite(dq).all() and np.abs(dq).sum() > 0
try:
    dsaib.indexer_backward(q, w, k, ids, T, T, sm_scale=0.125, uint16_as_bf16=True, backend="cuda")
    raise SystemExit("backend='cuda' ran without a GPU?")
except RuntimeError as e:
    print("   backend='cuda' here:", e)
EOF
)
echo "== the package's tests (CPU; torch/cupy/jax/GPU tests skip here)"
PYTHONPATH="$tmp/site" "$PY" -m pytest -q -p no:cacheprovider python/tests

echo "== done: $whl"
echo "   on the H200: device run with carry [\".device/wheels\"]: bash scripts/device/python_check.sh"
