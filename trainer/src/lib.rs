//! # moekit-trainer
//!
//! Trains Qwen3-MoE models (Hugging Face semantics) on libtorch through `tch`, with the MoE
//! experts on the implementation the job config names: libtorch's own ops (`torch`,
//! `grouped_mm`) or moekit's kernels (`reference`, `cpu`), whose backward is stitched into
//! autograd.
//!
//! - [`mod@bench`]: training throughput of each MoE implementation.
//! - [`config`]: the TOML job config and its command-line overrides.
//! - [`device`]: `cpu` or `cuda`, and loading libtorch's CUDA library.
//! - [`hf`]: the Hugging Face format: `config.json` and the weights, read and written.
//! - [`checkpoint`]: training checkpoints (save, verify, rotate, resume).
//! - [`files`]: bounded reads of user files; atomic writes of tensors, JSON and folders.
//! - [`model`]: Qwen3-MoE and its losses.
//! - [`moe`]: the experts' implementations.
//! - [`tape`]: running kernels outside autograd inside a backward pass.
//! - [`eval`]: loading, evaluating and exporting trained models.
//! - [`generate`]: text generation on a KV cache, greedy or sampled.
//! - [`data`]: tokenization, the built-in corpus and batching.
//! - [`optim`]: AdamW, clipping, the learning-rate schedule.
//! - [`parallel`]: expert parallelism across MPI ranks.
//! - [`plots`]: PNG plots of the loss and the expert load.
//! - [`train`]: the training loop and its metrics.

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
pub mod eval;
pub mod files;
pub mod footprint;
pub mod generate;
pub mod hf;
pub mod model;
pub mod moe;
pub mod oom;
pub mod optim;
pub mod parallel;
pub mod plots;
pub mod shim;
pub mod tape;
pub mod train;
