#!/usr/bin/env bash
# Installs the Python package `moekit` (bindings/python) from this checkout into the project's
# venv, with what its test suite needs (pytest, ml_dtypes for bfloat16 NumPy arrays, and
# torchtitan 0.3 for the override's tests):
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
# torchtitan 0.3.0 without the dependencies of its trainer (datasets, wandb, tensorboard, ...):
# only what `torchtitan.config` and `torchtitan.models.common.moe` import, and triton at the
# version torch 2.11 pins (its token dispatcher imports triton).
if ! "${python}" -c 'import torchtitan.config, torchtitan.models.common.moe' >/dev/null 2>&1; then
    "${python}" -m pip install --quiet --no-cache-dir --no-deps torchtitan==0.3.0 >&2
    "${python}" -m pip install --quiet --no-cache-dir spmd_types==0.2.3 tyro triton==3.6.0 >&2
fi
"${python}" -m pip install --quiet --no-cache-dir ./bindings/python >&2
