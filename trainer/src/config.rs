//! The job config: a TOML file laid out like torchtitan's (`[job]`, `[model]`, `[kernels]`,
//! `[training]`, `[parallelism]`, `[optimizer]`, `[lr_scheduler]`, `[checkpoint]`, `[data]`,
//! `[metrics]`), where any key can be overridden on the command line as `--section.key VALUE`.
//!
//! Every unknown key, bad value and impossible combination is an error from [`JobConfig::load`],
//! before any work starts.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use toml::{Table, Value};

use moekit::ep::MpiComm;

use crate::device::TrainDevice;
use crate::model::{ModelConfig, ModelName};
use crate::moe::{MoeImpl, check_grouped_mm_alignment};

/// A validated job config.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct JobConfig {
    pub job: Job,
    pub model: ModelConfig,
    pub kernels: Kernels,
    pub training: Training,
    pub parallelism: Parallelism,
    pub optimizer: Optimizer,
    pub lr_scheduler: LrScheduler,
    pub checkpoint: Checkpoint,
    pub data: Data,
    pub metrics: Metrics,
}

/// `[job]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Job {
    /// Where metrics (and later checkpoints and plots) are written; relative paths are taken
    /// from the working directory.
    pub dump_folder: PathBuf,
    /// Seeds parameter initialisation and data shuffling.
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub description: String,
}

impl Job {
    fn validate(&self) -> Result<()> {
        // An empty path (an unset shell variable) would write into the current directory.
        ensure!(
            !self.dump_folder.as_os_str().is_empty(),
            "job.dump_folder is empty: name the folder for metrics, plots and checkpoints"
        );
        Ok(())
    }
}

/// `[kernels]`: which implementation runs the MoE experts (optional: `cpu`, and a dense model
/// has no experts).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Kernels {
    #[serde(default)]
    pub moe: MoeImpl,
    /// B, token slots per block of the moekit block plan (`reference`, `cpu`, `neuron`).
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// `neuron`: the kernel manifest naming the NEFFs (`moekit-train neffs` lists the entries
    /// a config needs); `MOEKIT_NEURON_MANIFEST`, else `./kernels.toml`, if unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub neuron_manifest: Option<PathBuf>,
    /// `neuron`: the Neuron runtime library (libnrt.so) to open; `NEURON_RT_LIB`, else the
    /// Neuron SDK's default paths, if unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub neuron_runtime: Option<PathBuf>,
}

/// `{name} must be at least 1`, for counts where 0 means nothing.
fn at_least_one(name: &str, value: usize) -> Result<()> {
    ensure!(value > 0, "{name} must be at least 1, got {value}");
    Ok(())
}

impl Kernels {
    fn validate(&self) -> Result<()> {
        at_least_one("kernels.block_size", self.block_size)
    }
}

fn default_block_size() -> usize {
    moekit::experts::LocalExperts::DEFAULT_BLOCK_SIZE
}

/// `[training]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Training {
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Micro-batches whose gradients are summed (each loss divided by this) per step.
    #[serde(default = "one")]
    pub gradient_accumulation_steps: usize,
    /// Global gradient-norm clipping threshold; 0 disables clipping.
    #[serde(default)]
    pub max_norm: f64,
    /// libtorch intra-op threads; 0 keeps libtorch's default.
    #[serde(default)]
    pub threads: usize,
    /// Aux-loss-free balancing (torchtitan's): after each step every MoE layer's selection
    /// bias moves by `load_balance_coeff · sign(mean load − expert load)`, mean-centred. 0 (the
    /// default) leaves the bias at zero, which is Hugging Face's router.
    #[serde(default)]
    pub load_balance_coeff: f64,
    /// Parameter and activation dtype. With bf16, AdamW keeps f32 master weights and moments;
    /// norms, softmaxes and losses still compute in f32.
    #[serde(default)]
    pub dtype: ParamDtype,
    /// Where the model, optimizer state and batches live: `cpu` or `cuda` (the first GPU).
    #[serde(default)]
    pub device: TrainDevice,
}

