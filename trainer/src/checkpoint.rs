//! Checkpoints: Hugging Face model directories (read and written directly) and training
//! checkpoints (model, AdamW state, step and data position) that resume a run exactly.
//!
//! Everything is written into a temporary folder beside the destination and renamed into place
//! once complete, so an existing checkpoint or export is never overwritten or left half-written.
//! A training checkpoint's last file, `checksums.json`, records the length and CRC-32 of every
//! other file; a resume takes the newest checkpoint whose files still match it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use moekit::golden::{TensorFile, write_atomically};
use moekit::torch::{from_tch, to_tch};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::config::ParamDtype;
use crate::model::{ExpertShard, ModelConfig, ModelName};

/// Suffix of the kernels' fused expert weights in the trainer's parameter names.
const GATE_UP: &str = "mlp.experts.gate_up_proj";
const DOWN: &str = "mlp.experts.down_proj";

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

/// Copies `values` into the parameters (same names), converting each from f32 or bf16 to its
/// parameter's dtype; `source` names where the values come from.
fn assign(
    params: &[(String, Tensor)],
    source: &Path,
    values: impl Fn(&str, &[i64]) -> Result<Tensor>,
) -> Result<()> {
    let loaded = params
        .iter()
        .map(|(name, p)| {
            let value = values(name, &p.size())?;
            ensure!(
                matches!(value.kind(), Kind::Float | Kind::BFloat16),
                "{}: tensor for `{name}` holds {:?} values; parameters load from f32 or bf16",
                source.display(),
                value.kind()
            );
            Ok(value)
        })
        .collect::<Result<Vec<_>>>()?;
    tch::no_grad(|| {
        for ((_, p), value) in params.iter().zip(loaded) {
            p.shallow_clone().copy_(&value.to_kind(p.kind()));
        }
    });
    Ok(())
}

/// Reads every tensor of a safetensors file into libtorch tensors.
fn read_tensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let file = TensorFile::read(path)?;
    Ok(file
        .tensors
        .iter()
        .map(|(name, t)| (name.clone(), to_tch(t)))
        .collect())
}

/// Writes libtorch tensors as one safetensors file (atomically).
fn write_tensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let mut file = TensorFile::default();
    for (name, tensor) in tensors {
        file.tensors.insert(name.clone(), from_tch(name, tensor)?);
    }
    file.write(path)?;
    Ok(())
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

/// Builds a folder at `dir` (which must not exist) by filling a temporary sibling with `fill`
/// and renaming it into place; on failure the temporary folder is removed.
fn write_folder(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    ensure!(
        !dir.exists(),
        "{} already exists; choose another path or remove it first",
        dir.display()
    );
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    // Folders that writes killed mid-way left here, `<name>.tmp-<pid>` of a process now gone.
    moekit::golden::remove_stale_temporaries(dir);
    let mut tmp_name = dir.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.with_file_name(tmp_name);
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let result = fill(&tmp).and_then(|()| {
        std::fs::rename(&tmp, dir)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), dir.display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    write_atomically(path, text.as_bytes())?;
    Ok(())
}

/// The manifest a training checkpoint writes last: the length and CRC-32 of each other file.
const CHECKSUMS: &str = "checksums.json";

/// One file's length and CRC-32 (IEEE).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
struct FileDigest {
    bytes: u64,
    crc32: u32,
}

impl FileDigest {
    /// Reads `path` through once.
    fn of(path: &Path) -> Result<Self> {
        let mut file =
            std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
        let mut hasher = crc32fast::Hasher::new();
        let mut buffer = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let read = file
                .read(&mut buffer)
                .with_context(|| format!("cannot read {}", path.display()))?;
            if read == 0 {
                break;
            }
            hasher.update(&buffer[..read]);
            bytes += read as u64;
        }
        Ok(Self {
            bytes,
            crc32: hasher.finalize(),
        })
    }
}

/// Writes `dir/checksums.json`: the digest of every other regular file in `dir`.
fn write_checksums(dir: &Path) -> Result<()> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != CHECKSUMS && entry.file_type()?.is_file() {
            files.insert(name, FileDigest::of(&entry.path())?);
        }
    }
    write_json(&dir.join(CHECKSUMS), &files)
}

