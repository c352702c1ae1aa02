#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, then runs formatting,
# lint and every test (unit, property and CLI tests).
#
#   bash scripts/test.sh
#
# PROPTEST_CASES raises (or lowers) the number of cases of every property test.
set -euo pipefail
cd "$(dirname "$0")/.."

# rustfmt and clippy ship as rustup components; a minimal toolchain may lack them.
for component in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^${component}"; then
        rustup component add "${component}"
    fi
done

cargo fmt --all -- --check
cargo clippy --locked --all-targets -- -D warnings
cargo test --locked
