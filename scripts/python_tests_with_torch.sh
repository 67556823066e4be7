#!/usr/bin/env bash
# Runs python/tests (CPU) under another torch version than the machine's, in a
# venv that sees the system site-packages (numpy, pytest, the build tools):
#   bash scripts/python_tests_with_torch.sh 2.11.0 [pytest args...]
# Why: torch versions differ in what torch.compile accepts (torch 2.11 failed two
# torch.compile tests that 2.15 passed, a dynamo AssertionError), and CI installs
# no torch; this reproduces a user's torch version on any machine. Needs PyPI
# (torch's wheel with its nvidia-* dependencies, ~3 GB, cached in the venv at
# /tmp/dsaib-torch-VERSION). The package is installed into the venv from this
# checkout (cpu backend), so the system install stays.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=${1:?usage: python_tests_with_torch.sh TORCH_VERSION [pytest args...]}
shift
venv=/tmp/dsaib-torch-$version
if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$version"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps --force-reinstall .
"$venv/bin/python" -c "import torch, dsaib; print('torch', torch.__version__, 'dsaib from', dsaib.__file__)"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests "$@"
