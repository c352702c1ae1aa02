#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, then runs formatting,
# lint and every test (unit, property, CLI and documentation tests).
#
#   bash scripts/test.sh
#
# PROPTEST_CASES raises (or lowers) the number of cases of every property test.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --locked --all-targets -- -D warnings
cargo test --locked
