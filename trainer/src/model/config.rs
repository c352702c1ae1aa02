//! The model's architecture hyper-parameters, Qwen3-MoE or dense Qwen3, with Hugging Face's
//! field names, read from a job config's `[model]` table or from a Hugging Face `config.json`.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use serde::{Deserialize, Serialize};
use serde_json::Value;

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

    fn from_model_type(model_type: &str) -> Result<Self> {
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

fn one() -> usize {
    1
}
fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_max_position_embeddings() -> usize {
    32_768
}
fn default_router_aux_loss_coef() -> f64 {
    0.001
}
fn default_initializer_range() -> f64 {
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

    /// Reads a Hugging Face `config.json`, in either form found in the wild: the Hub
    /// checkpoints' (`num_experts`, top-level `rope_theta`) or transformers v5's
    /// (`num_local_experts`, `rope_parameters.rope_theta`). Keys this model does not use are
    /// ignored; features it does not implement (attention bias or dropout, sliding windows,
    /// RoPE scaling, activations other than SiLU) are errors.
    pub fn from_hf_config_json(path: &Path) -> Result<Self> {
        let text = crate::files::read_text(path)
            .with_context(|| format!("cannot read model config {}", path.display()))?;
        let json: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_hf_json(&json).with_context(|| format!("in {}", path.display()))
    }

    /// [`Self::from_hf_config_json`] on parsed JSON.
    pub fn from_hf_json(json: &Value) -> Result<Self> {
        let object = json
            .as_object()
            .context("config.json must be a JSON object")?;
        let name = match object.get("model_type").and_then(Value::as_str) {
            Some(model_type) => ModelName::from_model_type(model_type)?,
            None => ModelName::default(),
        };
        let moe = name == ModelName::Qwen3Moe;
        if let Some(act) = object.get("hidden_act").and_then(Value::as_str)
            && act != "silu"
        {
            bail!("hidden_act \"{act}\" is not supported (Qwen3 uses \"silu\")");
        }
        if let Some(dropout) = object.get("attention_dropout").and_then(Value::as_f64)
            && dropout != 0.0
        {
            bail!("attention_dropout = {dropout} is not supported (only 0)");
        }
        for flag in ["attention_bias", "use_sliding_window"] {
            if object.get(flag).and_then(Value::as_bool) == Some(true) {
                bail!("{flag} = true is not supported by this Qwen3 implementation");
            }
        }
        let rope_parameters = object.get("rope_parameters").filter(|v| !v.is_null());
        if let Some(kind) = rope_parameters
            .and_then(|p| p.get("rope_type"))
            .and_then(Value::as_str)
            .filter(|&kind| kind != "default")
        {
            bail!("rope_type \"{kind}\" is not supported (only the default rotary embedding)");
        }
        if object.get("rope_scaling").is_some_and(|v| !v.is_null()) {
            bail!("rope_scaling is not supported (only the default rotary embedding)");
        }

        let usize_key = |key: &str| -> Result<Option<usize>> {
            object
                .get(key)
                .filter(|v| !v.is_null())
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .with_context(|| format!("`{key}` must be a non-negative integer, got {v}"))
                })
                .transpose()
        };
        let f64_key = |value: Option<&Value>, key: &str| -> Result<Option<f64>> {
            value
                .filter(|v| !v.is_null())
                .map(|v| {
                    v.as_f64()
                        .with_context(|| format!("`{key}` must be a number, got {v}"))
                })
                .transpose()
        };
        let bool_key = |key: &str| -> Result<Option<bool>> {
            object
                .get(key)
                .filter(|v| !v.is_null())
                .map(|v| {
                    v.as_bool()
                        .with_context(|| format!("`{key}` must be true or false, got {v}"))
                })
                .transpose()
        };
        let required = |key: &str| -> Result<usize> {
            usize_key(key)?.with_context(|| format!("missing `{key}`"))
        };

        let hidden_size = required("hidden_size")?;
        let num_attention_heads = required("num_attention_heads")?;
        // The MoE keys: required for Qwen3-MoE, absent (0) for the dense Qwen3.
        let moe_key = |key: &str| -> Result<usize> {
            match moe {
                true => required(key),
                false => Ok(0),
            }
        };
        let num_experts = match (usize_key("num_experts")?, usize_key("num_local_experts")?) {
            _ if !moe => 0,
            (Some(a), Some(b)) if a != b => {
                bail!("`num_experts` ({a}) and `num_local_experts` ({b}) disagree")
            }
            (Some(n), _) | (None, Some(n)) => n,
            (None, None) => bail!("missing `num_experts` (or `num_local_experts`)"),
        };
        let rope_theta = match (
            f64_key(object.get("rope_theta"), "rope_theta")?,
            f64_key(
                rope_parameters.and_then(|p| p.get("rope_theta")),
                "rope_parameters.rope_theta",
            )?,
        ) {
            (Some(a), Some(b)) if a != b => {
                bail!("`rope_theta` ({a}) and `rope_parameters.rope_theta` ({b}) disagree")
            }
            (Some(theta), _) | (None, Some(theta)) => theta,
            (None, None) => default_rope_theta(),
        };
        let mlp_only_layers = match object
            .get("mlp_only_layers")
            .filter(|v| moe && !v.is_null())
        {
            None => Vec::new(),
            Some(v) => v
                .as_array()
                .and_then(|layers| {
                    layers
                        .iter()
                        .map(|l| l.as_u64().and_then(|n| usize::try_from(n).ok()))
                        .collect::<Option<Vec<_>>>()
                })
                .with_context(|| {
                    format!("`mlp_only_layers` must be a list of layer indices, got {v}")
                })?,
        };
        let head_dim = match usize_key("head_dim")? {
            Some(d) => d,
            // Qwen3Config's default; Qwen3MoeConfig derives it.
            None if !moe => 128,
            None => {
                ensure!(
                    num_attention_heads > 0,
                    "`num_attention_heads` must be at least 1"
                );
                hidden_size / num_attention_heads
            }
        };
        let config = Self {
            name,
            vocab_size: required("vocab_size")?,
            hidden_size,
            intermediate_size: required("intermediate_size")?,
            moe_intermediate_size: moe_key("moe_intermediate_size")?,
            num_hidden_layers: required("num_hidden_layers")?,
            num_attention_heads,
            // transformers' defaults: Qwen3MoeConfig's 4, Qwen3Config's 32.
            num_key_value_heads: usize_key("num_key_value_heads")?.unwrap_or(match name {
                ModelName::Qwen3Moe => 4,
                ModelName::Qwen3 => 32,
            }),
            head_dim,
            num_experts,
            num_experts_per_tok: moe_key("num_experts_per_tok")?,
            decoder_sparse_step: match moe {
                true => usize_key("decoder_sparse_step")?.unwrap_or(1),
                false => 1,
            },
            mlp_only_layers,
            norm_topk_prob: moe && bool_key("norm_topk_prob")?.unwrap_or(false),
            rms_norm_eps: f64_key(object.get("rms_norm_eps"), "rms_norm_eps")?
                .unwrap_or_else(default_rms_norm_eps),
            rope_theta,
            max_position_embeddings: usize_key("max_position_embeddings")?
                .unwrap_or_else(default_max_position_embeddings),
            tie_word_embeddings: bool_key("tie_word_embeddings")?.unwrap_or(false),
            router_aux_loss_coef: f64_key(
                object.get("router_aux_loss_coef"),
                "router_aux_loss_coef",
            )?
            .unwrap_or_else(default_router_aux_loss_coef),
            initializer_range: f64_key(object.get("initializer_range"), "initializer_range")?
                .unwrap_or_else(default_initializer_range),
        };
        config.validate()?;
        Ok(config)
    }
}
