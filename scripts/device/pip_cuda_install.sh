# Sourced (not run) by the device scripts that `pip install .` on the H200 with
# the cuda backend (pip_install_check.sh, pip_default_compiler_check.sh,
# opt_gcc_diag.sh), from the repository root. The H200 has no package registry
# and no CUTLASS headers: the build runs without isolation, with the pinned
# headers carried as .device/cutlass-include.tar.xz.

# Unpacks the carried headers to /tmp/cutlass-pinned/include, once per tarball:
# under a lock, and skipped when the stamp names the same tarball, so that two
# installs may run at once (release_check.sh) without one deleting the headers
# the other compiles against.
unpack_pinned_cutlass() {
  local sum
  sum=$(sha256sum .device/cutlass-include.tar.xz | cut -d' ' -f1)
  (
    flock 9
    if [[ "$(cat /tmp/cutlass-pinned/.stamp 2>/dev/null)" != "$sum" ]]; then
      rm -rf /tmp/cutlass-pinned && mkdir -p /tmp/cutlass-pinned &&
        tar -xJf .device/cutlass-include.tar.xz -C /tmp/cutlass-pinned && echo "$sum" > /tmp/cutlass-pinned/.stamp
    fi
  ) 9>/tmp/cutlass-pinned.lock
}

# pip_install_cuda LIMIT SITE BUILD_DIR [PIP_ARGS...]: builds the package with
# the cuda backend in BUILD_DIR and installs it into SITE (-v; the caller
# redirects the log). LIMIT: seconds for timeout (0: none). The compilers are
# the environment's CC/CXX/CUDAHOSTCXX; CMAKE_BUILD_PARALLEL_LEVEL defaults to 16.
pip_install_cuda() {
  local limit=$1 site=$2 build=$3
  shift 3
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} timeout "$limit" python3 -m pip install \
    --no-build-isolation --no-deps --no-index --no-cache-dir --target "$site" . \
    -C cmake.define.DSAIB_ENABLE_CUDA=ON -C cmake.define.DSAIB_CUTLASS_INCLUDE_DIR=/tmp/cutlass-pinned/include \
    -C "build-dir=$build" "$@" -v
}
