//! The Hugging Face format, both directions: `config.json` (the Hub's form and transformers
//! v5's, read by [`ModelConfig::from_hf_config_json`], written by [`hf_config_json`]) and the
//! weights (`model.safetensors` or the shards of `model.safetensors.index.json`) under
//! Hugging Face's tensor names, with the experts per expert (`mlp.experts.{e}.gate_proj.weight`
//! ...) where the trainer holds them fused in the kernels' layout.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path};

use anyhow::{Context, Result, bail, ensure};
use moekit_tools::golden::write_atomically;
use serde_json::Value;
use tch::{Kind, Tensor};

use crate::files::{assign, read_tensors, write_folder, write_json, write_tensors};
use crate::model::config::{
    default_initializer_range, default_max_position_embeddings, default_rms_norm_eps,
    default_rope_theta, default_router_aux_loss_coef,
};
use crate::model::{ExpertShard, ModelConfig, ModelName};

impl ModelConfig {
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

/// Suffix of the kernels' fused expert weights in the trainer's parameter names.
pub(crate) const GATE_UP: &str = "mlp.experts.gate_up_proj";
pub(crate) const DOWN: &str = "mlp.experts.down_proj";

/// Parameters in Hugging Face's per-expert layout: `gate_up_proj [E, H, 2, I]` becomes
/// `experts.{e}.gate_proj.weight [I, H]` and `experts.{e}.up_proj.weight [I, H]`, and
/// `down_proj [E, I, H]` becomes `experts.{e}.down_proj.weight [H, I]`; every other name is
/// already Hugging Face's. Tied heads are not written (as Hugging Face does).
pub fn to_hf_tensors(params: &[(String, Tensor)]) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    for (name, value) in params {
        let value = value.detach();
        if let Some(prefix) = name.strip_suffix(GATE_UP) {
            for e in 0..value.size()[0] {
                let expert = value.get(e); // [H, 2, I]
                for (slot, proj) in [(0, "gate_proj"), (1, "up_proj")] {
                    out.insert(
                        format!("{prefix}mlp.experts.{e}.{proj}.weight"),
                        expert.select(1, slot).transpose(0, 1).contiguous(),
                    );
                }
            }
        } else if let Some(prefix) = name.strip_suffix(DOWN) {
            for e in 0..value.size()[0] {
                out.insert(
                    format!("{prefix}mlp.experts.{e}.down_proj.weight"),
                    value.get(e).transpose(0, 1).contiguous(),
                );
            }
        } else {
            out.insert(name.clone(), value);
        }
    }
    out
}

