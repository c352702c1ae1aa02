#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, then runs formatting,
# lint and every test (unit, property, CLI and documentation tests, the libtorch peer tests
# against torch 2.11 from the project's venv, and the trainer's tests, including parity with
# Hugging Face transformers).
#
#   bash scripts/test.sh
#
# PROPTEST_CASES raises (or lowers) the number of cases of every property test.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
# Assigned first so that a failing setup stops the script (set -e ignores failures inside eval).
libtorch_env="$(bash scripts/libtorch.sh)"
eval "${libtorch_env}"
# `import torch` and transformers in the same venv, for the trainer's parity tests.
bash scripts/transformers.sh
cargo fmt --all -- --check
cargo clippy --locked --all-targets -- -D warnings
cargo clippy --locked --all-targets --features libtorch -- -D warnings
cargo clippy --locked -p moekit-trainer --all-targets -- -D warnings
cargo test --locked --features libtorch --test libtorch
cargo test --locked
cargo test --locked -p moekit-trainer