/// Checks every file `dir/checksums.json` lists against its recorded length and CRC-32: an
/// error naming the first that differs or is missing. A checkpoint written before checkpoints
/// carried checksums (no `checksums.json`) passes with a warning.
pub fn verify_checkpoint(dir: &Path) -> Result<()> {
    let path = dir.join(CHECKSUMS);
    if !path.exists() {
        eprintln!(
            "warning: {} has no {CHECKSUMS}; its files cannot be verified",
            dir.display()
        );
        return Ok(());
    }
    let text = crate::files::read_text(&path)?;
    let files: BTreeMap<String, FileDigest> = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a valid checksum manifest", path.display()))?;
    for (name, recorded) in &files {
        let file = dir.join(name);
        ensure!(
            Path::new(name).components().count() == 1 && file.is_file(),
            "{}: `{name}`, listed in {CHECKSUMS}, is missing",
            dir.display()
        );
        let found = FileDigest::of(&file)?;
        ensure!(
            found == *recorded,
            "{} is damaged: {} bytes with CRC-32 {:08x}, {CHECKSUMS} records {} bytes with \
             CRC-32 {:08x}",
            file.display(),
            found.bytes,
            found.crc32,
            recorded.bytes,
            recorded.crc32
        );
    }
    Ok(())
}

/// Where a resume found its checkpoint ([`select_checkpoint`]).
#[derive(Debug, Default)]
pub struct Selection {
    /// The newest checkpoint whose files pass [`verify_checkpoint`], as (step, folder).
    pub newest: Option<(usize, PathBuf)>,
    /// The newer checkpoints that failed, newest first, with why.
    pub damaged: Vec<(PathBuf, anyhow::Error)>,
}

/// Looks for the newest verified checkpoint in `folder`, newest first; reads only. An error
/// when checkpoints exist but none passes (naming why the newest failed), since starting over
/// would write over their steps.
pub fn select_checkpoint(folder: &Path) -> Result<Selection> {
    let mut selection = Selection::default();
    for (step, dir) in list_checkpoints(folder)?.into_iter().rev() {
        match verify_checkpoint(&dir) {
            Ok(()) => {
                selection.newest = Some((step, dir));
                return Ok(selection);
            }
            Err(err) => selection.damaged.push((dir, err)),
        }
    }
    match selection.damaged.first() {
        None => Ok(selection),
        Some((dir, err)) => bail!(
            "no checkpoint in {} passes verification; the newest, {}, fails: {err:#}",
            folder.display(),
            dir.display()
        ),
    }
}

/// Reports the damaged checkpoints of `selection` and renames each to `<name>.damaged` (or
/// `.damaged-N`), out of the way of the steps the resumed run writes again; nothing is
/// deleted.
pub fn set_aside_damaged(selection: &Selection) -> Result<()> {
    let Some((step, newest)) = &selection.newest else {
        return Ok(());
    };
    for (dir, err) in &selection.damaged {
        let mut aside = dir.with_extension("damaged");
        for n in 1.. {
            if !aside.exists() {
                break;
            }
            aside = dir.with_extension(format!("damaged-{n}"));
        }
        std::fs::rename(dir, &aside)
            .with_context(|| format!("cannot rename {} to {}", dir.display(), aside.display()))?;
        eprintln!(
            "warning: {err:#}; resuming from {} (step {step}) instead, the damaged checkpoint \
             kept as {}",
            newest.display(),
            aside.display()
        );
    }
    Ok(())
}

