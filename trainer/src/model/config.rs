//! The model's architecture hyper-parameters, Qwen3-MoE or dense Qwen3, with Hugging Face's
//! field names, read from a job config's `[model]` table or from a Hugging Face `config.json`.

use std::collections::BTreeSet;

use anyhow::{Result, bail, ensure};
use serde::{Deserialize, Serialize};

/// Which Hugging Face architecture a model is: its `model_type`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ModelName {
    /// `qwen3_moe`, `Qwen3MoeForCausalLM`: MoE blocks (with dense MLPs where
    /// `mlp_only_layers` and `decoder_sparse_step` say).
    #[default]
    Qwen3Moe,
    /// `qwen3`, `Qwen3ForCausalLM`: the same attention, norms and RoPE, a dense SwiGLU MLP in
    /// every layer.
    Qwen3,
}

impl ModelName {
    /// The `model_type` of Hugging Face's `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Qwen3Moe => "qwen3_moe",
            Self::Qwen3 => "qwen3",
        }
    }

    /// The transformers class, for `config.json`'s `architectures`.
    pub fn architecture(self) -> &'static str {
        match self {
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The model a `config.json`'s `model_type` names.
    pub fn from_model_type(model_type: &str) -> Result<Self> {
        match model_type {
            "qwen3_moe" => Ok(Self::Qwen3Moe),
            "qwen3" => Ok(Self::Qwen3),
            other => bail!("model_type is \"{other}\", expected \"qwen3_moe\" or \"qwen3\""),
        }
    }
}

/// Qwen3-MoE or dense Qwen3 hyper-parameters (Hugging Face's `Qwen3MoeConfig` and `Qwen3Config`
/// names and defaults). A dense model (`name = "qwen3"`) leaves the MoE keys out: they are 0
/// (or empty) there.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The architecture (default `qwen3_moe`).
    #[serde(default)]
    pub name: ModelName,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Intermediate size of the dense SwiGLU MLP of non-MoE layers.
    pub intermediate_size: usize,
    /// I, the intermediate size of each expert.
    #[serde(default)]
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// E.
    #[serde(default)]
    pub num_experts: usize,
    /// K.
    #[serde(default)]
    pub num_experts_per_tok: usize,
    /// Layer `i` is an MoE layer iff `i ∉ mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`.
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    /// Divide the top-K probabilities by their sum.
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_router_aux_loss_coef")]
    pub router_aux_loss_coef: f64,
    #[serde(default = "default_initializer_range")]
    pub initializer_range: f64,
}

pub(crate) fn one() -> usize {
    1
}
pub(crate) fn default_rms_norm_eps() -> f64 {
    1e-6
}
pub(crate) fn default_rope_theta() -> f64 {
    10_000.0
}
pub(crate) fn default_max_position_embeddings() -> usize {
    32_768
}
pub(crate) fn default_router_aux_loss_coef() -> f64 {
    0.001
}
pub(crate) fn default_initializer_range() -> f64 {
    0.02
}

