//! Evaluating and exporting trained models: load a Hugging Face directory or a training
//! checkpoint, run the forward pass on given token ids, report the losses.

use std::path::Path;

use anyhow::{Context, Result, bail};
use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use serde::Serialize;
use tch::{Device, Kind, Tensor, nn};

use crate::checkpoint::{assign_params, is_training_checkpoint, load_training};
use crate::footprint::ensure_fits_in_host_memory;
use crate::hf::{TOKENIZER_FILE, export_hf, load_hf};
use crate::model::{ExpertShard, ModelConfig, Qwen3Model, causal_lm_loss, load_balancing_loss};
use crate::moe::MoeImpl;
use crate::tape::Tape;

/// A model loaded for evaluation; `vars` owns its parameters.
pub struct LoadedModel {
    pub vars: nn::VarStore,
    pub model: Qwen3Model,
}

/// How [`load_model`] stores the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadDtype {
    /// f32, whatever the files hold (evaluation, as transformers' `dtype=torch.float32`).
    Float32,
    /// A training checkpoint's own dtype (export); f32 for Hugging Face directories.
    AsSaved,
}

/// Refuses a model whose f32 parameters alone exceed the machine's physical memory (they are
/// built in f32 before anything is loaded into them).
fn check_memory(config: &ModelConfig) -> Result<()> {
    let params = config.parameter_count();
    ensure_fits_in_host_memory(params.saturating_mul(4), || {
        format!("the model's {params} parameters take, in f32,")
    })
}

/// Loads a Hugging Face model directory or a training checkpoint folder.
pub fn load_model(dir: &Path, dtype: LoadDtype) -> Result<LoadedModel> {
    let mut vars = nn::VarStore::new(Device::Cpu);
    let model = if is_training_checkpoint(dir) {
        let checkpoint = load_training(dir)?;
        check_memory(&checkpoint.state.model)?;
        let model = Qwen3Model::new(&vars.root(), &checkpoint.state.model);
        if dtype == LoadDtype::AsSaved {
            vars.set_kind(checkpoint.state.dtype.kind());
        }
        assign_params(&sorted_variables(&vars), &checkpoint.params, dir)?;
        assign_params(&model.expert_biases(), &checkpoint.params, dir)?;
        model
    } else {
        let config = ModelConfig::from_hf_config_json(&dir.join("config.json"))?;
        check_memory(&config)?;
        let model = Qwen3Model::new(&vars.root(), &config);
        load_hf(dir, &config, &sorted_variables(&vars), ExpertShard::ALL)?;
        model
    };
    Ok(LoadedModel { vars, model })
}

fn sorted_variables(vars: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut params: Vec<_> = vars.variables().into_iter().collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    params
}

/// Writes a training checkpoint's model as a Hugging Face directory at `out` (which must not
/// exist), with the checkpoint's `tokenizer.json` if it has one. The checkpoint is loaded into
/// a model first, so every tensor is checked against its config.
pub fn export(checkpoint: &Path, out: &Path) -> Result<()> {
    if !is_training_checkpoint(checkpoint) {
        bail!(
            "{} is not a training checkpoint (no state.json)",
            checkpoint.display()
        );
    }
    let loaded = load_model(checkpoint, LoadDtype::AsSaved)?;
    let params: Vec<(String, Tensor)> = sorted_variables(&loaded.vars)
        .into_iter()
        .chain(loaded.model.expert_biases())
        .collect();
    let tokenizer_file = checkpoint.join(TOKENIZER_FILE);
    let tokenizer = match tokenizer_file.is_file() {
        true => Some(crate::files::read_bytes(&tokenizer_file)?),
        false => None,
    };
    export_hf(out, loaded.model.config(), &params, tokenizer.as_deref())
}

/// Reads `input_ids [batch, seq]` (i64 or i32) from a safetensors file, as i64.
pub fn read_input_ids(path: &Path) -> Result<Tensor> {
    let bytes = crate::files::read_bytes(path)?;
    let file = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a valid safetensors file", path.display()))?;
    let view = file
        .tensor("input_ids")
        .with_context(|| format!("{} has no tensor `input_ids`", path.display()))?;
    let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
    if shape.len() != 2 || shape[0] < 1 || shape[1] < 2 {
        bail!(
            "input_ids must be [batch, seq] with at least one sequence of 2 or more tokens (the \
             loss predicts each next token), got shape {shape:?}"
        );
    }
    let kind = match view.dtype() {
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        other => bail!("input_ids must be i64 or i32, got {other:?}"),
    };
    Ok(Tensor::from_data_size(view.data(), &shape, kind).to_kind(Kind::Int64))
}

/// The losses of one evaluation (printed as one JSON line).
#[derive(Clone, Debug, Serialize)]
pub struct Losses {
    /// Mean next-token cross-entropy.
    pub loss: f64,
    /// Load-balancing loss before its coefficient.
    pub aux_loss: f64,
    /// `loss + router_aux_loss_coef · aux_loss`.
    pub total_loss: f64,
}

/// The forward pass on `input_ids [batch, seq]`: logits `[batch, seq, vocab]` (f32) and losses.
pub fn evaluate(
    model: &Qwen3Model,
    input_ids: &Tensor,
    moe: MoeImpl,
    block_size: usize,
) -> Result<(Tensor, Losses)> {
    let experts = moe.create(block_size)?;
    tch::no_grad(|| {
        let out = model.forward(input_ids, experts.as_ref(), &mut Tape::new(false))?;
        let config = model.config();
        let loss = causal_lm_loss(&out.logits, input_ids).double_value(&[]);
        let aux_loss = load_balancing_loss(&out.router_logits, config.num_experts_per_tok as i64)
            .double_value(&[]);
        let losses = Losses {
            loss,
            aux_loss,
            total_loss: loss + config.router_aux_loss_coef * aux_loss,
        };
        Ok((out.logits.to_kind(Kind::Float), losses))
    })
}
