//! Training checkpoints: model, AdamW state, step and data position, which resume a run
//! exactly (Hugging Face directories are [`crate::hf`]'s).
//!
//! Everything is written into a temporary folder beside the destination and renamed into place
//! once complete, so an existing checkpoint or export is never overwritten or left half-written.
//! A training checkpoint's last file, `checksums.json`, records the length and CRC-32 of every
//! other file; a resume takes the newest checkpoint whose files still match it.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use moekit_tools::golden::write_atomically;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::config::ParamDtype;
use crate::files::{assign, read_tensors, write_json, write_tensors};
use crate::hf::{DOWN, GATE_UP, TOKENIZER_FILE, hf_config_json};
use crate::model::ModelConfig;

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
    /// D, the replicas that trained (each holding what the files hold).
    #[serde(default = "one_rank")]
    pub data_parallel_degree: usize,
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
/// for a single process's), to resume that rank of a replica of `ranks`, one of `replicas`;
/// the checkpoint must have been saved by the same layout, and verified
/// ([`select_checkpoint`]).
pub fn load_training_shard(
    dir: &Path,
    rank: usize,
    ranks: usize,
    replicas: usize,
) -> Result<TrainingCheckpoint> {
    let state = read_state(dir)?;
    let (saved_ranks, saved_replicas) = (state.expert_parallel_degree, state.data_parallel_degree);
    ensure!(
        (saved_ranks, saved_replicas) == (ranks, replicas),
        "{} was saved by {saved_replicas} replica(s) of {saved_ranks} rank(s); resume it with \
         parallelism.expert_parallel_degree = {saved_ranks} and data_parallel_degree = \
         {saved_replicas} (this run has {ranks} and {replicas})",
        dir.display(),
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
