#!/usr/bin/env bash
# Makes `import torch` and Hugging Face transformers work in the project's venv (after
# scripts/libtorch.sh), idempotently, for the trainer's parity tests against transformers.
#
#   bash scripts/transformers.sh
#
# PyPI's torch 2.11 wheel is a CUDA build: its Python module links libtorch_cuda.so, which
# needs cuBLAS, cuDNN, cuFFT, cuFile, cuRAND, cuSPARSE(Lt), NCCL and NVSHMEM at load time even
# on a CPU-only machine (~1.7 GB of wheels). The pins are the ones torch 2.11.0's own metadata
# requires; cuSOLVER, NVRTC, triton and cuda-bindings load lazily and are left out (pip then
# reports them as unmet dependencies of torch, harmlessly). As in scripts/libtorch.sh, pip keeps
# no cached copy of the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/libtorch.sh >/dev/null
python=.venv/bin/python
if ! "${python}" -c 'import torch, transformers' >/dev/null 2>&1; then
    echo "transformers: installing torch's CUDA libraries and transformers into .venv" >&2
    "${python}" -m pip install --quiet --no-cache-dir \
        'cuda-toolkit[cudart,cupti,cublas,cufft,cufile,curand,cusparse,nvjitlink]==13.0.2' \
        nvidia-cudnn-cu13==9.19.0.56 nvidia-cusparselt-cu13==0.8.0 nvidia-nccl-cu13==2.28.9 \
        nvidia-nvshmem-cu13==3.4.5 \
        filelock 'typing-extensions>=4.10.0' 'sympy>=1.13.3' 'networkx>=2.5.1' jinja2 \
        'fsspec>=0.8.5' transformers==5.24.0 >&2
fi
"${python}" -c 'import torch, transformers' >&2