/// The run state a training checkpoint stores beside the tensors (`state.json`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct TrainingState {
    /// Optimizer steps taken.
    pub step: usize,
    pub model: ModelConfig,
    /// The data order's seed, epoch and position.
    pub data_seed: u64,
    pub data_epoch: u64,
    pub data_cursor: usize,
    /// Length and FNV-1a hash of the tokenized training data, so a resume on other data (or
    /// another tokenizer) is caught.
    pub data_tokens: usize,
    pub data_hash: u64,
    pub batch_size: usize,
    pub seq_len: usize,
    pub gradient_accumulation_steps: usize,
    /// Parameter dtype (bf16 checkpoints hold f32 master weights in the optimizer state).
    pub dtype: ParamDtype,
    /// R, the ranks the experts were sharded over; with R > 1 each rank's parameters and
    /// optimizer state are in their own files.
    #[serde(default = "one_rank")]
    pub expert_parallel_degree: usize,
}

fn one_rank() -> usize {
    1
}

/// A training checkpoint's contents.
pub struct TrainingCheckpoint {
    pub state: TrainingState,
    /// Parameters by the trainer's names.
    pub params: BTreeMap<String, Tensor>,
    /// AdamW's `exp_avg.{name}`, `exp_avg_sq.{name}` and, for bf16 parameters, the f32
    /// `master.{name}`.
    pub optimizer: BTreeMap<String, Tensor>,
}

/// Folder name of the checkpoint after `step` steps.
pub fn step_folder(step: usize) -> String {
    format!("step-{step:08}")
}

/// The checkpoints in `folder`, oldest first, as (step, path).
pub fn list_checkpoints(folder: &Path) -> Result<Vec<(usize, PathBuf)>> {
    if !folder.exists() {
        return Ok(Vec::new());
    }
    let mut found = Vec::new();
    for entry in std::fs::read_dir(folder)
        .with_context(|| format!("cannot list checkpoints in {}", folder.display()))?
    {
        let path = entry?.path();
        let step = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<usize>().ok());
        if let (Some(step), true) = (step, path.is_dir()) {
            found.push((step, path));
        }
    }
    found.sort();
    Ok(found)
}

/// The files holding rank `rank` of `ranks`' parameters and optimizer state:
/// `model.safetensors` and `optimizer.safetensors` on a single process,
/// `model-rank{r}-of-{R}.safetensors` and `optimizer-rank{r}-of-{R}.safetensors` otherwise.
fn shard_files(rank: usize, ranks: usize) -> (String, String) {
    if ranks == 1 {
        return (
            "model.safetensors".to_owned(),
            "optimizer.safetensors".to_owned(),
        );
    }
    (
        format!("model-rank{rank}-of-{ranks}.safetensors"),
        format!("optimizer-rank{rank}-of-{ranks}.safetensors"),
    )
}

/// Writes a training checkpoint into `folder/step-NNNNNNNN` (plus `config.json`, so the
/// folder also names its architecture, and the training data's `tokenizer` as
/// [`TOKENIZER_FILE`]), then deletes all but the newest `keep_latest_k`
/// checkpoints (0 keeps all). A single process's checkpoint; expert-parallel runs write theirs
/// in the stages below, one shard per rank.
pub fn save_training(
    folder: &Path,
    keep_latest_k: usize,
    checkpoint: &TrainingCheckpoint,
    tokenizer: Option<&[u8]>,
) -> Result<PathBuf> {
    let tmp = begin_training(folder, checkpoint.state.step)?;
    let result = write_training_shard(&tmp, 0, 1, checkpoint)
        .and_then(|()| finish_training(&tmp, folder, keep_latest_k, &checkpoint.state, tokenizer));
    if result.is_err() {
        abandon_training(&tmp);
    }
    result
}

/// Stage 1 (one process): the temporary folder, beside the final one, that the checkpoint of
/// `step` is written into. The final folder must not exist yet.
pub fn begin_training(folder: &Path, step: usize) -> Result<PathBuf> {
    let dir = folder.join(step_folder(step));
    ensure!(
        !dir.exists(),
        "{} already exists; choose another path or remove it first",
        dir.display()
    );
    let tmp = staging_folder(folder, step);
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    Ok(tmp)
}

/// Where the checkpoint of `step` is written before it is renamed into place.
pub fn staging_folder(folder: &Path, step: usize) -> PathBuf {
    folder.join(format!("{}.tmp", step_folder(step)))
}

