#!/usr/bin/env bash
# Installs the Python package `moekit` (bindings/python) from this checkout into the project's
# venv, with what its test suite needs (pytest, ml_dtypes for bfloat16 NumPy arrays):
#
#   bash scripts/python.sh
#
# The package is built the way a user installs it (`pip install ./bindings/python`: maturin,
# one abi3 wheel, release profile). Run after scripts/libtorch.sh, which creates the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

python=.venv/bin/python
if ! "${python}" -c 'import pytest, ml_dtypes' >/dev/null 2>&1; then
    "${python}" -m pip install --quiet --no-cache-dir pytest ml_dtypes >&2
fi
"${python}" -m pip install --quiet --no-cache-dir ./bindings/python >&2
