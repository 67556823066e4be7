#!/usr/bin/env bash
# The Python package's check, on any machine (with or without a GPU): python/tests and
# the training example.
#
#   usage: scripts/python_check.sh [--install] [--cuda] [--require-cuda] OUTDIR
#     --install       first build this checkout's package and install it into OUTDIR/site
#                     (put first on PYTHONPATH for the rest); without it, the dsaib that
#                     `python3 -c "import dsaib"` finds is checked
#     --cuda          with --install: build the cuda backend too (needs nvcc and the CUTLASS
#                     headers, as the CMake build does)
#     --require-cuda  fail unless dsaib's cuda backend can run here (an sm_90 GPU) and,
#                     when torch is installed, torch sees the GPU: the GPU tests then run
#                     instead of skipping
#     -h, --help      this text
#   PYTHON=... names the interpreter (default python3).
#
# The commands, in order (O = OUTDIR):
#   python3 -m pip install --no-build-isolation --no-deps --target O/site -C build-dir=O/build
#           [-C cmake.define.DSAIB_ENABLE_CUDA=ON] .                        (--install only)
#   python3 -m pytest -q -rs -p no:cacheprovider python/tests
#   python3 python/examples/train_indexer.py --device cpu --out O/train_cpu.png --csv O/train_cpu.csv
#   python3 python/examples/train_indexer.py --device cuda --out O/train_cuda.png --csv O/train_cuda.csv
# The example needs torch: without torch it is skipped (and said so); the cuda run needs
# the cuda backend and torch with CUDA. --install builds without build isolation, as CI
# does, so the build requirements must be installed in that interpreter first:
#   python3 -m pip install "nanobind==2.9.2" "scikit-build-core==0.11.6" numpy pytest
# Tests that need torch, cupy or jax skip without them (pytest -rs lists every skip).
# Time limits: 30 minutes for pytest, 10 for each example run (a step that hits its
# limit fails with exit 124).
#
# Writes O/pytest.log, O/example_{cpu,cuda}.log (and their PNG and CSV), O/install.log
# (--install) and O/summary.txt (one line per step; its last line the verdict).
# Exit status: 0 every step that ran passed, 1 a step failed, 2 it cannot run (bad usage,
# dsaib or pytest not importable, --require-cuda without a usable cuda backend).
set -uo pipefail

usage() { sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "python_check: $*" >&2; exit 2; }

install=0
cuda=0
require_cuda=0
outdir=""
while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --install) install=1 ;;
    --cuda) cuda=1 ;;
    --require-cuda) require_cuda=1 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [[ -z $outdir ]] || die "one OUTDIR expected, got \"$outdir\" and \"$1\""; outdir=$1 ;;
  esac
  shift
done
[[ -n $outdir ]] || die "missing OUTDIR (usage: scripts/python_check.sh [--install] [--cuda] [--require-cuda] OUTDIR)"
[[ $cuda == 1 && $install == 0 ]] && die "--cuda applies to --install (the build); without --install the installed dsaib is checked"
mkdir -p "$outdir" || die "cannot create OUTDIR $outdir"
out=$(cd "$outdir" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
py=${PYTHON:-python3}
command -v "$py" >/dev/null 2>&1 || die "$py not found (PYTHON=... names another interpreter)"
export PYTHONUNBUFFERED=1
# jax (when installed) must not take most of the GPU at import: torch and dsaib share it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

: >"$out/summary.txt"
status=0
note() { echo "$*" | tee -a "$out/summary.txt"; }
verdict() {
  note "python_check: $([[ $1 == 0 ]] && echo PASSED || echo FAILED)"
  exit "$1"
}

if [[ $install == 1 ]]; then
  missing=$("$py" -c 'import importlib.util as u; print(" ".join(m for m in ("nanobind", "scikit_build_core") if u.find_spec(m) is None))')
  [[ -z $missing ]] || { note "install: cannot build: $missing not installed in $py ($py -m pip install \"nanobind==2.9.2\" \"scikit-build-core==0.11.6\")"; verdict 2; }
  flags=(-C "build-dir=$out/build")
  if [[ $cuda == 1 ]]; then
    [[ -d /usr/local/cuda/bin ]] && export PATH=/usr/local/cuda/bin:$PATH
    command -v nvcc >/dev/null 2>&1 || { note "install: --cuda needs nvcc on PATH"; verdict 2; }
    flags+=(-C cmake.define.DSAIB_ENABLE_CUDA=ON)
  fi
  echo "== pip install (cuda backend: $([[ $cuda == 1 ]] && echo on || echo off)) into $out/site"
  rm -rf "$out/site"
  start=$SECONDS
  if ! PIP_DISABLE_PIP_VERSION_CHECK=1 "$py" -m pip install --no-build-isolation --no-deps --target "$out/site" \
    "${flags[@]}" . >"$out/install.log" 2>&1; then
    tail -n 20 "$out/install.log"
    note "install: FAILED (see $out/install.log)"
    verdict 1
  fi
  note "install: built and installed in $((SECONDS - start)) s"
  export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}"
