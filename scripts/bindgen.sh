#!/usr/bin/env bash
# Regenerates the Neuron runtime bindings (ffi/src/bindings.rs) from ffi/nrt.h with bindgen
# (needs libclang: scripts/setup.sh installs it). Commit the result; the test suite checks it.
set -euo pipefail
cd "$(dirname "$0")/.."
MOEKIT_WRITE_BINDINGS=1 cargo test --locked -p moekit-nrt-sys --test bindings