impl Training {
    fn validate(&self) -> Result<()> {
        at_least_one("training.steps", self.steps)?;
        at_least_one("training.batch_size", self.batch_size)?;
        at_least_one(
            "training.gradient_accumulation_steps",
            self.gradient_accumulation_steps,
        )?;
        ensure!(
            self.threads <= 4096,
            "training.threads must be at most 4096 (0 keeps libtorch's default), got {}",
            self.threads
        );
        ensure!(
            self.seq_len >= 2,
            "training.seq_len must be at least 2 (a sequence predicts its next tokens), got {}",
            self.seq_len
        );
        ensure!(
            self.max_norm.is_finite() && self.max_norm >= 0.0,
            "training.max_norm must be a non-negative finite number (0 disables clipping), got {}",
            self.max_norm
        );
        ensure!(
            self.load_balance_coeff.is_finite() && self.load_balance_coeff >= 0.0,
            "training.load_balance_coeff must be a non-negative finite number, got {}",
            self.load_balance_coeff
        );
        Ok(())
    }
}

/// `training.dtype`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ParamDtype {
    #[default]
    Float32,
    Bfloat16,
}

impl ParamDtype {
    pub fn kind(self) -> tch::Kind {
        match self {
            ParamDtype::Float32 => tch::Kind::Float,
            ParamDtype::Bfloat16 => tch::Kind::BFloat16,
        }
    }
}

fn one() -> usize {
    1
}

/// `[parallelism]`: R·D ranks, launched as `mpirun -n R·D moekit-train ...` (one process
/// when both are 1), form D replicas of R ranks each: world rank `d·R + r` is rank r of
/// replica d.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Parallelism {
    /// R, the ranks of a replica, over which the experts of every MoE layer are sharded (each
    /// holds E/R of them).
    #[serde(default = "one")]
    pub expert_parallel_degree: usize,
    /// D, the replicas: each holds the whole model (its experts sharded over its R ranks),
    /// and every rank trains on its own slice of every global batch.
    #[serde(default = "one")]
    pub data_parallel_degree: usize,
    /// Seconds a rank waits in an exchange for the others before the job stops with an error
    /// naming the ranks that did not answer (stopped, hung or lost).
    #[serde(default = "default_collective_timeout_s")]
    pub collective_timeout_s: u64,
}

impl Parallelism {
    fn validate(&self) -> Result<()> {
        ensure!(
            self.expert_parallel_degree >= 1,
            "parallelism.expert_parallel_degree must be at least 1, got 0"
        );
        ensure!(
            self.data_parallel_degree >= 1,
            "parallelism.data_parallel_degree must be at least 1, got 0"
        );
        self.ranks()?;
        ensure!(
            self.collective_timeout_s >= 1,
            "parallelism.collective_timeout_s must be at least 1, got 0"
        );
        Ok(())
    }
}

impl Parallelism {
    /// R·D, the ranks of the run.
    pub fn ranks(&self) -> Result<usize> {
        self.expert_parallel_degree
            .checked_mul(self.data_parallel_degree)
            .with_context(|| {
                format!(
                    "parallelism.expert_parallel_degree × data_parallel_degree = {} × {} \
                     overflows",
                    self.expert_parallel_degree, self.data_parallel_degree
                )
            })
    }
}

fn default_collective_timeout_s() -> u64 {
    MpiComm::DEFAULT_TIMEOUT.as_secs()
}

/// `[optimizer]`: AdamW with decoupled weight decay (PyTorch's `torch.optim.AdamW`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Optimizer {
    #[serde(default = "default_optimizer_name")]
    pub name: String,
    /// Peak learning rate.
    pub lr: f64,
    #[serde(default = "default_betas")]
    pub betas: [f64; 2],
    #[serde(default = "default_eps")]
    pub eps: f64,
    #[serde(default)]
    pub weight_decay: f64,
}