impl ModelConfig {
    /// Whether decoder layer `layer` has an MoE block (otherwise a dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.name == ModelName::Qwen3Moe
            && !self.mlp_only_layers.contains(&layer)
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// The decoder layers that have an MoE block, ascending.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.num_hidden_layers)
            .filter(|&l| self.is_moe_layer(l))
            .collect()
    }

    /// Number of MoE layers: every `decoder_sparse_step`-th, less those `mlp_only_layers`
    /// names (counted without visiting every layer).
    pub fn moe_layer_count(&self) -> usize {
        if self.name == ModelName::Qwen3 {
            return 0;
        }
        let step = self.decoder_sparse_step.max(1);
        let dense_named: BTreeSet<usize> = self
            .mlp_only_layers
            .iter()
            .copied()
            .filter(|&l| l < self.num_hidden_layers && (l + 1).is_multiple_of(step))
            .collect();
        self.num_hidden_layers / step - dense_named.len()
    }

    /// Total parameter count (experts counted once each; the tied head counted once).
    pub fn parameter_count(&self) -> u128 {
        let (h, v) = (self.hidden_size as u128, self.vocab_size as u128);
        // Per layer: q_norm, k_norm and the two layer norms besides the matrices.
        let norms = 2 * self.head_dim as u128 + 2 * h;
        let layers = self.matrix_params(self.num_experts) + self.num_hidden_layers as u128 * norms;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + layers + h + head
    }

    /// Matrix parameters of the decoder layers (attention projections, then in MoE layers the
    /// router and `experts` experts, in the others the dense MLP): all of them with
    /// `experts = E`, those a token multiplies with `experts = K`.
    pub fn matrix_params(&self, experts: usize) -> u128 {
        let h = self.hidden_size as u128;
        let d = self.head_dim as u128;
        let attention = h * d * 2 * (self.num_attention_heads + self.num_key_value_heads) as u128;
        let moe = h * self.num_experts as u128
            + experts as u128 * 3 * h * self.moe_intermediate_size as u128;
        let dense = 3 * h * self.intermediate_size as u128;
        let moe_layers = self.moe_layer_count() as u128;
        let dense_layers = self.num_hidden_layers as u128 - moe_layers;
        self.num_hidden_layers as u128 * attention + moe_layers * moe + dense_layers * dense
    }

    /// Checks that the hyper-parameters describe a buildable model.
    pub fn validate(&self) -> Result<()> {
        let moe_keys = [
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
        ];
        let mut positive = vec![
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("decoder_sparse_step", self.decoder_sparse_step),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        match self.name {
            ModelName::Qwen3Moe => positive.extend(moe_keys),
            ModelName::Qwen3 => {
                let set = moe_keys
                    .iter()
                    .filter(|(_, value)| *value != 0)
                    .map(|(name, value)| (*name, value.to_string()))
                    .chain(
                        (!self.mlp_only_layers.is_empty())
                            .then(|| ("mlp_only_layers", format!("{:?}", self.mlp_only_layers))),
                    )
                    .chain(
                        (self.decoder_sparse_step != 1)
                            .then(|| ("decoder_sparse_step", self.decoder_sparse_step.to_string())),
                    )
                    .chain(
                        self.norm_topk_prob
                            .then(|| ("norm_topk_prob", "true".to_owned())),
                    );
                if let Some((key, value)) = set.into_iter().next() {
                    bail!(
                        "model.{key} = {value} configures experts, but model.name = \"qwen3\" is \
                         the dense Qwen3 (use \"qwen3_moe\" for experts)"
                    );
                }
            }
        }
        // Sizes reach libtorch as i64, and parameter counts are their products in u128: a
        // bound of i32::MAX on each keeps both exact.
        const LARGEST: usize = i32::MAX as usize;
        for (name, value) in positive {
            ensure!(value > 0, "model.{name} must be at least 1, got {value}");
            ensure!(
                value <= LARGEST,
                "model.{name} must be at most {LARGEST}, got {value}"
            );
        }
        ensure!(
            self.num_attention_heads
                .is_multiple_of(self.num_key_value_heads),
            "model.num_attention_heads ({}) must be a multiple of model.num_key_value_heads ({})",
            self.num_attention_heads,
            self.num_key_value_heads
        );
        ensure!(
            self.head_dim.is_multiple_of(2),
            "model.head_dim must be even for rotary embeddings, got {}",
            self.head_dim
        );
        ensure!(
            self.num_experts_per_tok <= self.num_experts,
            "model.num_experts_per_tok ({}) exceeds model.num_experts ({})",
            self.num_experts_per_tok,
            self.num_experts
        );
        if let Some(&layer) = self
            .mlp_only_layers
            .iter()
            .find(|&&l| l >= self.num_hidden_layers)
        {
            bail!(
                "model.mlp_only_layers names layer {layer}, but the model has {} layers",
                self.num_hidden_layers
            );
        }
        let positive_reals = [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
            ("initializer_range", self.initializer_range),
        ];
        for (name, value) in positive_reals {
            ensure!(
                value.is_finite() && value > 0.0,
                "model.{name} must be a positive finite number, got {value}"
            );
        }
        ensure!(
            self.router_aux_loss_coef.is_finite() && self.router_aux_loss_coef >= 0.0,
            "model.router_aux_loss_coef must be a non-negative finite number, got {}",
            self.router_aux_loss_coef
        );
        Ok(())
    }
}