/// The tensor the trainer calls `name` (shape `shape`), built from Hugging Face's tensors:
/// fused expert weights are gathered from their per-expert keys. (A tied model has no
/// `lm_head` parameter, so an untied one without `lm_head.weight` is an error.)
fn from_hf_tensor(
    name: &str,
    shape: &[i64],
    hf: &BTreeMap<String, Tensor>,
    shard: ExpertShard,
    source: &Path,
) -> Result<Tensor> {
    // A fused expert tensor holds `shape[0]` experts, from this shard's first.
    let first = shard.rank as i64 * shape[0];
    let get = |key: &str| {
        hf.get(key)
            .with_context(|| format!("{}: missing tensor `{key}`", source.display()))
    };
    // A per-expert tensor of the shape the fused one implies, before it is transposed and
    // stacked (which would panic on other shapes).
    let expert_tensor = |key: &str, expected: [i64; 2]| {
        let tensor = get(key)?;
        ensure!(
            tensor.size() == expected,
            "{}: tensor `{key}` has shape {:?}, the model expects {expected:?}",
            source.display(),
            tensor.size()
        );
        Ok(tensor)
    };
    let tensor = if let Some(prefix) = name.strip_suffix(GATE_UP) {
        // [E, H, 2, I] from gate_proj and up_proj [I, H].
        let expected = [shape[3], shape[1]];
        let experts = (first..first + shape[0])
            .map(|e| {
                let gate = expert_tensor(
                    &format!("{prefix}mlp.experts.{e}.gate_proj.weight"),
                    expected,
                )?;
                let up =
                    expert_tensor(&format!("{prefix}mlp.experts.{e}.up_proj.weight"), expected)?;
                Ok(Tensor::stack(
                    &[gate.transpose(0, 1), up.transpose(0, 1)],
                    1,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&experts, 0)
    } else if let Some(prefix) = name.strip_suffix(DOWN) {
        // [E, I, H] from down_proj [H, I].
        let expected = [shape[2], shape[1]];
        let experts = (first..first + shape[0])
            .map(|e| {
                let key = format!("{prefix}mlp.experts.{e}.down_proj.weight");
                Ok(expert_tensor(&key, expected)?.transpose(0, 1))
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&experts, 0)
    } else {
        get(name)?.shallow_clone()
    };
    ensure!(
        tensor.size() == shape,
        "{}: tensor for `{name}` has shape {:?}, the model expects {shape:?}",
        source.display(),
        tensor.size()
    );
    Ok(tensor)
}

/// The tensors of a Hugging Face model directory: `model.safetensors`, or the shards named by
/// `model.safetensors.index.json`.
fn read_hf_tensors(dir: &Path) -> Result<BTreeMap<String, Tensor>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if single.is_file() {
        return read_tensors(&single);
    }
    ensure!(
        index.is_file(),
        "{} has neither model.safetensors nor model.safetensors.index.json",
        dir.display()
    );
    let text = crate::files::read_text(&index)?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index.display()))?;
    let weight_map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{} has no `weight_map` object", index.display()))?;
    let mut shards: Vec<&str> = weight_map.values().filter_map(|v| v.as_str()).collect();
    shards.sort_unstable();
    shards.dedup();
    for shard in &shards {
        // A shard is a file of the directory itself: no separators, `..` or absolute paths.
        let mut components = Path::new(shard).components();
        ensure!(
            matches!(
                (components.next(), components.next()),
                (Some(Component::Normal(_)), None)
            ),
            "{}: shard `{shard}` is not a file name in {} (the index may only name files of \
             its own directory)",
            index.display(),
            dir.display()
        );
    }
    let mut tensors = BTreeMap::new();
    for shard in shards {
        tensors.extend(read_tensors(&dir.join(shard))?);
    }
    for key in weight_map.keys() {
        ensure!(
            tensors.contains_key(key),
            "{}: `{key}` is not in its shard",
            index.display()
        );
    }
    Ok(tensors)
}

/// Loads a Hugging Face model directory (`config.json` + safetensors) into `params`, after
/// checking that its architecture is `config`'s. The fused expert parameters take `shard`'s
/// experts ([`ExpertShard::ALL`] for every expert).
pub fn load_hf(
    dir: &Path,
    config: &ModelConfig,
    params: &[(String, Tensor)],
    shard: ExpertShard,
) -> Result<()> {
    let found = ModelConfig::from_hf_config_json(&dir.join("config.json"))?;
    if let Some(field) = architecture_difference(&found, config) {
        bail!(
            "{}: the checkpoint's {field} differs from the model config's",
            dir.display()
        );
    }
    let hf = read_hf_tensors(dir)?;
    assign(params, dir, |name, shape| {
        from_hf_tensor(name, shape, &hf, shard, dir)
    })?;
    let unknown = unknown_tensors(&hf, params, config.num_experts);
    if !unknown.is_empty() {
        const SHOWN: usize = 8;
        let more = unknown.len().saturating_sub(SHOWN);
        eprintln!(
            "warning: {}: {} tensor(s) the model does not have, not loaded: {}{}",
            dir.display(),
            unknown.len(),
            unknown[..unknown.len().min(SHOWN)].join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

/// The tensors of a Hugging Face directory that no parameter of the model reads, whichever
/// expert shard loads it: neither a parameter's own name nor, for a fused expert parameter
/// `{prefix}mlp.experts.gate_up_proj` or `down_proj`, a key `{prefix}mlp.experts.{e}.
/// {gate,up,down}_proj.weight` with e below `num_experts`.
fn unknown_tensors(
    hf: &BTreeMap<String, Tensor>,
    params: &[(String, Tensor)],
    num_experts: usize,
) -> Vec<String> {
    let names: BTreeSet<&str> = params.iter().map(|(name, _)| name.as_str()).collect();
    let expert_key = |key: &str| {
        let Some((prefix, rest)) = key.split_once("mlp.experts.") else {
            return false;
        };
        let Some((expert, projection)) = rest.split_once('.') else {
            return false;
        };
        let fused = match projection {
            "gate_proj.weight" | "up_proj.weight" => GATE_UP,
            "down_proj.weight" => DOWN,
            _ => return false,
        };
        expert.parse::<usize>().is_ok_and(|e| e < num_experts)
            && names.contains(format!("{prefix}{fused}").as_str())
    };
    hf.keys()
        .filter(|key| !names.contains(key.as_str()) && !expert_key(key))
        .cloned()
        .collect()
}

/// The first architecture field (anything that changes the function the weights compute)
/// where `a` and `b` differ.
fn architecture_difference(a: &ModelConfig, b: &ModelConfig) -> Option<&'static str> {
    let fields: [(&str, bool); 17] = [
        ("vocab_size", a.vocab_size == b.vocab_size),
        ("name", a.name == b.name),
        ("hidden_size", a.hidden_size == b.hidden_size),
        (
            "intermediate_size",
            a.intermediate_size == b.intermediate_size,
        ),
        (
            "moe_intermediate_size",
            a.moe_intermediate_size == b.moe_intermediate_size,
        ),
        (
            "num_hidden_layers",
            a.num_hidden_layers == b.num_hidden_layers,
        ),
        (
            "num_attention_heads",
            a.num_attention_heads == b.num_attention_heads,
        ),
        (
            "num_key_value_heads",
            a.num_key_value_heads == b.num_key_value_heads,
        ),
        ("head_dim", a.head_dim == b.head_dim),
        ("num_experts", a.num_experts == b.num_experts),
        (
            "num_experts_per_tok",
            a.num_experts_per_tok == b.num_experts_per_tok,
        ),
        (
            "decoder_sparse_step",
            a.decoder_sparse_step == b.decoder_sparse_step,
        ),
        ("mlp_only_layers", a.mlp_only_layers == b.mlp_only_layers),
        ("norm_topk_prob", a.norm_topk_prob == b.norm_topk_prob),
        ("rms_norm_eps", a.rms_norm_eps == b.rms_norm_eps),
        ("rope_theta", a.rope_theta == b.rope_theta),
        (
            "tie_word_embeddings",
            a.tie_word_embeddings == b.tie_word_embeddings,
        ),
    ];
    fields
        .into_iter()
        .find(|(_, same)| !same)
        .map(|(name, _)| name)
}

/// Hugging Face `config.json` for `config` (the Hub checkpoints' form, which every
/// transformers version reads).
/// A dense Qwen3 (`model_type` "qwen3") has none of the MoE keys.
pub fn hf_config_json(config: &ModelConfig, dtype: Kind) -> serde_json::Value {
    let mut json = serde_json::json!({
        "architectures": [config.name.architecture()],
        "model_type": config.name.model_type(),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": null,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_sliding_window": false,
        "torch_dtype": if dtype == Kind::BFloat16 { "bfloat16" } else { "float32" },
    });
    if config.name == ModelName::Qwen3Moe {
        let moe = serde_json::json!({
            "moe_intermediate_size": config.moe_intermediate_size,
            "num_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "decoder_sparse_step": config.decoder_sparse_step,
            "mlp_only_layers": config.mlp_only_layers,
            "norm_topk_prob": config.norm_topk_prob,
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "output_router_logits": false,
        });
        if let (Some(json), serde_json::Value::Object(moe)) = (json.as_object_mut(), moe) {
            json.extend(moe);
        }
    }
    json
}

/// Suffix of the aux-loss-free selection biases, which Hugging Face's format has no place for.
const EXPERT_BIAS: &str = ".mlp.expert_bias";

/// The tokenizer file of Hugging Face directories and training checkpoints.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Writes `params` as a Hugging Face directory (`config.json` + `model.safetensors`, and
/// `tokenizer` as [`TOKENIZER_FILE`] when given) at `dir`, which must not exist yet. Selection biases (`*.mlp.expert_bias`) are left out, with a
/// warning when they are not zero: transformers' router has none, so the export routes by the
/// probabilities alone.
pub fn export_hf(
    dir: &Path,
    config: &ModelConfig,
    params: &[(String, Tensor)],
    tokenizer: Option<&[u8]>,
) -> Result<()> {
    let (biases, params): (Vec<_>, Vec<_>) = params
        .iter()
        .map(|(name, p)| (name.clone(), p.shallow_clone()))
        .partition(|(name, _)| name.ends_with(EXPERT_BIAS));
    if biases
        .iter()
        .any(|(_, b)| b.abs().max().double_value(&[]) > 0.0)
    {
        eprintln!(
            "warning: the aux-loss-free selection biases (*{EXPERT_BIAS}) are not part of the \
             Hugging Face format and are left out of {}; its routing uses the router \
             probabilities alone",
            dir.display()
        );
    }
    let dtype = params.first().map_or(Kind::Float, |(_, p)| p.kind());
    let tensors = to_hf_tensors(&params);
    write_folder(dir, |tmp| {
        write_json(&tmp.join("config.json"), &hf_config_json(config, dtype))?;
        if let Some(json) = tokenizer {
            write_atomically(&tmp.join(TOKENIZER_FILE), json)?;
        }
        write_tensors(&tmp.join("model.safetensors"), &tensors)
    })
}
