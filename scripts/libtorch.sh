#!/usr/bin/env bash
# Sets up libtorch 2.11 (the version tch 0.24 binds) in the project's Python venv, idempotently,
# and prints the environment that builds and runs against it:
#
#   eval "$(bash scripts/libtorch.sh)"
#
# torch comes from PyPI. Its CUDA dependencies are gigabytes and unused on CPU, so torch is
# installed without them, plus the two CUDA runtime libraries that libtorch_cpu.so links
# (cudart and cupti, ~50 MB). pip keeps no cached copy of the wheels (--no-cache-dir): the
# installed files are all that is needed, and the torch wheel alone is ~500 MB.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
python=${PYTHON:-python3}
if [ ! -x "${venv}/bin/python" ]; then
    "${python}" -m venv "${venv}" >&2
fi
if ! "${venv}/bin/python" -m pip show torch 2>/dev/null | grep -q '^Version: 2.11.0'; then
    "${venv}/bin/python" -m pip install --quiet --no-cache-dir --no-deps torch==2.11.0 >&2
fi
if ! "${venv}/bin/python" -m pip show nvidia-cuda-runtime nvidia-cuda-cupti >/dev/null 2>&1; then
    "${venv}/bin/python" -m pip install --quiet --no-cache-dir 'cuda-toolkit[cudart,cupti]==13.0.2' >&2
fi
libtorch="$(cd "${venv}" && pwd)/lib/python3.11/site-packages/torch"
if [ ! -f "${libtorch}/lib/libtorch_cpu.so" ]; then
    libtorch="$("${venv}/bin/python" -c 'import pathlib, sysconfig; print(pathlib.Path(sysconfig.get_paths()["purelib"]) / "torch")')"
fi
echo "export LIBTORCH='${libtorch}'"
