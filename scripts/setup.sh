#!/usr/bin/env bash
# Installs what building and testing moekit needs on a fresh machine, skipping what is already
# there. Sourced by scripts/test.sh; safe to run on its own.
set -euo pipefail

# System packages (Debian): command → package. apt-get update runs once, only if one is missing.
declare -A APT_PACKAGES=([cc]=gcc)
missing=()
for command in "${!APT_PACKAGES[@]}"; do
    command -v "${command}" >/dev/null 2>&1 || missing+=("${APT_PACKAGES[${command}]}")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# The Rust toolchain comes from rustup (moekit needs Rust ≥ 1.89, newer than Debian's).
if ! command -v cargo >/dev/null 2>&1 || ! command -v rustup >/dev/null 2>&1; then
    echo "setup: moekit needs a rustup-managed Rust toolchain (≥ 1.89) on PATH" >&2
    exit 1
fi
for component in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^${component}"; then
        rustup component add "${component}"
    fi
done