impl Optimizer {
    fn validate(&self) -> Result<()> {
        ensure!(
            self.name == "AdamW",
            "optimizer.name \"{}\" is not supported; the trainer implements \"AdamW\"",
            self.name
        );
        ensure!(
            self.lr.is_finite() && self.lr > 0.0,
            "optimizer.lr must be a positive finite number, got {}",
            self.lr
        );
        for (index, beta) in self.betas.iter().enumerate() {
            ensure!(
                (0.0..1.0).contains(beta),
                "optimizer.betas[{index}] must be in [0, 1), got {beta}"
            );
        }
        ensure!(
            self.eps.is_finite() && self.eps > 0.0,
            "optimizer.eps must be a positive finite number, got {}",
            self.eps
        );
        ensure!(
            self.weight_decay.is_finite() && self.weight_decay >= 0.0,
            "optimizer.weight_decay must be a non-negative finite number, got {}",
            self.weight_decay
        );
        Ok(())
    }
}

fn default_optimizer_name() -> String {
    "AdamW".to_owned()
}
fn default_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn default_eps() -> f64 {
    1e-8
}

/// How the learning rate decays after warmup.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DecayType {
    Cosine,
    Linear,
    Constant,
}

/// `[lr_scheduler]`: linear warmup from `lr / warmup_steps` to `optimizer.lr` over
/// `warmup_steps`, then decay to `min_lr_factor · lr` at the last step.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LrScheduler {
    #[serde(default)]
    pub warmup_steps: usize,
    #[serde(default = "default_decay_type")]
    pub decay_type: DecayType,
    #[serde(default)]
    pub min_lr_factor: f64,
}

impl LrScheduler {
    fn validate(&self) -> Result<()> {
        ensure!(
            (0.0..=1.0).contains(&self.min_lr_factor),
            "lr_scheduler.min_lr_factor must be in [0, 1], got {}",
            self.min_lr_factor
        );
        Ok(())
    }
}

fn default_decay_type() -> DecayType {
    DecayType::Cosine
}

/// `[data]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Data {
    /// `"byte"` (one token per UTF-8 byte, ids 0–255) or the path of a Hugging Face
    /// `tokenizer.json`, relative to the config file's folder.
    #[serde(default = "default_tokenizer")]
    pub tokenizer: String,
    /// Text files to train on; empty trains on the built-in corpus.
    #[serde(default)]
    pub files: Vec<PathBuf>,
    /// Held-out text files, the validation split (never trained on).
    #[serde(default)]
    pub validation_files: Vec<PathBuf>,
    /// Or the share of the training text's `seq_len` windows held out as the validation split
    /// (its tail), in [0, 1); 0 without `validation_files`: no validation.
    #[serde(default)]
    pub validation_fraction: f64,
}

impl Data {
    fn validate(&self) -> Result<()> {
        if self.tokenizer != "byte" {
            ensure!(
                Path::new(&self.tokenizer).is_file(),
                "data.tokenizer: {} is neither \"byte\" nor an existing tokenizer.json file",
                self.tokenizer
            );
        }
        for (key, files) in [
            ("data.files", &self.files),
            ("data.validation_files", &self.validation_files),
        ] {
            for file in files {
                ensure!(
                    file.is_file(),
                    "{key}: {} does not exist or is not a file",
                    file.display()
                );
            }
        }
        ensure!(
            self.validation_fraction.is_finite() && (0.0..1.0).contains(&self.validation_fraction),
            "data.validation_fraction must be in [0, 1), got {}",
            self.validation_fraction
        );
        ensure!(
            self.validation_files.is_empty() || self.validation_fraction == 0.0,
            "data.validation_files and data.validation_fraction = {} both name a validation \
             split: give one",
            self.validation_fraction
        );
        Ok(())
    }

    /// Whether a validation split is configured.
    pub fn has_validation(&self) -> bool {
        !self.validation_files.is_empty() || self.validation_fraction > 0.0
    }
}

fn default_tokenizer() -> String {
    "byte".to_owned()
}

