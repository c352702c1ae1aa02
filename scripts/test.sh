#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, then runs formatting,
# lint and every test (unit, property, CLI and documentation tests, the libtorch peer tests
# against torch 2.11 from the project's venv, the trainer's tests, including parity with
# Hugging Face transformers, the expert-parallel tests under mpirun, the Python package's pytest
# suite, and the committed Neuron bindings against what bindgen generates from ffi/nrt.h and
# from SDK-layout headers).
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
cargo clippy --locked -p moekit-tools --all-targets -- -D warnings
cargo clippy --locked -p moekit-tools --all-targets --features libtorch -- -D warnings
cargo clippy --locked -p moekit-tools --all-targets --features mpi -- -D warnings
# (`expert_parallel` runs only under mpirun, so --all-targets leaves it out: named here.)
cargo clippy --locked -p moekit-trainer --all-targets --test expert_parallel -- -D warnings
cargo clippy --locked --all-targets --features mpi -- -D warnings
cargo clippy --locked -p moekit-nrt-sys -p moekit-nrt-fake -p moekit-mpi-sys --all-targets -- -D warnings
PYO3_PYTHON="$(pwd)/.venv/bin/python" cargo clippy --locked -p moekit-python --all-targets -- -D warnings
# Building the library (with `mpi`) or the trainer needs no libclang: no bindings generator in
# their build graph (the Neuron bindings are committed; MPI goes through moekit's shim).
build_graph=$(cargo tree --locked -p moekit-trainer -p moekit-tools --features moekit-tools/mpi \
    -e normal,build --prefix none)
grep -q '^moekit-mpi-sys ' <<<"${build_graph}" || {
    echo "the trainer's build graph lacks moekit-mpi-sys: the check below would prove nothing" >&2
    exit 1
}
if grep -E '^(bindgen|clang-sys) ' <<<"${build_graph}"; then
    echo "building moekit or the trainer pulls in a bindings generator (libclang)" >&2
    exit 1
fi
# The documentation's links resolve (a renamed item breaks them).
RUSTDOCFLAGS="-D warnings" cargo doc --locked --no-deps -p moekit -p moekit-tools
# The committed Neuron runtime bindings are what bindgen generates now from ffi/nrt.h and from
# the same declarations laid out as the Neuron SDK installs them (needs libclang).
cargo test --locked -p moekit-nrt-sys
cargo test --locked -p moekit-tools --features libtorch --test libtorch
cargo test --locked
cargo test --locked -p moekit-tools
cargo test --locked -p moekit-trainer

# The Python package, installed as a user installs it, against the `moekit` command built above
# (bit for bit) and the reference; its `neuron` backend on the fake runtime the tests above built.
bash scripts/python.sh
fake_nrt=$(find target/debug/build -name libnrt_fake.so -print -quit)
MOEKIT_CLI=target/debug/moekit MOEKIT_FAKE_NRT="${fake_nrt}" \
    .venv/bin/python -m pytest -q bindings/python/tests

# Expert parallelism over MPI: the test binaries run as 2 and 4 ranks (4 oversubscribed on
# small machines). With `fault` (kernels) or `mismatch` (trainer), every rank must stop with
# the same error and mpirun must exit non-zero.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
host=$(rustc -vV | sed -n 's/^host: //p' | tr 'a-z-' 'A-Z_')
runner="CARGO_TARGET_${host}_RUNNER"
for ranks in 2 4; do
    env "${runner}=mpirun -n ${ranks} --oversubscribe" \
        cargo test --locked --features mpi --test mpi
    env "${runner}=mpirun -n ${ranks} --oversubscribe" \
        cargo test --locked -p moekit-trainer --test expert_parallel
done
# kernels.moe = "neuron" (on the fake runtime) with the experts sharded over 2 ranks.
env "${runner}=mpirun -n 2 --oversubscribe" cargo test --locked -p moekit-trainer --test neuron -- ep

# every_rank_stops PATTERN CARGO-TEST-ARGS...: runs them as 2 ranks; both must report PATTERN.
every_rank_stops() {
    local pattern=$1 log
    shift
    log=$(mktemp)
    if env "${runner}=mpirun -n 2" cargo test --locked "$@" 2>"${log}"; then
        cat "${log}" >&2
        echo "mpirun succeeded although the ranks should have stopped: $*" >&2
        exit 1
    fi
    for rank in 0 1; do
        grep -qF "rank ${rank} stops: ${pattern}" "${log}" || {
            cat "${log}" >&2
            echo "rank ${rank} did not report \`${pattern}\`: $*" >&2
            exit 1
        }
    done
    rm -f "${log}"
}
every_rank_stops 'rank 1: tensor `x`: non-finite' --features mpi --test mpi -- fault
every_rank_stops 'the ranks were given different job configs' \
    -p moekit-trainer --test expert_parallel -- mismatch

