//! Qwen3-MoE with Hugging Face semantics, in libtorch.

mod config;
mod layers;
mod loss;
mod qwen3_moe;

pub use config::Qwen3MoeConfig;
pub use loss::{causal_lm_loss, load_balancing_loss};
pub use qwen3_moe::{ExpertShard, ForwardOutput, Qwen3Moe};