/// `[checkpoint]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    /// Save training checkpoints, and resume from the newest one found in `folder`.
    #[serde(default)]
    pub enable: bool,
    /// Where training checkpoints go, relative to `job.dump_folder`.
    #[serde(default = "default_checkpoint_folder")]
    pub folder: PathBuf,
    /// Steps between checkpoints (the last step is always saved).
    #[serde(default = "default_checkpoint_interval")]
    pub interval: usize,
    /// Checkpoints kept (the newest); 0 keeps all.
    #[serde(default = "default_keep_latest_k")]
    pub keep_latest_k: usize,
    /// A Hugging Face model directory to start from (relative to the working directory);
    /// ignored when a training checkpoint is resumed.
    #[serde(default)]
    pub initial_load_path: Option<PathBuf>,
}

impl Checkpoint {
    fn validate(&self) -> Result<()> {
        at_least_one("checkpoint.interval", self.interval)?;
        if let Some(path) = &self.initial_load_path {
            ensure!(
                path.join("config.json").is_file(),
                "checkpoint.initial_load_path: {} is not a Hugging Face model directory (no \
                 config.json)",
                path.display()
            );
        }
        Ok(())
    }
}

fn default_checkpoint_folder() -> PathBuf {
    PathBuf::from("checkpoints")
}
fn default_checkpoint_interval() -> usize {
    100
}
fn default_keep_latest_k() -> usize {
    2
}

/// `[metrics]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Metrics {
    /// Print a progress line every `log_freq` steps (and at the last step).
    #[serde(default = "default_log_freq")]
    pub log_freq: usize,
    /// With a validation split: steps between evaluations of the validation loss (and the last
    /// step); 0 evaluates every `log_freq` steps.
    #[serde(default)]
    pub eval_interval: usize,
    /// Global batches of the validation split each evaluation averages over: its first ones,
    /// the same every time.
    #[serde(default = "default_eval_batches")]
    pub eval_batches: usize,
}

fn default_log_freq() -> usize {
    10
}

fn default_eval_batches() -> usize {
    4
}

impl Metrics {
    /// Whether the validation loss is evaluated after step `step` of `steps`.
    pub fn evaluates_at(&self, step: usize, steps: usize) -> bool {
        let interval = match self.eval_interval {
            0 => self.log_freq,
            n => n,
        };
        step.is_multiple_of(interval) || step == steps
    }

    fn validate(&self) -> Result<()> {
        at_least_one("metrics.log_freq", self.log_freq)?;
        at_least_one("metrics.eval_batches", self.eval_batches)
    }
}

const SECTIONS: &[&str] = &[
    "job",
    "model",
    "kernels",
    "training",
    "parallelism",
    "optimizer",
    "lr_scheduler",
    "checkpoint",
    "data",
    "metrics",
];

/// Sections that may be left out entirely (every key has a default).
const OPTIONAL_SECTIONS: &[&str] = &[
    "kernels",
    "parallelism",
    "lr_scheduler",
    "checkpoint",
    "data",
    "metrics",
];

impl JobConfig {
    /// Reads `path`, applies `overrides` (`("training.steps", "20")`: the value is parsed as a
    /// TOML value, or taken as a string when it is not one) and validates the result. Paths in
    /// the file (`model.config_json`, `data.files`) are relative to the file's folder.
    pub fn load(path: &Path, overrides: &[(String, String)]) -> Result<Self> {
        let text = crate::files::read_text(path)
            .with_context(|| format!("cannot read job config {}", path.display()))?;
        let mut table: Table = toml::from_str(&text)
            .with_context(|| format!("{} is not a valid TOML file", path.display()))?;
        for (key, value) in overrides {
            apply_override(&mut table, key, value)?;
        }
        let base = path.parent().unwrap_or(Path::new("."));
        Self::from_table(table, base).with_context(|| format!("in job config {}", path.display()))
    }

