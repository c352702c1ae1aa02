#!/usr/bin/env bash
# Installs what building and testing moekit needs on a fresh machine, skipping what is already
# there. Sourced by scripts/test.sh; safe to run on its own.
set -euo pipefail

# System packages (Debian): command → package; g++ builds tch's C++ shim, python3-venv the
# libtorch venv, Open MPI the expert-parallel MPI tests. apt-get update runs once, only if something is missing.
declare -A APT_PACKAGES=([cc]=gcc [c++]=g++ [python3]=python3 [mpicc]=libopenmpi-dev [mpirun]=openmpi-bin)
missing=()
for command in "${!APT_PACKAGES[@]}"; do
    command -v "${command}" >/dev/null 2>&1 || missing+=("${APT_PACKAGES[${command}]}")
done
if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    missing+=(python3-venv)
fi
# libclang (with clang's headers) lets the test suite regenerate the committed Neuron bindings
# and compare (ffi/tests/bindings.rs); building needs none.
if ! dpkg -s libclang-dev >/dev/null 2>&1; then
    missing+=(libclang-dev)
fi
# DejaVu Sans labels the trainer's PNG plots.
if [ ! -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]; then
    missing+=(fonts-dejavu-core)
fi
if ((${#missing[@]})); then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    echo "setup: installing ${missing[*]}" >&2
    ${sudo} apt-get update -qq
    DEBIAN_FRONTEND=noninteractive ${sudo} apt-get install -y -qq "${missing[@]}"
fi

# The Rust toolchain comes from rustup (moekit needs Rust ≥ 1.89, newer than Debian's).
if ! command -v cargo >/dev/null 2>&1 || ! command -v rustup >/dev/null 2>&1; then
    echo "setup: moekit needs a rustup-managed Rust toolchain (≥ 1.89) on PATH" >&2
    exit 1
fi
rustc_minor=$(rustc --version | sed -E 's/^rustc 1\.([0-9]+).*/\1/')
if [ "${rustc_minor}" -lt 89 ]; then
    echo "setup: moekit needs Rust ≥ 1.89, found $(rustc --version)" >&2
    exit 1
fi
for component in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^${component}"; then
        rustup component add "${component}"
    fi
done
