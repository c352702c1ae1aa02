//! Qwen3-MoE and dense Qwen3 with Hugging Face semantics, in libtorch.

pub(crate) mod config;
mod layers;
mod loss;
mod qwen3;

pub use config::{ModelConfig, ModelName};
pub use loss::{causal_lm_loss, load_balancing_loss};
pub use qwen3::{ExpertShard, ForwardOutput, KvCache, Qwen3Model};
