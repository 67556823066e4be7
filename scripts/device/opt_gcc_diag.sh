#!/usr/bin/env bash
# Diagnosis of the H200 image's default compiler (/opt/gcc) for `pip install .`:
# what the compiler is and how it links, then two builds with it, each followed
# by python/tests (-v, faulthandler dumps after 25 s in one test):
#   hidden:  the default build (DSAIB_PY_HIDE_STATIC_LIBS ON);
#   extra:   ran once, as "shared", (087d1d2, docs/results/2026-11-30-s6) with an option
#            DSAIB_PY_SHARED_CXX_RUNTIME (-lstdc++ -lgcc_s), a no-op with /opt/gcc
#            (only libstdc++.a there) and since removed; with EXTRA_CMAKE_ARGS
#            ("-C cmake.define.X=Y ...") it builds with those instead.
#   device run, carry [".device/cutlass-include.tar.xz"]: bash scripts/device/opt_gcc_diag.sh
# Writes $OUT/opt_gcc_info.txt, $OUT/pytest_{hidden,extra}.log. Exit 0 always
# unless a build fails; read the logs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/device/pip_cuda_install.sh
out=${OUT:-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
cxx=${CXX:-c++}
{
  echo "CC=${CC:-<unset>} CXX=${CXX:-<unset>}"
  file "$(command -v "$cxx")"; ls -la "$(dirname "$(command -v "$cxx")")" | head -20
  if file "$(command -v "$cxx")" | grep -q text; then echo "--- script:"; head -c 1500 "$(command -v "$cxx")"; echo; fi
  "$cxx" -v 2>&1 | tail -2
  echo "--- link line of a shared object:"
  echo 'int f(){return 1;}' > /tmp/t.cpp
  "$cxx" -shared -fPIC /tmp/t.cpp -o /tmp/t.so -### 2>&1 | tail -1 | tr ' ' '\n' | grep -E "^\"?-(l|B|static|shared|L|-as-needed|-no-as-needed)" | tr '\n' ' '; echo
  "$cxx" -print-file-name=libstdc++.so; "$cxx" -print-file-name=libstdc++.a
  echo "--- specs mentioning static:"; "$cxx" -dumpspecs 2>/dev/null | grep -n -i "static-lib" | head
} > "$out/opt_gcc_info.txt" 2>&1
unpack_pinned_cutlass
rc=0
for variant in hidden extra; do
  site=/tmp/diag-$variant-site
  extra=()
  if [[ $variant == extra ]]; then
    [[ -n ${EXTRA_CMAKE_ARGS:-} ]] || continue
    read -r -a extra <<< "$EXTRA_CMAKE_ARGS"
  fi
  rm -rf "$site" "/tmp/diag-$variant-build"
  t0=$(date +%s)
  CMAKE_BUILD_PARALLEL_LEVEL=16 pip_install_cuda 200 "$site" "/tmp/diag-$variant-build" "${extra[@]}" \
    > "/tmp/diag-$variant-pip.log" 2>&1
  pip_rc=$?
  {
    echo "pip rc=$pip_rc in $(( $(date +%s) - t0 )) s"
    grep -E "CXX compiler identification|self-check|Error|error:" "/tmp/diag-$variant-pip.log" | tail -12
    so=$(ls "$site"/dsaib/_dsaib*.so 2>/dev/null)
    [[ -n $so ]] && { ls -la "$so"; ldd "$so"; }
  } >> "$out/opt_gcc_info.txt" 2>&1
  (( pip_rc == 0 )) || { rc=1; continue; }
  PYTHONPATH=$site timeout -k 5 170 python3 -X faulthandler -m pytest -v -x -p no:cacheprovider \
    -o faulthandler_timeout=25 --durations=8 --ignore=python/tests/test_static_runtime.py python/tests > "$out/pytest_$variant.log" 2>&1 &
done
wait
for variant in hidden extra; do [[ -f $out/pytest_$variant.log ]] && { echo "== $variant"; tail -5 "$out/pytest_$variant.log"; }; done
cat "$out/opt_gcc_info.txt" | head -60
exit $rc