fi

# What is being checked: dsaib's origin and backends, the optional frameworks.
env_report=$("$py" - <<'EOF' 2>&1
import importlib.util, sys
try:
    import dsaib
except Exception as e:  # noqa: BLE001
    print(f"dsaib not importable: {type(e).__name__}: {e}")
    sys.exit(3)
cuda = dsaib.cuda_backend_available()
print(f"python {sys.version.split()[0]}; dsaib {dsaib.__version__} from {dsaib.__file__}")
print(f"dsaib cuda backend: compiled {dsaib.cuda_compiled()}, available {cuda}")
torch_cuda = None
if importlib.util.find_spec("torch") is None:
    print("torch not installed")
else:
    try:
        import torch
        torch_cuda = torch.cuda.is_available()
        print(f"torch {torch.__version__}, CUDA available {torch_cuda}")
    except Exception as e:  # noqa: BLE001 (a broken install: reported, the example skipped)
        print(f"torch installed but not importable: {type(e).__name__}: {str(e)[:200]}")
for name in ("cupy", "jax", "matplotlib"):
    print(f"{name} {'installed' if importlib.util.find_spec(name) else 'not installed'}")
print(f"RESULT cuda={int(cuda)} torch={'none' if torch_cuda is None else int(torch_cuda)}")
EOF
)
rc=$?
echo "$env_report" | grep -v '^RESULT' | tee "$out/environment.txt"
if [[ $rc -ne 0 ]]; then
  note "environment: dsaib not importable with $py (pip install . first, or pass --install)"
  verdict 2
fi
dsaib_cuda=$(sed -n 's/^RESULT cuda=\([01]\).*/\1/p' <<<"$env_report")
torch_state=$(sed -n 's/^RESULT .*torch=\(.*\)$/\1/p' <<<"$env_report")
if [[ $require_cuda == 1 && $dsaib_cuda != 1 ]]; then
  note "environment: --require-cuda, but dsaib's cuda backend is not available (a CPU-only build, or no sm_90 GPU)"
  verdict 2
fi
if [[ $require_cuda == 1 && $torch_state == 0 ]]; then
  note "environment: --require-cuda, but torch sees no CUDA device (a CPU-only torch?): its GPU tests would skip"
  verdict 2
fi
"$py" -c 'import pytest' 2>/dev/null || { note "environment: pytest not installed ($py -m pip install pytest)"; verdict 2; }

echo "== pytest python/tests"
start=$SECONDS
timeout -k 10 1800 "$py" -m pytest -q -rs -p no:cacheprovider python/tests >"$out/pytest.log" 2>&1
rc=$?
tail -n 15 "$out/pytest.log"
summary_line=$(grep -E '^=*.*(passed|failed|error|no tests ran)' "$out/pytest.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
if [[ $rc -eq 0 ]]; then
  note "pytest: PASS ($summary_line; $((SECONDS - start)) s)"
else
  note "pytest: FAILED exit $rc ($summary_line; see $out/pytest.log)"
  status=1
fi

devices=(cpu)
[[ $dsaib_cuda == 1 && $torch_state == 1 ]] && devices+=(cuda)
for dev in "${devices[@]}"; do
  if [[ $torch_state == none ]]; then
    note "example: SKIPPED (python/examples/train_indexer.py needs torch, which is not importable here)"
    break
  fi
  echo "== python/examples/train_indexer.py --device $dev"
  start=$SECONDS
  timeout -k 10 600 "$py" python/examples/train_indexer.py --device "$dev" --out "$out/train_$dev.png" --csv "$out/train_$dev.csv" \
    >"$out/example_$dev.log" 2>&1
  rc=$?
  tail -n 3 "$out/example_$dev.log"
  if [[ $rc -eq 0 ]]; then
    note "example $dev: PASS ($((SECONDS - start)) s; $(grep -E '^KL|KL ' "$out/example_$dev.log" | tail -1))"
  else
    note "example $dev: FAILED exit $rc (see $out/example_$dev.log)"
    status=1
  fi
done
if [[ ${#devices[@]} -eq 1 && $torch_state != none ]]; then
  note "example cuda: SKIPPED (needs dsaib's cuda backend and torch with CUDA)"
fi
verdict "$status"