/// Removes the staging folders ([`staging_folder`]) that saves interrupted by a crash or a kill
/// left in `folder`; nothing else. For the one process that manages `folder`, before it saves.
pub fn remove_stale_staging(folder: &Path) -> Result<()> {
    if !folder.exists() {
        return Ok(());
    }
    for entry in std::fs::read_dir(folder)
        .with_context(|| format!("cannot list checkpoints in {}", folder.display()))?
    {
        let entry = entry?;
        let name = entry.file_name();
        let is_staging = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.strip_suffix(".tmp"))
            .is_some_and(|step| step.parse::<usize>().is_ok());
        if is_staging && entry.file_type()?.is_dir() {
            let path = entry.path();
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
            eprintln!("removed {}, left by an interrupted save", path.display());
        }
    }
    Ok(())
}

/// Stage 2 (every rank): rank `rank` of `ranks`' parameters and optimizer state into `tmp`.
pub fn write_training_shard(
    tmp: &Path,
    rank: usize,
    ranks: usize,
    checkpoint: &TrainingCheckpoint,
) -> Result<()> {
    let (model, optimizer) = shard_files(rank, ranks);
    write_tensors(&tmp.join(model), &checkpoint.params)?;
    write_tensors(&tmp.join(optimizer), &checkpoint.optimizer)
}

/// Stage 3 (one process, after every shard is written): `state.json`, `config.json`, the
/// `tokenizer.json` the data was tokenized with (if not byte level) and, last,
/// `checksums.json`, the rename into place, and the rotation to the newest `keep_latest_k`.
/// Returns the folder.
pub fn finish_training(
    tmp: &Path,
    folder: &Path,
    keep_latest_k: usize,
    state: &TrainingState,
    tokenizer: Option<&[u8]>,
) -> Result<PathBuf> {
    write_json(
        &tmp.join("config.json"),
        &hf_config_json(&state.model, state.dtype.kind()),
    )?;
    if let Some(json) = tokenizer {
        write_atomically(&tmp.join(TOKENIZER_FILE), json)?;
    }
    write_json(&tmp.join("state.json"), state)?;
    write_checksums(tmp)?;
    let dir = folder.join(step_folder(state.step));
    std::fs::rename(tmp, &dir)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), dir.display()))?;
    // The new checkpoint is in place: failing to remove an old one is only worth a warning.
    if keep_latest_k > 0 {
        let all = list_checkpoints(folder).unwrap_or_default();
        for (_, old) in &all[..all.len().saturating_sub(keep_latest_k)] {
            if let Err(err) = std::fs::remove_dir_all(old) {
                eprintln!(
                    "warning: cannot remove old checkpoint {}: {err}",
                    old.display()
                );
            }
        }
    }
    Ok(dir)
}

/// Removes a checkpoint's temporary folder after a failed save.
pub fn abandon_training(tmp: &Path) {
    let _ = std::fs::remove_dir_all(tmp);
}

/// Whether `dir` is a training checkpoint (rather than a Hugging Face directory).
pub fn is_training_checkpoint(dir: &Path) -> bool {
    dir.join("state.json").is_file()
}

fn read_state(dir: &Path) -> Result<TrainingState> {
    let state_path = dir.join("state.json");
    let text = crate::files::read_text(&state_path)?;
    let state: TrainingState = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a valid training state", state_path.display()))?;
    state
        .model
        .validate()
        .with_context(|| format!("in {}", state_path.display()))?;
    ensure!(
        state.expert_parallel_degree >= 1
            && state
                .model
                .num_experts
                .is_multiple_of(state.expert_parallel_degree),
        "{}: expert_parallel_degree {} does not divide num_experts {}",
        state_path.display(),
        state.expert_parallel_degree,
        state.model.num_experts
    );
    Ok(state)
}

