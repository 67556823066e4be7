#!/usr/bin/env bash
# The Python package on the H200: install the wheel built by
# scripts/device/build_python_wheel.sh, run python/tests (GPU, torch CPU, cupy,
# jax) and the training demo on cpu (toy size) and cuda (DeepSeek shape:
# H64 D128 topk 2048, S 4096). Everything is time-boxed: pytest 240 s (169 s on a fresh H200 machine, fourteenth session; 130 s was too short), demos 30 s + 50 s (under 6 minutes in all).
#
#   device run, carry [".device/wheels"]:  bash scripts/device/python_check.sh
#
# Writes into $OUT (4 files): pytest.log, demo.log, demo_cpu.png, demo_cuda.png.
# Exit status: 0 when the tests and both demos passed, else the first failure's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

OUT=${OUT:-/tmp/dsaib-python-check}
SITE=${DSAIB_SITE:-/tmp/dsaib-site}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false      # jax shares the GPU with torch in one pytest process
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
note() { echo "python_check: $*" | tee -a "$OUT/pytest.log"; }

: > "$OUT/pytest.log"
shopt -s nullglob
wheels=(.device/wheels/dsaib-*-cp312-*.whl)
if [[ ${#wheels[@]} -ne 1 ]]; then
  note "expected one cp312 wheel in .device/wheels (build it with scripts/device/build_python_wheel.sh and carry .device/wheels), got: ${wheels[*]:-none}"
  exit 2
fi
rm -rf "$SITE"
if ! python3 -m pip install --quiet --no-deps --no-index --no-compile --target "$SITE" "${wheels[0]}" >>"$OUT/pytest.log" 2>&1; then
  note "pip install of ${wheels[0]} failed"
  exit 2
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "== $(date -u +%FT%TZ) wheel ${wheels[0]}"
  nvidia-smi -L 2>&1 | head -4
  python3 - <<'EOF'
import sys
import dsaib
print("python", sys.version.split()[0], "| dsaib", dsaib.__version__, "from", dsaib.__file__)
print("dsaib.cuda_compiled()", dsaib.cuda_compiled(), "| dsaib.cuda_backend_available()", dsaib.cuda_backend_available())
for name in ("torch", "cupy", "jax", "numpy", "matplotlib"):
    try:
        m = __import__(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"{name}: not importable ({type(e).__name__}: {e})")
import torch
print("torch.cuda.is_available()", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
} >>"$OUT/pytest.log" 2>&1

echo "== pytest python/tests" >>"$OUT/pytest.log"
start=$SECONDS
# PYTEST_ARGS: a narrower selection (e.g. "python/tests/test_torch_gpu.py -k determin"); SKIP_DEMOS=1 skips the demos.
# shellcheck disable=SC2086
timeout -k 5 240 python3 -m pytest -q -rs -p no:cacheprovider --durations=15 ${PYTEST_ARGS:-python/tests} >>"$OUT/pytest.log" 2>&1
rc=$?
note "pytest exit $rc after $((SECONDS - start)) s (124 = timed out)"
[[ $rc -ne 0 && $status -eq 0 ]] && status=$rc

: > "$OUT/demo.log"
demo_devices="cpu cuda"
[[ -n ${SKIP_DEMOS:-} ]] && demo_devices=""
for dev in $demo_devices; do
  limit=$([[ $dev == cpu ]] && echo 30 || echo 50)
  echo "== train_indexer.py --device $dev (limit ${limit} s)" >>"$OUT/demo.log"
  start=$SECONDS
  timeout -k 5 "$limit" python3 python/examples/train_indexer.py --device "$dev" \
    --out "$OUT/demo_$dev.png" --csv "/tmp/dsaib-demo-$dev.csv" >>"$OUT/demo.log" 2>&1
  rc=$?
  echo "== demo $dev exit $rc after $((SECONDS - start)) s (124 = timed out)" >>"$OUT/demo.log"
  [[ $rc -ne 0 && $status -eq 0 ]] && status=$rc
done
tail -n 3 "$OUT/pytest.log"
grep -E "^(== demo|KL |FAIL)" "$OUT/demo.log"
exit $status