# fails_with PATTERN COMMAND...: COMMAND must exit non-zero within 300 s (timeout's 124 would
# mean a hang) and print PATTERN.
fails_with() {
    local pattern=$1 log status
    shift
    log=$(mktemp)
    set +e
    timeout 300 "$@" >"${log}" 2>&1
    status=$?
    set -e
    if [ "${status}" -eq 0 ] || [ "${status}" -eq 124 ] || ! grep -qF "${pattern}" "${log}"; then
        cat "${log}" >&2
        echo "$*: exit ${status}, expected a failure reporting \`${pattern}\`" >&2
        exit 1
    fi
    rm -f "${log}"
}

# A rank that stops answering (SIGSTOP) ends the job after the timeout, naming it, instead of
# holding the others forever.
fails_with 'rank 0 stops: rank(s) 1 did not answer within 1 s' \
    env "${runner}=mpirun -n 2 --oversubscribe" cargo test --locked --features mpi --test mpi -- stall

# moekit-train launched wrongly under mpirun must stop every rank with a message and a
# non-zero exit, never hang: E = 8 not divisible by R = 3, R = 2 or D = 2 asked of 3 ranks,
# R = D = 1 asked of 2 ranks, and ranks given different degrees (MPI_Abort after the ranks
# agree on the error).
# (The binary is the one `cargo test -p moekit-trainer` built above, in the test profile.)
cargo test --locked -p moekit-trainer --no-run
train=(target/debug/moekit-train train --config configs/qwen3_moe_debug.toml)
launch_fails() {
    local ranks=$1 pattern=$2 dump
    shift 2
    dump=$(mktemp -d)
    fails_with "${pattern}" mpirun -n "${ranks}" --oversubscribe "${train[@]}" \
        --job.dump_folder "${dump}" "$@"
    rm -rf "${dump}"
}
launch_fails 3 'parallelism.expert_parallel_degree = 3 must divide model.num_experts = 8' \
    --parallelism.expert_parallel_degree 3
launch_fails 3 'expert_parallel_degree = 2 and data_parallel_degree = 1 need 2 rank(s), but mpirun started 3' \
    --parallelism.expert_parallel_degree 2
launch_fails 3 'expert_parallel_degree = 1 and data_parallel_degree = 2 need 2 rank(s), but mpirun started 3' \
    --parallelism.data_parallel_degree 2
launch_fails 2 'expert_parallel_degree = 1 and data_parallel_degree = 1 need 1 rank(s), but mpirun started 2'
dump=$(mktemp -d)
fails_with 'parallelism.expert_parallel_degree is 2 on rank 0, 1 on rank(s) 1' \
    mpirun --oversubscribe -n 1 "${train[@]}" --job.dump_folder "${dump}" \
    --parallelism.expert_parallel_degree 2 : \
    -n 1 "${train[@]}" --job.dump_folder "${dump}" --parallelism.expert_parallel_degree 1
fails_with 'parallelism.data_parallel_degree is 2 on rank 0, 1 on rank(s) 1' \
    mpirun --oversubscribe -n 1 "${train[@]}" --job.dump_folder "${dump}" \
    --parallelism.data_parallel_degree 2 : \
    -n 1 "${train[@]}" --job.dump_folder "${dump}" --parallelism.expert_parallel_degree 2
rm -rf "${dump}"

# A rank stopped mid-training: once rank 0 has logged a step, rank 1 gets SIGSTOP; rank 0 must
# end the job after parallelism.collective_timeout_s, naming rank 1.
dump=$(mktemp -d)
log=$(mktemp)
set +e
timeout 300 mpirun -n 2 --oversubscribe "${train[@]}" --job.dump_folder "${dump}" \
    --parallelism.expert_parallel_degree 2 --parallelism.collective_timeout_s 5 \
    --training.steps 1000000 --metrics.log_freq 1 >"${log}" 2>&1 &
job=$!
until [ -s "${dump}/metrics.jsonl" ] || ! kill -0 "${job}" 2>/dev/null; do sleep 0.2; done
# This run's ranks are the processes whose command line names its dump folder.
for pid in $(pgrep -f -- "--job.dump_folder ${dump} "); do
    if grep -qxzF OMPI_COMM_WORLD_RANK=1 "/proc/${pid}/environ" 2>/dev/null; then
        kill -STOP "${pid}"
    fi
done
wait "${job}"
status=$?
set -e
pattern='rank 0 stops: rank(s) 1 did not answer within 5 s'
if [ "${status}" -eq 0 ] || [ "${status}" -eq 124 ] || ! grep -qF "${pattern}" "${log}"; then
    cat "${log}" >&2
    echo "a stopped rank 1: exit ${status}, expected a failure reporting \`${pattern}\`" >&2
    exit 1
fi
rm -rf "${log}" "${dump}"