/// Reads a training checkpoint folder as one model: an expert-parallel checkpoint's shards
/// are merged (replicated tensors from rank 0, expert tensors and their optimizer state
/// concatenated in rank order), for evaluation and export.
pub fn load_training(dir: &Path) -> Result<TrainingCheckpoint> {
    verify_checkpoint(dir)?;
    let state = read_state(dir)?;
    let ranks = state.expert_parallel_degree;
    let mut shards = (0..ranks)
        .map(|rank| read_shard(dir, rank, ranks))
        .collect::<Result<Vec<_>>>()?;
    if ranks == 1 {
        let (params, optimizer) = shards.remove(0);
        return Ok(TrainingCheckpoint {
            state,
            params,
            optimizer,
        });
    }
    let (params, optimizer): (Vec<_>, Vec<_>) = shards.into_iter().unzip();
    Ok(TrainingCheckpoint {
        params: merge_shards(params, dir)?,
        optimizer: merge_shards(optimizer, dir)?,
        state,
    })
}

/// Reads rank `rank`'s part of an expert-parallel training checkpoint (the whole checkpoint
/// for a single process's), to resume that rank; the checkpoint must have been saved by `ranks`
/// ranks, and verified ([`select_checkpoint`]).
pub fn load_training_shard(dir: &Path, rank: usize, ranks: usize) -> Result<TrainingCheckpoint> {
    let state = read_state(dir)?;
    ensure!(
        state.expert_parallel_degree == ranks,
        "{} was saved by {} rank(s); resume it with parallelism.expert_parallel_degree = {} \
         (this run has {ranks})",
        dir.display(),
        state.expert_parallel_degree,
        state.expert_parallel_degree
    );
    let (params, optimizer) = read_shard(dir, rank, ranks)?;
    Ok(TrainingCheckpoint {
        state,
        params,
        optimizer,
    })
}

type Tensors = BTreeMap<String, Tensor>;

fn read_shard(dir: &Path, rank: usize, ranks: usize) -> Result<(Tensors, Tensors)> {
    let (model, optimizer) = shard_files(rank, ranks);
    Ok((
        read_tensors(&dir.join(model))?,
        read_tensors(&dir.join(optimizer))?,
    ))
}

/// One map from every rank's: tensors whose names end in a fused expert weight's suffix are
/// concatenated along the expert dimension in rank order (every rank must hold them); the
/// others are rank 0's.
fn merge_shards(shards: Vec<Tensors>, dir: &Path) -> Result<Tensors> {
    let mut shards = shards.into_iter();
    let Some(mut merged) = shards.next() else {
        return Ok(Tensors::new());
    };
    let rest: Vec<Tensors> = shards.collect();
    for (name, tensor) in &mut merged {
        if name.ends_with(GATE_UP) || name.ends_with(DOWN) {
            // Every rank holds as many experts of the same shape as rank 0 (which `cat` needs;
            // the merged shape is checked against the model afterwards).
            ensure!(
                tensor.dim() > 0,
                "{}: rank 0's `{name}` has no expert dimension",
                dir.display()
            );
            let mut parts = vec![tensor.shallow_clone()];
            for (index, shard) in rest.iter().enumerate() {
                let rank = index + 1;
                let part = shard.get(name).with_context(|| {
                    format!("{}: rank {rank}'s shard has no `{name}`", dir.display())
                })?;
                ensure!(
                    part.size() == tensor.size(),
                    "{}: rank {rank}'s `{name}` has shape {:?}, rank 0's has {:?}",
                    dir.display(),
                    part.size(),
                    tensor.size()
                );
                parts.push(part.shallow_clone());
            }
            *tensor = Tensor::cat(&parts, 0);
        }
    }
    Ok(merged)
}

/// Copies a checkpoint's tensors into `params` (same names and shapes).
pub fn assign_params(
    params: &[(String, Tensor)],
    values: &BTreeMap<String, Tensor>,
    source: &Path,
) -> Result<()> {
    assign(params, source, |name, shape| {
        let value = values
            .get(name)
            .with_context(|| format!("{}: missing tensor `{name}`", source.display()))?;
        ensure!(
            value.size() == shape,
            "{}: tensor `{name}` has shape {:?}, the model expects {shape:?}",
            source.display(),
            value.size()
        );
        Ok(value.shallow_clone())
    })
}
