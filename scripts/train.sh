#!/usr/bin/env bash
# The main job, from a fresh clone: installs what it needs (scripts/setup.sh, then torch 2.11
# from PyPI into .venv through scripts/libtorch.sh), builds `moekit-train` in release mode and
# trains a Qwen3-MoE on a job config.
#
#   bash scripts/train.sh                                   # configs/qwen3_moe_debug.toml
#   bash scripts/train.sh --config configs/qwen3_moe_small.toml --kernels.moe torch
#
# Arguments go to `moekit-train` unchanged; without `--config` the debug config is used.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
# Assigned first so that a failing setup stops the script (set -e ignores failures inside eval).
libtorch_env="$(bash scripts/libtorch.sh)"
eval "${libtorch_env}"
cargo build --locked --release -p moekit-trainer --bin moekit-train

args=("$@")
if [[ " ${args[*]-} " != *" --config "* && " ${args[*]-} " != *" --config="* ]]; then
    args=(--config configs/qwen3_moe_debug.toml "${args[@]}")
fi
exec target/release/moekit-train "${args[@]}"