    /// Every setting, defaults included, as `("section.key", value in JSON)` sorted by key: what
    /// ranks compare to agree that they run the same job.
    pub fn entries(&self) -> Result<Vec<(String, String)>> {
        fn flatten(key: String, value: serde_json::Value, entries: &mut Vec<(String, String)>) {
            match value {
                serde_json::Value::Object(fields) => {
                    for (name, value) in fields {
                        flatten(format!("{key}.{name}"), value, entries);
                    }
                }
                value => entries.push((key, value.to_string())),
            }
        }
        let serde_json::Value::Object(sections) =
            serde_json::to_value(self).context("cannot serialise the job config")?
        else {
            bail!("the job config did not serialise to sections");
        };
        let mut entries = Vec::new();
        for (name, value) in sections {
            flatten(name, value, &mut entries);
        }
        Ok(entries)
    }

    /// Builds and validates a config from a parsed TOML table; relative paths are taken from
    /// `base`.
    pub fn from_table(mut table: Table, base: &Path) -> Result<Self> {
        if let Some(unknown) = table.keys().find(|k| !SECTIONS.contains(&k.as_str())) {
            bail!(
                "unknown section `[{unknown}]`; the sections are {}",
                SECTIONS.join(", ")
            );
        }
        let mut take = |name: &str| -> Result<Table> {
            match table.remove(name) {
                Some(Value::Table(section)) => Ok(section),
                Some(other) => bail!("`{name}` must be a section, got {}", other.type_str()),
                None if OPTIONAL_SECTIONS.contains(&name) => Ok(Table::new()),
                None => bail!("missing section `[{name}]`"),
            }
        };
        let job: Job = section("job", take("job")?)?;
        let model = model_section(take("model")?, base)?;
        let kernels: Kernels = section("kernels", take("kernels")?)?;
        let training: Training = section("training", take("training")?)?;
        let parallelism: Parallelism = section("parallelism", take("parallelism")?)?;
        let optimizer: Optimizer = section("optimizer", take("optimizer")?)?;
        let lr_scheduler: LrScheduler = section("lr_scheduler", take("lr_scheduler")?)?;
        let checkpoint: Checkpoint = section("checkpoint", take("checkpoint")?)?;
        let mut data: Data = section("data", take("data")?)?;
        let metrics: Metrics = section("metrics", take("metrics")?)?;
        for file in data.files.iter_mut().chain(&mut data.validation_files) {
            if file.is_relative() {
                *file = base.join(&*file);
            }
        }
        if data.tokenizer != "byte" && Path::new(&data.tokenizer).is_relative() {
            data.tokenizer = base.join(&data.tokenizer).to_string_lossy().into_owned();
        }
        let config = Self {
            job,
            model,
            kernels,
            training,
            parallelism,
            optimizer,
            lr_scheduler,
            checkpoint,
            data,
            metrics,
        };
        config.validate()?;
        Ok(config)
    }

    /// Expert parallelism needs E divisible by R and moekit's kernels (which run the
    /// exchange) on the host.
    fn validate_parallelism(&self) -> Result<()> {
        let ranks = self.parallelism.expert_parallel_degree;
        if ranks == 1 {
            return Ok(());
        }
        ensure!(
            self.model.name == ModelName::Qwen3Moe,
            "parallelism.expert_parallel_degree = {ranks} shards experts, but model.name = \
             \"qwen3\" is the dense Qwen3, which has none"
        );
        ensure!(
            self.model.num_experts.is_multiple_of(ranks),
            "parallelism.expert_parallel_degree = {ranks} must divide model.num_experts = {}",
            self.model.num_experts
        );
        ensure!(
            self.kernels.moe.kernel_backend().is_some(),
            "parallelism.expert_parallel_degree = {ranks} exchanges tokens with moekit's \
             dispatch and combine: kernels.moe must be reference, cpu or neuron, got {}",
            self.kernels.moe.name()
        );
        Ok(())
    }

