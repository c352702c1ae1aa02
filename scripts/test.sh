#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, then runs formatting,
# lint and every test (unit, property, CLI and documentation tests, the libtorch peer tests
# against torch 2.11 from the project's venv, the trainer's tests, including parity with
# Hugging Face transformers, the expert-parallel tests under mpirun, and the Neuron bindings
# generated from headers laid out as the SDK installs them).
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
cargo clippy --locked --all-targets --features mpi -- -D warnings
cargo test --locked --features libtorch --test libtorch
cargo test --locked
cargo test --locked -p moekit-trainer

# Expert parallelism over MPI: the test binary runs as 2 and 4 ranks (4 oversubscribed on
# small machines); with `fault`, invalid input on rank 1 must stop every rank and mpirun.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
host=$(rustc -vV | sed -n 's/^host: //p' | tr 'a-z-' 'A-Z_')
for ranks in 2 4; do
    env "CARGO_TARGET_${host}_RUNNER=mpirun -n ${ranks} --oversubscribe" \
        cargo test --locked --features mpi --test mpi
done
fault_log=$(mktemp)
if env "CARGO_TARGET_${host}_RUNNER=mpirun -n 2" \
    cargo test --locked --features mpi --test mpi -- fault 2>"${fault_log}"; then
    echo "mpi fault test: mpirun succeeded although rank 1 had invalid input" >&2
    exit 1
fi
for rank in 0 1; do
    grep -q "rank ${rank} stops: rank 1: tensor \`x\`: non-finite" "${fault_log}" || {
        cat "${fault_log}" >&2
        echo "mpi fault test: rank ${rank} did not report rank 1's error" >&2
        exit 1
    }
done
rm -f "${fault_log}"

# build.rs binds the Neuron SDK's headers where NEURON_RUNTIME_INCLUDE_DIR holds nrt/nrt.h:
# exercise that path with the project's declarations laid out as the SDK installs them.
sdk_include=$(mktemp -d)
mkdir -p "${sdk_include}/nrt"
cp ffi/nrt.h "${sdk_include}/nrt/nrt.h"
touch "${sdk_include}/nrt/nrt_experimental.h" "${sdk_include}/nrt/nrt_version.h"
NEURON_RUNTIME_INCLUDE_DIR="${sdk_include}" cargo check --locked --lib
rm -rf "${sdk_include}"
