//! # moekit-tools
//!
//! What is built on the `moekit` kernel library rather than inside it:
//!
//! - the `moekit` command (`src/bin/moekit.rs`): `list`, `info`, `run`, `check`, `bench`, `neuron`,
//!   `ep-bench`;
//! - [`layer`]: a routed MoE layer on seeded inputs, the fixture benchmarks and checks run
//!   kernels on;
//! - [`mod@bench`]: kernel benchmarks against the machine's measured limits, and beside libtorch;
//! - [`check`]: a backend against the reference, per output tensor;
//! - [`catalog`]: the kernel catalog as `moekit list` prints it;
//! - [`machine`]: the host's CPU, caches and the cpu kernels' instruction-set level, as
//!   `moekit info` prints them;
//! - [`golden`]: named-tensor files (safetensors) for comparing against other implementations,
//!   and the atomic file writes every saved file goes through;
//! - `torch` (feature `libtorch`): conversions to and from libtorch tensors;
//! - `torch_moe` (feature `libtorch`): the MoE layer the ways PyTorch computes it (Hugging
//!   Face's router and eager expert loop, `torch._grouped_mm`), for the benchmark's peers and
//!   the trainer.

pub mod bench;
pub mod catalog;
pub mod check;
pub mod golden;
pub mod layer;
pub mod machine;
#[cfg(feature = "libtorch")]
pub mod torch;
#[cfg(feature = "libtorch")]
pub mod torch_moe;