    /// Each section on its own (next to its definition), then what one section asks of
    /// another.
    fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.job.validate()?;
        self.kernels.validate()?;
        self.training.validate()?;
        self.parallelism.validate()?;
        self.optimizer.validate()?;
        self.lr_scheduler.validate()?;
        self.data.validate()?;
        self.checkpoint.validate()?;
        self.metrics.validate()?;
        let Self {
            model,
            kernels,
            training,
            lr_scheduler,
            data,
            metrics,
            ..
        } = self;
        self.validate_parallelism()?;
        if training.device == TrainDevice::Cuda {
            ensure!(
                kernels.moe.runs_on_cuda(),
                "kernels.moe = \"{}\" runs on the host CPU; with training.device = \"cuda\" \
                 choose torch or grouped_mm",
                kernels.moe.name()
            );
        }
        if kernels.moe == MoeImpl::GroupedMm {
            check_grouped_mm_alignment(
                model.hidden_size,
                model.moe_intermediate_size,
                training.dtype.kind().elt_size_in_bytes(),
            )?;
        }
        ensure!(
            training.seq_len <= model.max_position_embeddings,
            "training.seq_len ({}) exceeds model.max_position_embeddings ({})",
            training.seq_len,
            model.max_position_embeddings
        );
        ensure!(
            lr_scheduler.warmup_steps <= training.steps,
            "lr_scheduler.warmup_steps ({}) exceeds training.steps ({})",
            lr_scheduler.warmup_steps,
            training.steps
        );
        if data.tokenizer == "byte" {
            ensure!(
                model.vocab_size >= 256,
                "the byte tokenizer needs model.vocab_size >= 256, got {}",
                model.vocab_size
            );
        }
        ensure!(
            metrics.eval_interval == 0 || data.has_validation(),
            "metrics.eval_interval = {} needs a validation split to evaluate: set \
             data.validation_files or data.validation_fraction",
            metrics.eval_interval
        );
        Ok(())
    }
}

/// Deserializes one section, naming it in the error.
fn section<T: DeserializeOwned>(name: &str, table: Table) -> Result<T> {
    T::deserialize(Value::Table(table)).with_context(|| format!("in section [{name}]"))
}

/// `[model]` is either `config_json = "path/to/config.json"` alone, or the hyper-parameters
/// inline under their Hugging Face names.
fn model_section(table: Table, base: &Path) -> Result<ModelConfig> {
    match table.get("config_json") {
        Some(Value::String(path)) => {
            if let Some(other) = table.keys().find(|k| *k != "config_json") {
                bail!(
                    "in section [model]: `config_json` defines the whole model, so `{other}` \
                     cannot be set beside it"
                );
            }
            ModelConfig::from_hf_config_json(&base.join(path))
        }
        Some(other) => bail!(
            "in section [model]: `config_json` must be a path string, got {}",
            other.type_str()
        ),
        None => section("model", table),
    }
}

/// Sets `section.key` (dotted, any depth) in `table` to `raw`, parsed as a TOML value when it is
/// one (`20`, `1e-3`, `true`, `[0.9, 0.95]`) and as a string otherwise.
fn apply_override(table: &mut Table, key: &str, raw: &str) -> Result<()> {
    let parts: Vec<&str> = key.split('.').collect();
    ensure!(
        parts.len() >= 2 && parts.iter().all(|p| !p.is_empty()),
        "override `--{key}` must name a section and a key, e.g. `--training.steps`"
    );
    let value = toml::from_str::<Table>(&format!("value = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("value"))
        .unwrap_or_else(|| Value::String(raw.to_owned()));
    let (last, path) = parts.split_last().expect("at least two parts");
    let mut current = table;
    for part in path {
        let entry = current
            .entry(part.to_string())
            .or_insert_with(|| Value::Table(Table::new()));
        current = match entry {
            Value::Table(t) => t,
            other => bail!(
                "override `--{key}`: `{part}` is a {}, not a section",
                other.type_str()
            ),
        };
    }
    current.insert(last.to_string(), value);
    Ok(())
}
