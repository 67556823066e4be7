#!/usr/bin/env bash
# Installs what building dsaib needs, on Debian 12, as root. Idempotent: a
# second run installs nothing and touches no network.
#
#   Debian: cmake ninja-build g++ libgtest-dev libcli11-dev nlohmann-json3-dev python3-pip
#           clang libclang-rt-dev (the fuzz build: fuzz/run.sh; libFuzzer and the sanitizer runtimes)
#   PyPI:   nvidia-cutlass==4.2.0.0 (pinned; the CUTLASS/CuTe headers of the cuda backend)
#   CUDA:   nvcc is expected at /usr/local/cuda/bin (not installed here)
#
# Usage: bash scripts/install_deps.sh
set -euo pipefail

readonly CUTLASS_VERSION="4.2.0.0"
readonly APT_PACKAGES=(cmake ninja-build g++ libgtest-dev libcli11-dev nlohmann-json3-dev python3-pip
                       clang libclang-rt-dev)

log() { printf '[install_deps] %s\n' "$*"; }
die() { printf '[install_deps] ERROR: %s\n' "$*" >&2; exit 1; }

SUDO=""
if [[ "$(id -u)" -ne 0 ]]; then
  command -v sudo >/dev/null 2>&1 || die "run as root (or install sudo)"
  SUDO="sudo"
fi

# --- Debian packages --------------------------------------------------------
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
  log "apt-get install: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || die "apt-get update failed"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
else
  log "Debian packages: all present"
fi

# --- CUTLASS / CuTe headers (PyPI wheel, pinned) -------------------------------
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found"
installed_cutlass="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("nvidia-cutlass"))' 2>/dev/null || true)"
if [[ "$installed_cutlass" != "$CUTLASS_VERSION" ]]; then
  log "pip install nvidia-cutlass==$CUTLASS_VERSION (found: ${installed_cutlass:-none})"
  # Debian 12's own python3 is "externally managed" (PEP 668): pip refuses
  # system-wide installs there unless told. This wheel only carries headers and
  # the cutlass_library package, which nothing from Debian provides, so it is
  # installed anyway; a venv's or pyenv's python is used as it is.
  pip_extra=()
  if "$PYTHON" -c 'import os, sys, sysconfig; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) and sys.prefix == sys.base_prefix else 1)'; then
    log "$PYTHON is externally managed (PEP 668): installing with --break-system-packages"
    pip_extra=(--break-system-packages)
  fi
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$PYTHON" -m pip install --quiet --root-user-action=ignore "${pip_extra[@]}" \
    "nvidia-cutlass==$CUTLASS_VERSION" || die "pip install nvidia-cutlass==$CUTLASS_VERSION failed"
else
  log "nvidia-cutlass $CUTLASS_VERSION: present"
fi
cute_header="$("$PYTHON" -c 'import os, cutlass_library as c; print(os.path.join(os.path.dirname(c.__file__), "source", "include", "cute", "tensor.hpp"))')" \
  || die "nvidia-cutlass is installed but cutlass_library does not import"
[[ -f "$cute_header" ]] || die "nvidia-cutlass $CUTLASS_VERSION has no $cute_header"

# --- CUDA compiler --------------------------------------------------------------
if ! command -v nvcc >/dev/null 2>&1; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="/usr/local/cuda/bin:$PATH"
    log "nvcc is at /usr/local/cuda/bin but not on PATH: run  export PATH=/usr/local/cuda/bin:\$PATH  before cmake"
  else
    log "WARNING: nvcc not found (expected at /usr/local/cuda/bin): the build will have no cuda backend"
  fi
fi
if command -v nvcc >/dev/null 2>&1; then
  log "nvcc: $(nvcc --version | sed -n 's/^Cuda compilation tools, //p')"
fi
log "done"
